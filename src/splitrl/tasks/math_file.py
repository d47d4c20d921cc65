"""Math problems from a local file, answers checked with math-verify.

The file is a JSON-lines file (``.jsonl``), a parquet file (``.parquet``) or a directory written
by Hugging Face ``datasets``' ``save_to_disk``. Each row gives a prompt and a reference answer in
configurable columns. A response is correct (reward 1.0) when math-verify finds an expression in
it (``\\boxed{...}``, ``$...$`` or a plain expression such as ``1/2``) that equals the reference
(``0.5``, ``\\frac{1}{2}``, ...); else 0.0.

math-verify's own time limits use ``signal.alarm`` (main thread only, whole seconds, a timeout
reads as a wrong answer), so they are switched off here: the time limit is enforced by
:mod:`splitrl.tasks.scoring`, which also reports a timed-out check as such.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from splitrl.tasks.base import Task, TaskOptions, TaskPrompt

_PROMPT_SLOT = "{prompt}"


class MathFileTaskConfig(TaskOptions):
    """Prompts and answers from a local file.

    Attributes:
        path: a ``.jsonl`` file, a ``.parquet`` file, or a ``save_to_disk`` directory. A
            relative path is made absolute when the config is loaded, so processes started in
            another directory (scoring workers, Ray actors) read the same file.
        prompt_column: column (JSON key) holding the problem text.
        answer_column: column holding the reference answer (numbers are turned into strings).
            Every row needs a non-empty problem text and a non-empty answer (text or a finite
            number); the rows that lack one are all named in one error, which gives the
            ``skip_rows`` that leaves them out.
        split: split to read when the directory holds a ``DatasetDict`` with several splits.
        prompt_template: text around the problem; ``{prompt}`` is replaced by it (other braces,
            e.g. ``\\boxed{}``, are kept as they are).
        shuffle: serve rows in an order permuted by ``seed`` instead of file order.
        seed: seed of that permutation.
        skip_rows: rows (0-indexed, in file order, blank JSONL lines not counted) left out of
            the task. Preflight adds the rows whose prompt does not fit the model's context
            (and warns, naming them), so every process serves the same prompts.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["math_file"] = "math_file"
    path: str
    prompt_column: str = "problem"
    answer_column: str = "answer"
    split: str | None = None
    prompt_template: str = _PROMPT_SLOT
    shuffle: bool = False
    seed: int = Field(0, ge=0)
    skip_rows: list[int] = Field(default_factory=list)

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        return str(Path(path).expanduser().absolute())

    @field_validator("skip_rows")
    @classmethod
    def _rows_from_zero(cls, rows: list[int]) -> list[int]:
        negative = sorted({r for r in rows if r < 0})
        if negative:
            raise ValueError(f"skip_rows has negative row numbers {negative}: rows count from 0 in file order")
        return rows

    @field_validator("prompt_template")
    @classmethod
    def _has_slot(cls, template: str) -> str:
        if _PROMPT_SLOT not in template:
            raise ValueError(f"prompt_template must contain {_PROMPT_SLOT!r} where the problem goes, got {template!r}")
        return template


class MathFileTask(Task):
    """Rows of a local file as prompts; rewards from math-verify's ``parse`` + ``verify``.

    Raises:
        ValueError: at construction, when the path does not exist, its type is not supported,
            a column is missing (the message lists the columns found), a directory holds several
            splits and ``split`` is not set, the file has no rows, ``skip_rows`` leaves none or
            names a row beyond the file's last;
            and when rows not in ``skip_rows`` are bad (a JSON-lines line that is not UTF-8,
            JSON or an object; a problem or answer missing, null, empty or not text — a number
            is fine as an answer): every such row in one message, with its line and the
            ``task.skip_rows`` that leaves them out.
    """

    def __init__(self, config: MathFileTaskConfig):
        import numpy as np  # here, not at the top: validating a run config should not load it

        prompts, answers, labels = _load_columns(config)
        if not prompts:
            raise ValueError(f"{config.path} holds no rows")
        self.config = config
        self._prompts = prompts
        self._answers = answers
        self._labels = labels
        skip = set(config.skip_rows)
        kept = np.array([r for r in range(len(prompts)) if r not in skip], dtype=np.int64)
        if kept.size == 0:
            raise ValueError(f"{config.path}: skip_rows leaves none of its {len(prompts)} rows")
        self._order = np.random.default_rng(config.seed).permutation(kept) if config.shuffle else kept

    def row_label(self, row: int) -> str:
        """Where row ``row`` (0-indexed) is in the file, for messages: ``line N`` of a JSONL file,
        else ``row N``."""
        return self._labels[row] if self._labels is not None else f"row {row}"

    @property
    def num_prompts(self) -> int:
        return len(self._order)

    def source_of(self, index: int) -> tuple[str, str]:
        """(the file's resolved path, :meth:`row_label` of its row) of prompt ``index``."""
        return (str(Path(self.config.path).resolve()), self.row_label(int(self._order[index])))

    def _make_prompt(self, index: int) -> TaskPrompt:
        row = int(self._order[index])
        text = self.config.prompt_template.replace(_PROMPT_SLOT, self._prompts[row])
        return TaskPrompt(index=index, text=text, answer=self._answers[row], metadata={"row": row})

    def score(self, prompt: TaskPrompt, response_text: str) -> float:
        return math_verify_score(prompt.answer, response_text)


def math_verify_score(reference: str, response_text: str) -> float:
    """1.0 when math-verify finds an expression in ``response_text`` equal to ``reference``, else 0.0.

    math-verify's own time limits are off (see the module docstring): call it through
    :mod:`splitrl.tasks.scoring`, which enforces one.
    """
    from math_verify import parse, verify

    if "$" not in reference and "\\boxed" not in reference:
        # Bare LaTeX such as \frac{1}{2} is only recognized inside math delimiters.
        reference = f"${reference}$"
    gold = parse(reference, parsing_timeout=None)
    predicted = parse(response_text, parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return float(verify(gold, predicted, timeout_seconds=None))


def _load_columns(config: MathFileTaskConfig) -> tuple[list[str], list[str], list[str] | None]:
    path = Path(config.path)
    columns = [config.prompt_column, config.answer_column]
    if not path.exists():
        raise ValueError(f"math_file path {str(path)!r} does not exist")
    if path.is_dir():
        found, read, labels = _saved_dataset_reader(path, config.split)
    elif path.suffix == ".parquet":
        found, read, labels = _parquet_reader(path)
    elif path.suffix == ".jsonl":
        found, read, labels = _jsonl_reader(path)
    else:
        raise ValueError(
            f"math_file path {str(path)!r}: unsupported file type {path.suffix!r}; use a .jsonl "
            "or .parquet file, or a directory written by datasets' save_to_disk"
        )
    for column in columns:
        if column not in found:
            raise ValueError(
                f"{str(path)!r} has no column {column!r}; columns found: {sorted(found)}. "
                "Set prompt_column / answer_column to the right names"
            )
    (prompts, answers), unreadable = read(columns)
    skip = set(config.skip_rows)
    beyond = sorted(r for r in skip if r >= len(prompts))
    if beyond:  # a row number for another file (or a typo): say it rather than skip nothing
        raise ValueError(
            f"{str(path)!r}: task.skip_rows names rows it does not have: {beyond[:_ROWS_SHOWN]} (it has "
            f"{len(prompts)} rows, 0-{len(prompts) - 1}); remove them from task.skip_rows"
        )
    bad: list[tuple[int, str]] = []  # (row, what is wrong), every bad row of the file in one pass
    texts, references = [], []
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        problems = (
            [unreadable[row]]
            if row in unreadable
            else [
                p for p in (_bad_prompt(config.prompt_column, prompt), _bad_answer(config.answer_column, answer)) if p
            ]
        )
        if problems and row not in skip:
            bad.append((row, ", ".join(problems)))
        ok = not problems
        texts.append(prompt if ok else "")  # a skipped bad row is never served
        references.append(str(answer) if ok else "")
    if bad:
        raise ValueError(_bad_rows_message(path, bad, len(prompts), labels, skip))
    return texts, references, labels


# A value a JSON-lines row lacks (a key present in other rows only).
_MISSING = object()


def _describe(value: object) -> str:
    if value is _MISSING:
        return "missing"
    if value is None:
        return "null"
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    kind = "a number" if _is_number(value) else type(value).__name__
    return f"{shown} ({kind}, not text)"


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bad_prompt(column: str, value: object) -> str | None:
    """What is wrong with a problem text, or None. It must be a non-empty string: a number or a
    null would be trained on as the text "17" or "None"."""
    if isinstance(value, str):
        return None if value.strip() else f"{column!r} is empty"
    return f"{column!r} is {_describe(value)}"


def _bad_answer(column: str, value: object) -> str | None:
    """What is wrong with a reference answer, or None. A non-empty string or a finite number (made
    a string); an empty or null answer can never score."""
    if isinstance(value, str):
        return None if value.strip() else f"{column!r} is empty"
    if _is_number(value):
        return None if math.isfinite(value) else f"{column!r} is {value!r}, not a number an answer can equal"
    return f"{column!r} is {_describe(value)}".replace("not text", "not text or a number")


_ROWS_SHOWN = 20
_SKIP_ROWS_LISTED = 200


def _bad_rows_message(
    path: Path, bad: list[tuple[int, str]], total: int, labels: list[str] | None, skip: set[int]
) -> str:
    def where(row: int) -> str:
        return f"{labels[row]} (row {row})" if labels is not None else f"row {row}"

    shown = "; ".join(f"{where(row)}: {what}" for row, what in bad[:_ROWS_SHOWN])
    if len(bad) > _ROWS_SHOWN:
        shown += f"; and {len(bad) - _ROWS_SHOWN} more"
    message = f"{str(path)!r}: {len(bad)} of its {total} rows cannot be trained on: {shown}. "
    if len(bad) == total:
        message += "Every row is bad: check prompt_column / answer_column and the file. "
    rows = sorted(skip | {row for row, _ in bad})
    if len(rows) <= _SKIP_ROWS_LISTED:
        counted = "rows count from 0 in file order" + (", blank lines not counted" if labels is not None else "")
        return (
            message + f"Fix these rows, or leave them out with task.skip_rows=[{','.join(map(str, rows))}] ({counted})"
        )
    return message + f"Fix these rows (task.skip_rows can leave rows out, but {len(rows)} are too many to list by hand)"


# Each reader returns (column names found, read(columns), where each row is in the file for
# messages, or None: "row N"). read returns one list of values per column and {row: why the row
# could not be read at all} (a JSON-lines line that is not UTF-8, not JSON or not an object).
_Reader = tuple[set[str], Callable[[list[str]], tuple[list[list], dict[int, str]]], list[str] | None]


def _jsonl_reader(path: Path) -> _Reader:
    rows: list[tuple[int, dict]] = []
    unreadable: dict[int, str] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                unreadable[len(rows)] = (
                    f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}: save the file as UTF-8)"
                )
                rows.append((number, {}))
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                unreadable[len(rows)] = f"not valid JSON ({exc})"
                row = {}
            if not isinstance(row, dict):
                unreadable[len(rows)] = f"not a JSON object (a {type(row).__name__})"
                row = {}
            rows.append((number, row))
    if not rows:
        raise ValueError(f"{str(path)!r} holds no rows")
    found = set().union(*(row.keys() for _, row in rows))

    def read(columns: list[str]) -> tuple[list[list], dict[int, str]]:
        return [[row.get(column, _MISSING) for _, row in rows] for column in columns], unreadable

    return found, read, [f"line {number}" for number, _ in rows]


def _parquet_reader(path: Path) -> _Reader:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def unreadable(exc: Exception) -> ValueError:
        return ValueError(f"{str(path)!r} cannot be read as parquet ({exc}); check that the file is whole")

    def read(columns: list[str]) -> list[list]:
        try:
            table = pq.read_table(path, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise unreadable(exc) from None
        return [table.column(column).to_pylist() for column in columns], {}

    try:
        names = set(pq.read_schema(path).names)
    except (OSError, pa.ArrowException) as exc:
        raise unreadable(exc) from None
    return names, read, None


def _saved_dataset_reader(path: Path, split: str | None) -> _Reader:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ValueError(f"{str(path)!r} is a directory but not one written by datasets' save_to_disk: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            raise ValueError(f"{str(path)!r} holds splits {splits}; set `split` to one of them")
        loaded = loaded[split]
    elif split is not None:
        raise ValueError(f"{str(path)!r} holds one dataset without splits; remove `split`")
    return set(loaded.column_names), lambda columns: ([list(loaded[c]) for c in columns], {}), None
