"""When the rollout engine decodes speculatively: the in-call switch-off rule and the measured
choice between calls (DESIGN §5 "Speculative rollouts ... switch themselves off").

Speculation never changes a sample's tokens (see :mod:`splitrl.rollout.engine`), so everything
here decides speed only. The rule reads the timings the engine takes of its verify chunks
(:class:`SpecTiming`) and the plain-step times the model runner measures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitrl.rollout import scheduler
from splitrl.rollout.config import GenerationConfig

if TYPE_CHECKING:
    from splitrl.rollout.results import RolloutStats

log = logging.getLogger(__name__)

# The speculative switch-off rule decides after this many verify iterations of a call.
SWITCH_MIN_ITERATIONS = 32
# With both kinds measured, the slower kind of call runs once every this many calls (its speed
# changes as the MTP heads learn).
EXPLORE_EVERY = 8
# The start of the warning that the in-call rule switched speculation off (benchmarks filter it:
# they report the speedups themselves).
SLOW_SPECULATION_WARNING = "speculative rollouts estimated"


def _compilations() -> int:
    """Graphs torch.compile has made in this process so far (Dynamo's own count; 0 where absent)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a torch without the counter: every call is a sample
        return 0


@dataclass
class SpecTiming:
    """What the verify iterations of a call cost, and what plain steps would have cost.

    spec_s: device seconds of the verify chunks; wall_s: their wall seconds from launch to the
    host's read of the done flags (device time plus the host work that the GPU waits for);
    plain_s: device seconds of one plain step per verify iteration, in the same buckets;
    chunks / iterations: verify chunks and iterations timed.
    """

    spec_s: float = 0.0
    wall_s: float = 0.0
    plain_s: float = 0.0
    chunks: int = 0
    iterations: int = 0

    def add_chunk(self, wall_s: float, spec_s: float, iterations: int, plain_step_s: float) -> None:
        """One verify chunk of ``iterations`` iterations; ``plain_step_s``: a plain step's device
        seconds in the chunk's bucket."""
        self.wall_s += wall_s
        self.spec_s += spec_s
        self.chunks += 1
        self.iterations += iterations
        self.plain_s += iterations * plain_step_s


class SpecPolicy:
    """Decides, per call and inside a call, whether the engine decodes speculatively.

    Speculative switch-off (DESIGN §5): the engine times each chunk of verify iterations on the
    device (CUDA events around its graph replays) and by the wall clock (launch to the host's read
    of the done flags, which synchronizes), and, for each bucket they ran in, a plain step (CUDA
    events around replays, after a synchronize; the state is restored). After
    ``SWITCH_MIN_ITERATIONS`` iterations it estimates speedup = plain wall / speculative wall for
    the same tokens, plain wall = a · Σ t_plain + (a · iterations / SYNC_EVERY) · h, with a = 1 +
    accepted drafts per iteration and h the host time per chunk (wall - device of the verify
    chunks; a device-only estimate read high at batch 256, see bench/RESULTS.md). Below 1 it decodes the rest
    of the call plainly (same tokens, see :mod:`splitrl.rollout.engine`; logged) and the estimate
    stands for that kind's speed in the measured choice below (estimate × the bucket's plain
    rate): the next calls measure the kinds not measured yet (plain, fewer drafts), then run the
    fastest. A weight sync (:meth:`weights_updated`), whose new MTP heads may draft better, drops
    those estimates, so the kinds are measured again. ``stats.num_drafts`` of such a call is the
    drafts it started with (``stats.switched_off_at_iteration`` says where it went plain).

    Measured choice. The estimate can err (it misses prefill and scheduling work), so the engine
    also measures whole calls: tokens/s of each kind of call, per row bucket of the call (a running
    mean of the last calls of each kind), over the call's decoding time (its wall time less
    ``stats.setup_s``: a call that captures CUDA graphs is still a fair sample; counting the
    capture made the rule decode plainly at batch 1 where speculation was faster, and skipping
    such calls cost an extra plain call). A kind is the drafts a verify makes, d = 0 (plain) ..
    D (``num_drafts``): fewer drafts make a verify of fewer rows, which can be faster although it
    emits fewer tokens (on an H200 at batch 32, one draft of two heads measured 1.39x plain where
    two measured 1.19x: bench/RESULTS.md). A call during which torch.compile compiled a kernel
    (seconds, once per shape) is not a sample. In a bucket the kinds not measured yet run first,
    in the order D, plain, D-1, ..., 1; from then on each call runs the fastest kind, and every
    ``EXPLORE_EVERY`` calls another kind runs once more (the one measured longest ago: speeds
    change as the MTP heads learn). Every kind emits the same tokens, so the choice changes speed
    only.

    With ``config.deterministic`` neither runs: every call drafts D tokens a verify and nothing is
    timed (the decision reads no clock, so two runs of one config give bit-identical logprobs).

    Attributes:
        switch_off: apply the switch-off rule and the measured choice (default True); when False
            every call drafts D tokens a verify and the rule's estimate is still computed and
            reported (benchmarks measure speculation this way).
        deterministic: ``config.deterministic``: speculation follows the config alone.
    """

    def __init__(self, config: GenerationConfig, num_drafts: int):
        self.speculative = config.speculative
        self.deterministic = config.deterministic
        self.num_drafts = num_drafts
        self.switch_off = True
        self._warned_slow = False
        self._call_rates: dict[tuple[int, int], float] = {}  # (drafts, row bucket) -> tokens/s
        # kinds the in-call rule switched off: (drafts, row bucket) -> its speedup estimate over plain
        self._switched_off: dict[tuple[int, int], float] = {}
        self._bucket = 0  # the current call's row bucket
        self._measured_at: dict[tuple[int, int], int] = {}  # (drafts, row bucket) -> sample number
        self._samples = 0
        self._since_explore: dict[int, int] = {}  # row bucket -> calls since another kind ran
        self._compiles_before = 0

    def kinds(self) -> list[int]:
        """The drafts a call may make, in the order they are first measured: D, 0 (plain), D-1, ..., 1."""
        if not self.speculative:
            return [0]
        return [self.num_drafts, 0, *range(self.num_drafts - 1, 0, -1)]

    def weights_updated(self) -> None:
        """New weights (new MTP heads, which may draft better): the kinds the in-call rule switched
        off are measured again, first."""
        self._switched_off.clear()

    def _measured(self, key: tuple[int, int]) -> bool:
        return key in self._call_rates or key in self._switched_off

    def _rate(self, key: tuple[int, int]) -> float:
        """tokens/s of a kind in a bucket: measured, or (switched off inside a call) the in-call
        estimate times the bucket's plain rate."""
        if key in self._switched_off:
            return self._switched_off[key] * self._call_rates.get((0, key[1]), 0.0)
        return self._call_rates[key]

    def measured_all(self, bucket: int) -> bool:
        """Every kind has a speed (measured, or estimated by the in-call rule) in ``bucket``: the
        calls there run the fastest from now on (with the explorations of "Measured choice")."""
        return all(self._measured((k, bucket)) for k in self.kinds())

    def choose(self, bucket: int, peek: bool = False) -> int:
        """The drafts a verify makes in a call of row bucket ``bucket`` (0: plain decoding; see
        "Measured choice"); ``peek``: without counting the call towards the next exploration."""
        if not self.speculative:
            return 0
        if self.deterministic or not self.switch_off:
            return self.num_drafts
        kinds = self.kinds()
        unmeasured = [k for k in kinds if not self._measured((k, bucket))]
        if unmeasured:
            return unmeasured[0]
        ranked = sorted(kinds, key=lambda k: -self._rate((k, bucket)))  # stable: D wins a tie
        due = self._since_explore.get(bucket, 0) >= EXPLORE_EVERY
        if not peek:
            self._since_explore[bucket] = 0 if due else self._since_explore.get(bucket, 0) + 1
        if not due:
            return ranked[0]
        return min(ranked[1:], key=lambda k: self._measured_at[(k, bucket)])  # measured longest ago

    def record_call(self, drafts: int, bucket: int, tokens_per_s: float) -> None:
        """A call's speed sample: ``drafts`` a verify (0: plain), its row bucket, tokens/s."""
        key = (drafts, bucket)
        self._switched_off.pop(key, None)  # measured now
        old = self._call_rates.get(key)
        self._call_rates[key] = tokens_per_s if old is None else 0.5 * (old + tokens_per_s)
        self._samples += 1
        self._measured_at[key] = self._samples

    def call_started(self, bucket: int = 0) -> None:
        """A call of row bucket ``bucket`` starts."""
        self._compiles_before = _compilations()
        self._bucket = bucket

    def call_finished(self, stats: RolloutStats, bucket: int) -> None:
        """Take the finished call's speed as a sample of its kind (unless speculation was switched
        off inside it, or torch.compile compiled during it) and set ``stats.speculative_next``.
        ``stats.wall_time_s`` and ``stats.setup_s`` are final."""
        decoding_s = stats.wall_time_s - stats.setup_s
        # a call during which torch.compile compiled something (a kernel's first shape: seconds)
        # is no speed sample; the measured setup (captures, plain-step timings) is left out of it
        compiled = _compilations() != self._compiles_before
        if stats.switched_off_at_iteration is None and stats.generated_tokens and decoding_s > 0 and not compiled:
            self.record_call(stats.num_drafts, bucket, stats.generated_tokens / decoding_s)
        stats.speculative_next = self.choose(bucket, peek=True) > 0

    def should_switch_off(self, timing: SpecTiming, stats: RolloutStats, live_drafted, live_accepted) -> bool:
        """After ``SWITCH_MIN_ITERATIONS`` verify iterations, estimate speedup = (tokens per verify)
        · (plain step time) / (verify iteration time) over the iterations so far, each bucket's
        plain time measured on the device, at most the tokens per verify; switch off below 1. ``live_drafted`` /
        ``live_accepted``: the counts of the rows still decoding (by slot)."""
        if self.deterministic or timing.iterations < SWITCH_MIN_ITERATIONS:
            return False
        drafted = stats.drafted_tokens + sum(live_drafted)
        if not drafted or timing.wall_s <= 0 or not timing.chunks:
            return False
        d = stats.num_drafts  # the call's drafts a verify
        per_iter = 1.0 + d * (stats.accepted_tokens + sum(live_accepted)) / drafted
        # plain decoding of the same tokens: per_iter plain steps per verify iteration, plus the
        # host's per-chunk work (the done-flag read, bookkeeping: measured on the verify chunks,
        # wall - device) once per SYNC_EVERY plain steps
        host_per_chunk = max(0.0, timing.wall_s - timing.spec_s) / timing.chunks
        plain_wall = per_iter * timing.plain_s + per_iter * timing.iterations / scheduler.SYNC_EVERY * host_per_chunk
        # a verify costs at least a plain step, so it can gain at most its tokens: a larger estimate
        # comes from a plain step timed while the machine was busy (seen at 19x on a shared CPU)
        stats.speculative_speedup = min(plain_wall / timing.wall_s, per_iter)
        if stats.speculative_speedup >= 1.0 or not self.switch_off:
            return False
        self.record_switch_off(stats, per_iter)
        return True

    def record_switch_off(self, stats: RolloutStats, per_iter: float) -> None:
        """The in-call rule switched the current call's kind off at ``stats.speculative_speedup``
        (< 1) with ``per_iter`` tokens a verify: that estimate stands for the kind's speed in the
        call's bucket until it is measured or the weights change (class docstring); logged."""
        d = stats.num_drafts
        # this kind's speed in the bucket, for the measured choice: the estimate (the call is no
        # sample); the next calls try the kinds not measured yet, then run the fastest
        key = (d, self._bucket)
        self._switched_off[key] = stats.speculative_speedup
        self._samples += 1
        self._measured_at[key] = self._samples
        level = logging.INFO if self._warned_slow else logging.WARNING  # afterwards: rollout/speculative_next
        self._warned_slow = True
        log.log(
            level,
            SLOW_SPECULATION_WARNING + " at %.2fx plain speed (%d drafts a verify, %.2f tokens per verify, "
            "acceptance %.1f%%): decoding the rest of the call plainly; the next calls measure the other "
            "draft counts and plain decoding, then run the fastest",
            stats.speculative_speedup,
            d,
            per_iter,
            100.0 * (per_iter - 1.0) / d,
        )
