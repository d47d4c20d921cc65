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
        split: split to read when the directory holds a ``DatasetDict`` with several splits.
        prompt_template: text around the problem; ``{prompt}`` is replaced by it (other braces,
            e.g. ``\\boxed{}``, are kept as they are).
        shuffle: serve rows in an order permuted by ``seed`` instead of file order.
        seed: seed of that permutation.
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

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        return str(Path(path).expanduser().absolute())

    @field_validator("prompt_template")
    @classmethod
    def _has_slot(cls, template: str) -> str:
        if _PROMPT_SLOT not in template:
            raise ValueError(
                f"prompt_template must contain {_PROMPT_SLOT!r} where the problem goes, got "
                f"{template!r}"
            )
        return template


class MathFileTask(Task):
    """Rows of a local file as prompts; rewards from math-verify's ``parse`` + ``verify``.

    Raises:
        ValueError: at construction, when the path does not exist, its type is not supported,
            a column is missing (the message lists the columns found), a directory holds several
            splits and ``split`` is not set, or the file has no rows.
    """

    def __init__(self, config: MathFileTaskConfig):
        import numpy as np  # here, not at the top: validating a run config should not load it

        prompts, answers = _load_columns(config)
        if not prompts:
            raise ValueError(f"{config.path} holds no rows")
        self.config = config
        self._prompts = prompts
        self._answers = answers
        self._order = (
            np.random.default_rng(config.seed).permutation(len(prompts))
            if config.shuffle
            else np.arange(len(prompts))
        )

    @property
    def num_prompts(self) -> int:
        return len(self._prompts)

    def _make_prompt(self, index: int) -> TaskPrompt:
        row = int(self._order[index])
        text = self.config.prompt_template.replace(_PROMPT_SLOT, self._prompts[row])
        return TaskPrompt(index=index, text=text, answer=self._answers[row], metadata={"row": row})

    def score(self, prompt: TaskPrompt, response_text: str) -> float:
        from math_verify import parse, verify

        reference = prompt.answer
        if "$" not in reference and "\\boxed" not in reference:
            # Bare LaTeX such as \frac{1}{2} is only recognized inside math delimiters.
            reference = f"${reference}$"
        gold = parse(reference, parsing_timeout=None)
        predicted = parse(response_text, parsing_timeout=None)
        if not gold or not predicted:
            return 0.0
        return float(verify(gold, predicted, timeout_seconds=None))


def _load_columns(config: MathFileTaskConfig) -> tuple[list[str], list[str]]:
    path = Path(config.path)
    columns = [config.prompt_column, config.answer_column]
    if not path.exists():
        raise ValueError(f"math_file path {str(path)!r} does not exist")
    if path.is_dir():
        found, read = _saved_dataset_reader(path, config.split)
    elif path.suffix == ".parquet":
        found, read = _parquet_reader(path)
    elif path.suffix == ".jsonl":
        found, read = _jsonl_reader(path)
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
    prompts, answers = read(columns)
    return [str(p) for p in prompts], [str(a) for a in answers]


# Each reader returns (column names found, read(columns) -> one list per column).
_Reader = tuple[set[str], Callable[[list[str]], list[list]]]


def _jsonl_reader(path: Path) -> _Reader:
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{str(path)!r} line {number} is not valid JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{str(path)!r} line {number} is not a JSON object")
            rows.append((number, row))
    if not rows:
        raise ValueError(f"{str(path)!r} holds no rows")
    found = set().union(*(row.keys() for _, row in rows))

    def read(columns: list[str]) -> list[list]:
        for column in columns:
            for number, row in rows:
                if column not in row:
                    raise ValueError(f"{str(path)!r} line {number} has no key {column!r}")
        return [[row[column] for _, row in rows] for column in columns]

    return found, read


def _parquet_reader(path: Path) -> _Reader:
    import pyarrow.parquet as pq

    def read(columns: list[str]) -> list[list]:
        table = pq.read_table(path, columns=columns)
        return [table.column(column).to_pylist() for column in columns]

    return set(pq.read_schema(path).names), read


def _saved_dataset_reader(path: Path, split: str | None) -> _Reader:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ValueError(
            f"{str(path)!r} is a directory but not one written by datasets' save_to_disk: {exc}"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            raise ValueError(f"{str(path)!r} holds splits {splits}; set `split` to one of them")
        loaded = loaded[split]
    elif split is not None:
        raise ValueError(f"{str(path)!r} holds one dataset without splits; remove `split`")
    return set(loaded.column_names), lambda columns: [list(loaded[c]) for c in columns]
