"""The files a run's logger writes and reads back: ``metrics.jsonl`` records (non-finite values
stored as the strings ``"nan"``, ``"inf"``, ``"-inf"``, see :mod:`splitrl.logging.logger`) and
atomic writes (one rename). Below both the logger and the plot, which use them."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["read_metrics", "write_atomically"]

_JSON_TO_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` file: one dict per line, in file order.

    ``"nan"``, ``"inf"`` and ``"-inf"`` strings are turned back into floats; blank lines are
    skipped.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not a JSON object (the message gives the line number).
    """
    path = Path(path)
    records = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if line.strip():
            records.append(_decode_non_finite(_parse_line(path, line_no, line)))
    return records


def _encode_non_finite(record: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        out[key] = value
    return out


def _decode_non_finite(record: dict[str, Any]) -> dict[str, Any]:
    return {
        key: _JSON_TO_NON_FINITE[value] if isinstance(value, str) and value in _JSON_TO_NON_FINITE else value
        for key, value in record.items()
    }


def _parse_line(path: Path, line_no: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{line_no} is not valid JSON ({err.msg}): {line[:80]!r}") from err
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{line_no} is not a JSON object: {line[:80]!r}")
    return record


def write_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and one rename:
    readers see the old file or the whole new one, never a partial one.

    Raises:
        OSError: the write failed (e.g. ENOSPC); the temporary file is removed and ``path`` is
            unchanged.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
