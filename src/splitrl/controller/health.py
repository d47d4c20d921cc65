"""Console warnings for a run that trains on nothing, or on noise, while every step "succeeds".

Each condition is read from a step's logged metrics (so the metric that shows it is always in
``metrics.jsonl`` too) and warned about when it starts and again at 10, 100, ... steps in a row,
so that a persistent problem stays visible without flooding the console:

- answer checks timing out or crashing (``rollout/reward_timeout_rate``,
  ``rollout/reward_error_rate``): those samples score 0 whatever they answered;
- groups without reward variance (``rollout/reward/zero_variance_group_fraction``): their
  advantages are 0, so a policy collapsed to one answer per prompt stops learning;
- a step with nothing to learn from (``train/empty_step``: every sample filtered) or whose
  gradient was not finite (``train/nonfinite_grad``): no update was made;
- a jump of the trainer-vs-rollout logprob gap (``train/logprob_mismatch``, nats a token) to over
  ``JUMP_FACTOR`` times its median of the last ``JUMP_WINDOW`` steps and over ``JUMP_FLOOR``:
  the policy moved far in one update (or the rollouts' weights are not the trainer's). In the CPU
  demo such a jump (0.03 -> 0.58) came one step before the reward fell from 0.36 to 0.05 for good.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

# share of a step's answer checks that time out or crash before the rewards are called noise
REWARD_FAILURE_SHARE = 0.5
# share of a step's groups without reward variance before the run is called collapsed
NO_SIGNAL_SHARE = 0.9
# train/logprob_mismatch above JUMP_FACTOR x its median over the last JUMP_WINDOW steps (and above
# JUMP_FLOOR nats a token; at least JUMP_MIN_HISTORY steps seen) is a jump of the policy
JUMP_FACTOR, JUMP_FLOOR, JUMP_WINDOW, JUMP_MIN_HISTORY = 8.0, 0.2, 50, 10


def _get(metrics: Mapping[str, float], key: str) -> float:
    v = metrics.get(key, 0.0)
    return v if math.isfinite(v) else 0.0


class RunHealth:
    """Checks each step's metrics; :meth:`check` logs and returns the warnings of one step.

    Args:
        reward_timeout_s: the answer-check time limit (named in the warning).
        loss_scaling: fp16 with dynamic loss scaling, where a skipped step now and then is how the
            scale is found: a non-finite gradient is then warned about from 3 steps in a row.
    """

    def __init__(self, reward_timeout_s: float, loss_scaling: bool = False) -> None:
        self.reward_timeout_s = reward_timeout_s
        self._first = {"nonfinite_grad": 3 if loss_scaling else 1}
        self._streaks: dict[str, int] = {}
        self._mismatch: deque[float] = deque(maxlen=JUMP_WINDOW)
        self._checks: dict[str, Callable[[int, Mapping[str, float]], str | None]] = {
            "reward_checks": self._reward_checks,
            "no_signal": self._no_signal,
            "empty_step": self._empty_step,
            "nonfinite_grad": self._nonfinite_grad,
            "policy_jump": self._policy_jump,
        }

    def check(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """The warnings due at ``step`` (each logged at WARNING level)."""
        out = []
        for name, check in self._checks.items():
            text = check(step, metrics)
            if text is None:
                self._streaks[name] = 0
                continue
            n = self._streaks.get(name, 0) + 1
            self._streaks[name] = n
            first = self._first.get(name, 1)
            if n == first or (n > first and math.log10(n).is_integer()):
                msg = text + (f" ({n} steps in a row)" if n > 1 else "")
                log.warning(msg)
                out.append(msg)
        return out

    def _reward_checks(self, step: int, m: Mapping[str, float]) -> str | None:
        timeouts, errors = _get(m, "rollout/reward_timeout_rate"), _get(m, "rollout/reward_error_rate")
        if timeouts + errors < REWARD_FAILURE_SHARE:
            return None
        return (
            f"step {step}: {100 * timeouts:.0f}% of the answer checks timed out (limit reward.timeout_s="
            f"{self.reward_timeout_s:g}) and {100 * errors:.0f}% crashed; they score 0 whatever the answer, so "
            "the rewards are mostly noise. Raise reward.timeout_s or fix the task's checker"
        )

    def _no_signal(self, step: int, m: Mapping[str, float]) -> str | None:
        share = _get(m, "rollout/reward/zero_variance_group_fraction")
        if share < NO_SIGNAL_SHARE:
            return None
        return (
            f"step {step}: {100 * share:.0f}% of the groups have the same reward for every sample "
            "(rollout/reward/zero_variance_group_fraction); their advantages are 0 and the policy gradient "
            "learns nothing from them. The policy may have collapsed to one answer per prompt (raise "
            "rollout.temperature or loss.entropy_coef), or the task is far too hard or too easy for it"
        )

    def _empty_step(self, step: int, m: Mapping[str, float]) -> str | None:
        if _get(m, "train/empty_step") == 0:
            return None
        return (
            f"step {step} had nothing to learn from (every sample filtered, sample_mask = 0; e.g. "
            "reward.mask_truncated with every response cut at rollout.max_new_tokens): no update was made"
        )

    def _nonfinite_grad(self, step: int, m: Mapping[str, float]) -> str | None:
        if _get(m, "train/nonfinite_grad") == 0:
            return None
        return f"step {step}: the gradient was not finite (inf/NaN); the update was skipped"

    def _policy_jump(self, step: int, m: Mapping[str, float]) -> str | None:
        gap = m.get("train/logprob_mismatch", math.nan)
        if not math.isfinite(gap):
            return None
        history = list(self._mismatch)
        self._mismatch.append(gap)
        if len(history) < JUMP_MIN_HISTORY:
            return None
        median = statistics.median(history)
        if gap <= JUMP_FLOOR or gap <= JUMP_FACTOR * median:
            return None
        return (
            f"step {step}: the trainer's logprobs differ from the rollouts' by {gap:.3f} nats a token "
            f"(train/logprob_mismatch; median {median:.3f} over the last {len(history)} steps): the policy "
            "moved far in one update, which often comes just before the reward collapses. If "
            "train/reward falls from here, resume from an earlier checkpoint with a lower train.optim.lr"
        )
