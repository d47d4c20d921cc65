"""String comparisons shared by the tasks' scorers."""

from __future__ import annotations

import re
from collections.abc import Sequence

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def position_match_fraction(response: Sequence[str], answer: Sequence[str]) -> float:
    """Partial credit: units equal at the same position ÷ the longer of the two lengths.

    Units are whatever the caller splits into (characters of a string, items of a list). Dividing
    by the longer length makes extra units cost as much as missing ones, so padding a response
    cannot raise its reward. Example: ``"406"`` vs ``"46"`` → 1 match / 3 = 1/3. Two empty
    sequences score 1.0.
    """
    longest = max(len(response), len(answer))
    if longest == 0:
        return 1.0
    matches = sum(r == a for r, a in zip(response, answer))
    return matches / longest


def extract_tagged_answer(text: str) -> str | None:
    """The stripped text inside the last ``<answer>...</answer>`` of ``text``, or None if absent."""
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None
