"""Advantage stage: group-relative advantages for GRPO (DESIGN.md §2 "GRPO loss", §4).

Each sample of a group gets one scalar advantage (the loss broadcasts it over the sample's
response tokens):

    A_i = (r_i - b_i) / (std(r) + eps)     with normalize_std
    A_i =  r_i - b_i                       without

where the baseline ``b_i`` is the group mean (``estimator="grpo"``) or the mean of the *other*
samples of the group (``estimator="rloo"``, leave-one-out; equal to n/(n-1) times the GRPO
advantage, so it is unbiased for any group size), and ``std`` is the unbiased (ddof=1) standard
deviation of the group's rewards.

Filtered samples (``sample_mask = 0``: overlong, logprob error, ...) do not count in training
(DESIGN §1), so they do not count in the group's baseline or std either: a truncated response
that scores 0 must not drag its siblings' baseline down while itself being masked out of the
loss. Filtered samples get advantage 0.0, so a loss that forgot the mask still learns nothing from
them. A group whose counted rewards are all equal (or that has fewer than two counted samples)
carries no learning signal and gets exactly 0.0 for every sample; the share of such groups is a
metric because a run whose outputs became deterministic stalls there.

Reward metrics (``reward/mean``, ``reward/std``) are over *all* samples, filtered ones included:
they report what the policy produced, which is what a user watches for progress. Advantage
metrics are over counted samples only (what the loss sees).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from splitrl.types import Group


def _group_mean(reward: float, total: float, n: int) -> float:
    return total / n


def _leave_one_out(reward: float, total: float, n: int) -> float:
    return (total - reward) / (n - 1)


# estimator -> the baseline b_i of a counted sample, from its reward and the sum and count of the
# group's counted rewards (n >= 2). Another estimator of this form is a function and a line here.
BASELINES: dict[str, Callable[[float, float, int], float]] = {"grpo": _group_mean, "rloo": _leave_one_out}


class AdvantageConfig(BaseModel):
    """Configuration of :func:`compute_group_advantages`.

    Attributes:
        estimator: ``"grpo"`` (baseline = group mean) or ``"rloo"`` (baseline = mean of the other
            samples of the group).
        normalize_std: divide by the group's reward std (original GRPO). Off gives the
            Dr. GRPO-style advantage: with std division and a high learning rate (2e-3) a
            policy of the CPU demo's size collapsed to one constant output.
        eps: added to the std before dividing (reward units), so near-constant groups do not blow
            up.
    """

    model_config = ConfigDict(extra="forbid")

    estimator: Literal[tuple(BASELINES)] = "grpo"
    normalize_std: bool = True
    eps: float = Field(default=1e-6, ge=0.0)

    def min_group_size(self) -> int:
        """The smallest group the estimator gets a signal from. Both baselines come from the
        group: with one sample, ``grpo`` gives A = r − r = 0 and ``rloo`` has no other sample."""
        return 2


def compute_group_advantages(groups: Sequence[Group], config: AdvantageConfig) -> dict[str, float]:
    """Fill ``group.advantages`` (one float per sample, sample order) for every group.

    Args:
        groups: complete groups; each sample's ``reward`` must be finite and its ``sample_mask``
            0.0 or 1.0.
        config: estimator and normalization.

    Returns:
        Metrics of these groups, see :func:`advantage_metrics`.

    Raises:
        ValueError: no groups, an empty group, a non-finite reward or a ``sample_mask`` other
            than 0/1. Raised before any group is changed.
    """
    _check_groups(groups)
    advantages = [_group_advantages(g, config) for g in groups]
    for group, adv in zip(groups, advantages):
        group.advantages = adv
    return advantage_metrics(groups)


def advantage_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Reward and advantage metrics of groups whose advantages are filled.

    Call it on a whole step's groups for exact per-step numbers (the advantage stage runs per
    chunk). Keys (no ``train/`` prefix; the logger adds it):

    - ``reward/mean``, ``reward/std``: over all samples (population std), reward units.
    - ``reward/zero_variance_group_fraction``: share of groups with no learning signal (fewer
      than two counted samples, or all counted rewards equal), in [0, 1].
    - ``advantage/mean``, ``advantage/abs_mean``, ``advantage/min``, ``advantage/max``: over
      counted samples (0.0 when there are none).
    - ``samples/filtered_fraction``: share of samples with ``sample_mask = 0``.
    - ``samples/count``, ``groups/count``.

    Raises:
        ValueError: no groups, or a group whose advantages are missing or of the wrong length.
    """
    if not groups:
        raise ValueError("advantage_metrics needs at least one group")
    for g in groups:
        if g.advantages is None or len(g.advantages) != len(g.samples):
            raise ValueError(
                f"group {g.group_id!r} has no advantages for its {len(g.samples)} samples; "
                "run compute_group_advantages first"
            )
    rewards = [s.reward for g in groups for s in g.samples]
    counted_adv = [
        a for g in groups for s, a in zip(g.samples, g.advantages) if s.sample_mask == 1.0
    ]
    no_signal = sum(1 for g in groups if not _has_signal(_counted_rewards(g)))
    return {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/zero_variance_group_fraction": no_signal / len(groups),
        "advantage/mean": statistics.fmean(counted_adv) if counted_adv else 0.0,
        "advantage/abs_mean": statistics.fmean(map(abs, counted_adv)) if counted_adv else 0.0,
        "advantage/min": min(counted_adv, default=0.0),
        "advantage/max": max(counted_adv, default=0.0),
        "samples/filtered_fraction": 1.0 - len(counted_adv) / len(rewards),
        "samples/count": float(len(rewards)),
        "groups/count": float(len(groups)),
    }


def _check_groups(groups: Sequence[Group]) -> None:
    if not groups:
        raise ValueError("compute_group_advantages needs at least one group")
    for g in groups:
        if not g.samples:
            raise ValueError(f"group {g.group_id!r} has no samples")
        for s in g.samples:
            if not math.isfinite(s.reward):
                raise ValueError(
                    f"sample {s.sample_id!r} of group {g.group_id!r} has reward {s.reward}; "
                    "rewards must be finite (score failed checks as 0)"
                )
            if s.sample_mask not in (0.0, 1.0):
                raise ValueError(
                    f"sample {s.sample_id!r} of group {g.group_id!r} has sample_mask "
                    f"{s.sample_mask}; it must be 1.0 (counts) or 0.0 (filtered out)"
                )


def _counted_rewards(group: Group) -> list[float]:
    return [s.reward for s in group.samples if s.sample_mask == 1.0]


def _has_signal(counted: list[float]) -> bool:
    return len(counted) >= 2 and max(counted) != min(counted)


def _group_advantages(group: Group, config: AdvantageConfig) -> list[float]:
    counted = _counted_rewards(group)
    if not _has_signal(counted):
        # Exact zeros rather than rounding noise of (r - mean) for a constant group.
        return [0.0] * len(group.samples)
    n = len(counted)
    total = math.fsum(counted)
    scale = statistics.stdev(counted) + config.eps if config.normalize_std else 1.0
    baseline = BASELINES[config.estimator]

    advantages = []
    for s in group.samples:
        if s.sample_mask != 1.0:
            advantages.append(0.0)
            continue
        advantages.append((s.reward - baseline(s.reward, total, n)) / scale)
    return advantages
