"""A step's metrics, from what the controller recorded while the step ran (DESIGN §5): the
train workers' reduced metrics, the rollouts' rewards, lengths and acceptance, the buffer's
staleness and evictions, and where the step's time went (``timing/``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitrl.controller.buffer import ReplayBuffer, staleness_metrics
from splitrl.loss.advantages import advantage_metrics
from splitrl.types import Group


@dataclass
class StepRecorder:
    """What the pumps record between two steps' metrics: the generation calls' metrics and
    (start, end) times, the train calls' times of the last step, the train pump's exposed wait
    for rollouts (``time.perf_counter()`` seconds)."""

    calls: list[dict] = field(default_factory=list)
    gen_intervals: list[tuple[float, float]] = field(default_factory=list)
    train_intervals: list[tuple[float, float]] = field(default_factory=list)
    wait_s: float = 0.0

    def generation_call(self, start: float, end: float, metrics: dict) -> None:
        self.gen_intervals.append((start, end))
        self.calls.append(metrics)

    def take_metrics(self, train: dict[str, float], groups: list[Group], **kwargs) -> dict[str, float]:
        """The step's record (:func:`step_metrics`; ``kwargs`` are its other keyword arguments);
        the generation calls and the wait recorded since the last step start afresh."""
        calls, self.calls = self.calls, []
        gen_intervals, self.gen_intervals = self.gen_intervals, []
        wait_s, self.wait_s = self.wait_s, 0.0
        return step_metrics(
            train, groups, calls=calls, gen_intervals=gen_intervals, train_intervals=self.train_intervals,
            wait_s=wait_s, **kwargs,
        )  # fmt: skip


def step_metrics(
    train: dict[str, float],
    groups: list[Group],
    *,
    calls: list[dict],
    speculative: bool,
    draft_vocab: bool = False,
    buffer: ReplayBuffer,
    version: int,
    gen_intervals: list[tuple[float, float]],
    train_intervals: list[tuple[float, float]],
    wait_s: float,
    checkpoint_s: float,
    step_s: float,
    sync_s: float,
) -> dict[str, float]:
    """The record of one step (DESIGN §5 "metrics a user needs to trust a run").

    Args:
        train: the train workers' reduced metrics (``train/`` is prefixed, ``timing/`` kept).
        groups: the step's groups (rewards, lengths, staleness).
        calls: the metrics of the generation calls that finished since the last step.
        speculative: whether the rollout speculates (then its acceptance is reported).
        draft_vocab: whether its drafts come from a reduced vocabulary (then the share of generated
            tokens inside it, ``rollout/draft_vocab_coverage`` in %, is reported).
        buffer: the replay buffer after the step (size, evictions).
        version: the trainer's policy version after the step.
        gen_intervals / train_intervals: (start, end) of generation calls since the last step and
            of the step's train calls, ``time.perf_counter()`` seconds.
        wait_s: the train pump's exposed wait for rollouts; ``checkpoint_s``: training blocked
            by checkpoints; ``step_s`` / ``sync_s``: the step's and its weight sync's seconds.
    """
    out = {f"train/{k}" if not k.startswith("timing/") else k: v for k, v in train.items()}
    samples = [s for g in groups for s in g.samples]
    lengths = [s.response_len for s in samples]
    rollout = advantage_metrics(groups)
    # the mean reward under one name (DESIGN §3 lists it as train/reward)
    out["train/reward"] = rollout.pop("reward/mean")
    out.update({f"rollout/{k}": v for k, v in rollout.items()})
    out["rollout/response_length_mean"] = sum(lengths) / max(1, len(lengths))
    out["rollout/prompt_length_mean"] = sum(s.prompt_len for s in samples) / max(1, len(samples))
    out["rollout/response_length_max"] = float(max(lengths, default=0))
    out["rollout/truncation_rate"] = sum(s.truncated for s in samples) / max(1, len(samples))
    out["rollout/reward_timeout_rate"] = sum(s.reward_timed_out for s in samples) / max(1, len(samples))
    crashed = sum(s.info.get("reward_error") is not None and not s.reward_timed_out for s in samples)
    out["rollout/reward_error_rate"] = crashed / max(1, len(samples))
    gen_tokens = sum(m["generated_tokens"] for m in calls)
    gen_s = sum(m["generation_s"] for m in calls)
    # every step's record has the same keys: NaN where a step has no value (no generation
    # call finished since the last step; speculation switched itself off)
    out["rollout/tokens_per_s"] = gen_tokens / gen_s if gen_s > 0 else float("nan")
    if speculative:
        drafted = sum(m["drafted_tokens"] for m in calls)
        accepted = sum(m["accepted_tokens"] for m in calls)
        out["rollout/acceptance_rate"] = 100.0 * accepted / drafted if drafted else float("nan")
        out["rollout/speculative_active"] = float(calls[-1]["speculative_active"]) if calls else float("nan")
        # drafts a verify of the last call (the measured choice may draft fewer than the heads allow)
        out["rollout/num_drafts"] = float(calls[-1].get("num_drafts", 0.0)) if calls else float("nan")
        if draft_vocab:
            covered = sum(m.get("draft_vocab_covered", 0.0) for m in calls)
            generated = sum(m.get("draft_vocab_generated", 0.0) for m in calls)
            out["rollout/draft_vocab_coverage"] = 100.0 * covered / generated if generated else float("nan")
    out.update(staleness_metrics(groups, version - 1))  # keys carry their buffer/ prefix
    out["buffer/size"] = float(buffer.size)
    out["buffer/evicted_groups_total"] = float(buffer.num_evicted_groups)
    out["buffer/evicted_samples_total"] = float(buffer.num_evicted_samples)
    out["timing/step_s"] = step_s
    out["timing/generation_s"] = sum(e - s for s, e in gen_intervals)
    out["timing/train_s"] = sum(e - s for s, e in train_intervals)
    out["timing/weight_sync_s"] = sync_s
    # written after the previous step's metrics were logged: reported with this step's
    out["timing/checkpoint_s"] = checkpoint_s
    out["timing/exposed_wait_s"] = wait_s
    out["timing/generation_during_train_s"] = overlap(gen_intervals, train_intervals)
    out["timing/policy_version"] = float(version)
    return out


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The seconds during which an interval of ``a`` and one of ``b`` both ran."""
    total = 0.0
    for s1, e1 in a:
        for s2, e2 in b:
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total
