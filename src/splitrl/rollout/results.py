"""What a ``generate`` call returns: one :class:`GenerationResult` per sample and the call's
:class:`RolloutStats` (DESIGN §5: acceptance rates are percentages)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RolloutStats:
    """Statistics of one ``generate`` call.

    Acceptance rates are percentages (0-100, DESIGN §5). ``acceptance_rate`` = 100 · accepted /
    drafted over all drafts; ``acceptance_rate_per_depth[k-1]`` = 100 · accepted_k / reached_k, where
    draft k is *reached* when drafts 1..k-1 of its iteration were accepted (the rollout counterpart
    of the teacher-forced ``mtp_{k}_acceptance_rate``). Rates are NaN when nothing was drafted.

    Attributes:
        num_samples, prompt_tokens, generated_tokens: counts of the call.
        wall_time_s: seconds of the whole call; tokens_per_s = generated_tokens / wall_time_s.
        policy_version: weights version that generated the call.
        num_forwards: backbone decode steps (prefills excluded; a step runs a whole bucket).
        speculative_active: speculative decoding ran in this call (at least at its start).
        num_drafts: tokens each verify of this call drafted (0: a plain call); at most the engine's
            ``num_drafts``, fewer where the measured choice found fewer faster (see
            :class:`~splitrl.rollout.spec_policy.SpecPolicy`).
        speculative_next: it will run in the next call (False once switched off, see
            :class:`~splitrl.rollout.spec_policy.SpecPolicy`).
        speculative_speedup: the switch-off rule's last estimate of (speculative tokens/s) /
            (plain tokens/s), from device-timed steps of both kinds and the measured acceptance. It
            extrapolates the mean tokens a verify and leaves out prefills and a call's tail (rows
            finishing at different verifies, the call waiting for the slowest), so it reads high
            (bench/RESULTS.md compares it with measured ratios). It only decides on or off;
            between calls the engine compares whole calls' tokens/s (see
            :class:`~splitrl.rollout.spec_policy.SpecPolicy`).
        switched_off_at_iteration: verify iteration of this call at which speculation was switched
            off (None: it was not).
        drafted_tokens, accepted_tokens: totals over the call.
        reached_per_depth, accepted_per_depth: per depth k = 1..D (the engine's most drafts; 0 past
            ``num_drafts``, where the rates are NaN).
        draft_vocab_size: tokens the drafts came from (``GenerationConfig.draft_vocab_size``; 0: the
            whole vocabulary).
        draft_vocab_covered: generated tokens of the call inside that set; ``draft_vocab_coverage``
            is their percentage (NaN without a set or tokens). A token outside the set can only come
            from a verify, never from an accepted draft (acceptance counts drafts, so it may exceed
            the coverage).
        graph_captures: CUDA graphs captured during the call.
        setup_s: seconds of the call spent on work that decodes nothing: CUDA graph captures
            (with their warm-up steps) and the plain-step timings of the switch-off rule.
    """

    num_samples: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
    policy_version: int = 0
    num_forwards: int = 0
    speculative_active: bool = False
    num_drafts: int = 0
    speculative_next: bool = False
    speculative_speedup: float | None = None
    switched_off_at_iteration: int | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    reached_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    draft_vocab_size: int = 0
    draft_vocab_covered: int = 0
    graph_captures: int = 0
    setup_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return 100.0 * self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else math.nan

    @property
    def acceptance_rate_per_depth(self) -> list[float]:
        return [100.0 * a / r if r else math.nan for a, r in zip(self.accepted_per_depth, self.reached_per_depth)]

    @property
    def draft_vocab_coverage(self) -> float:
        if not (self.draft_vocab_size and self.generated_tokens):
            return math.nan
        return 100.0 * self.draft_vocab_covered / self.generated_tokens

    def as_metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        """Flat metrics for the logger (acceptance keys only when speculative decoding ran)."""
        out = {
            f"{prefix}tokens_per_s": self.tokens_per_s,
            f"{prefix}generated_tokens": float(self.generated_tokens),
            f"{prefix}wall_time_s": self.wall_time_s,
            f"{prefix}speculative_active": float(self.speculative_active),
            f"{prefix}speculative_next": float(self.speculative_next),
            f"{prefix}num_drafts": float(self.num_drafts),
        }
        if self.speculative_active:
            out[f"{prefix}acceptance_rate"] = self.acceptance_rate
            for k, rate in enumerate(self.acceptance_rate_per_depth, start=1):
                out[f"{prefix}mtp_{k}_acceptance_rate"] = rate  # named like the training-side metric
            if self.speculative_speedup is not None:
                out[f"{prefix}speculative_speedup"] = self.speculative_speedup
        if self.draft_vocab_size:
            out[f"{prefix}draft_vocab_coverage"] = self.draft_vocab_coverage
        return out


@dataclass
class GenerationResult:
    """One sample's response.

    Attributes:
        response_ids: generated tokens (a stop token, when generated, is the last one).
        logprobs: fp32 logprob of each response token under softmax(logits / T) of the policy,
            unfiltered by top-k / top-p (DESIGN §5); same length as ``response_ids``.
        finish_reason: ``"stop"`` (ended with a stop token) or ``"length"`` (hit max_new_tokens).
        policy_version: weights version that generated it.
        stats: the statistics of the whole ``generate`` call (shared by its results; complete once
            the call has returned).
        drafted_tokens, accepted_tokens: this sample's speculative counts (0 without).
    """

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    policy_version: int
    stats: RolloutStats
    drafted_tokens: int = 0
    accepted_tokens: int = 0
