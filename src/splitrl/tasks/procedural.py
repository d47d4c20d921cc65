"""Procedural tasks of our own, generated from (seed, index) alone."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from splitrl.tasks.base import Task, TaskOptions, TaskPrompt
from splitrl.tasks.matching import position_match_fraction


class ReverseDigitsTaskConfig(TaskOptions):
    """Reverse a string of random digits: prompt ``"604>"``, answer ``"406"``.

    Attributes:
        num_digits: digits per prompt (leading zeros allowed, so answers have a fixed length).
        seed: prompt ``i`` is drawn from an RNG seeded with ``(seed, i)``; seeds give disjoint
            streams.
        scoring: ``"partial"``: digits equal at the same position ÷ max(len(response),
            len(answer)) (a tiny model learns from this from scratch in under a minute on 2 CPU
            cores); ``"strict"``: 1.0 for an exact match, else 0.0. The response is
            stripped of surrounding whitespace first.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["reverse_digits"] = "reverse_digits"
    num_digits: int = Field(3, ge=1)
    seed: int = Field(0, ge=0)
    scoring: Literal["partial", "strict"] = "partial"


class ReverseDigitsTask(Task):
    """Unbounded stream of reverse-the-digits prompts (``num_prompts`` is None)."""

    def __init__(self, config: ReverseDigitsTaskConfig):
        self.config = config

    @property
    def num_prompts(self) -> None:
        return None

    def _make_prompt(self, index: int) -> TaskPrompt:
        import numpy as np  # here, not at the top: validating a run config should not load it

        rng = np.random.default_rng([self.config.seed, index])
        digits = "".join(str(d) for d in rng.integers(0, 10, size=self.config.num_digits))
        return TaskPrompt(index=index, text=f"{digits}>", answer=digits[::-1])

    def score(self, prompt: TaskPrompt, response_text: str) -> float:
        response = response_text.strip()
        if self.config.scoring == "strict":
            return float(response == prompt.answer)
        return position_match_fraction(response, prompt.answer)
