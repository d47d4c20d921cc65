"""Rollouts at GPU speed: static KV cache, CUDA graphs, continuous batching, MTP self-speculation.

Legend: S = slots (rows held at once, ``batch_size``), B = slots of one decode step (a bucket),
L = cache prefix a step reads (a bucket), W = response buffer width, V = vocabulary, D = drafts.

Slots. Each slot holds one sample: its keys and values at index = position in a preallocated
:class:`~splitrl.rollout.kv.StaticKVCache`, its last emitted token, position, response counter,
seed, done flag and response buffer, all on the device. A decode step runs slots 0..B-1 with
static shapes: the forward (:mod:`splitrl.rollout.forward`), sampling, logprobs, stop and length
checks and the state update, with no host synchronization; on CUDA it is captured once per
(B, L) bucket as a CUDA graph and replayed. The host synchronizes every few steps
(``SYNC_EVERY``) to collect finished slots, refill them with waiting prompts (a batched ragged
prefill; on CUDA a graph per (rows, prompt length) bucket, see ``_prefill``) and move rows to lower
slots when a smaller bucket suffices. Finished rows in a bucket keep computing until that sync,
writing only their own slot; their results are fixed.

Sampling (DESIGN §5). The token at response index c is argmax(filtered logits / T + G(seed, c)),
G a Gumbel-max noise keyed by (seed, c) (:func:`~splitrl.rollout.sampling.race_sample`): a
sample's tokens depend only on its prompt, its seed and the logits. Logprobs are of the
unfiltered softmax(logits / T).

Speculative decoding. The MTP depths draft D tokens with the same noise (:mod:`splitrl.rollout.
drafter`); the backbone scores [x_n, drafts] in one forward, recomputes the target token at every
drafted index with that index's noise and accepts the leading drafts that equal it; the first
mismatch (or the bonus position) emits the target token. Speculative and plain decoding therefore
emit the same tokens by construction (up to the rounding of logits computed in differently shaped
forwards), and switching speculation off in the middle of a call changes nothing but speed. The
acceptance is P(draft race winner = target race winner) instead of the rejection rule's
Σ min(p, q) (``bench/bench_rollout.py`` measures both per depth on held-out samples; figures in
bench/RESULTS.md): determinism costs acceptance.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from splitrl.models.policy import PolicyModel
from splitrl.rollout import kv
from splitrl.rollout.config import GenerationConfig
from splitrl.rollout.drafter import MTPDrafter
from splitrl.rollout.forward import DecoderForward, check_supported
from splitrl.rollout.fused import stop_mask
from splitrl.rollout.kv import StaticKVCache
from splitrl.rollout.sampling import column_keys, seed_words

log = logging.getLogger(__name__)

# The host reads the done flags every this many decode steps (plain) or verify iterations (spec;
# half as many while prompts wait for a slot).
SYNC_EVERY = 16
# Prefill token budget of one forward (rows of a refill are cut into forwards of at most this).
PREFILL_TOKENS = 16384
# Refills of at most this many tokens (rows x padded prompt length) run as CUDA graphs, one per
# (rows, length) bucket: an eager prefill is host-bound below it (bench/RESULTS.md, rollout decoding,
# the profile of eager prefills).
GRAPH_PREFILL_TOKENS = 8192
# At most this many prefill graphs per engine (each holds its activations in the graph pool);
# refills of other shapes run eagerly.
MAX_PREFILL_GRAPHS = 48
# Free slots are refilled once they are at least this fraction of the slots (or nothing runs):
# a few larger refills cost less host time than many small ones.
REFILL_MIN_FRACTION = 1 / 8
# The speculative switch-off rule decides after this many verify iterations of a call.
SWITCH_MIN_ITERATIONS = 32
# With both kinds measured, the slower kind of call runs once every this many calls (its speed
# changes as the MTP heads learn).
EXPLORE_EVERY = 8
# The start of the warning that the in-call rule switched speculation off (benchmarks filter it:
# they report the speedups themselves).
SLOW_SPECULATION_WARNING = "speculative rollouts estimated"
# Fuse the elementwise ops of the forward with torch.compile on CUDA (fewer kernel launches).
COMPILE_KERNELS = os.environ.get("SPLITRL_COMPILE_KERNELS", "1") != "0"
# Decode-step buckets: rows (slots 0..B-1) and cache prefix lengths.
_ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def _compilations() -> int:
    """Graphs torch.compile has made in this process so far (Dynamo's own count; 0 where absent)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a torch without the counter: every call is a sample
        return 0


def _row_bucket(n: int, cap: int) -> int:
    for b in _ROW_BUCKETS:
        if b >= n:
            return min(b, cap)
    return min(cap, -(-n // 64) * 64)


def _length_bucket(n: int, cap: int, start: int = 64) -> int:
    b = start
    while b < n:
        b = b * 3 // 2 if (b & (b - 1)) == 0 else b * 4 // 3  # 64, 96, 128, 192, 256, 384, ...
    return min(b, cap)


def _validated_config(config: GenerationConfig) -> GenerationConfig:
    """A validated copy of ``config``: ``model_copy(update=...)`` and in-place list edits skip
    pydantic's checks, and the engine must not follow later changes of the caller's object."""
    if not isinstance(config, GenerationConfig):
        raise TypeError(
            f"config must be a splitrl.rollout.GenerationConfig, got {type(config).__name__}; "
            "build one, e.g. GenerationConfig(**settings)"
        )
    return GenerationConfig.model_validate(config.model_dump())


def _rollout_device(device: str | torch.device | None, model: PolicyModel) -> torch.device:
    """The device to decode on (default: the model's), checked before the model is moved."""
    if device is None:
        dev = next(model.parameters()).device
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {device!r} is not a torch device ({e}); use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        where = "the model is on" if device is None else "got device"
        raise ValueError(f"the rollout engine decodes on cpu or cuda; {where} {dev}: move the model or pass device='cpu'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {dev} asked for, but torch sees no CUDA GPU (torch.cuda.is_available() is False); use device='cpu'")
    return dev


def _non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an inf: one reduction a tensor
    (aminmax propagates NaN and shows ±inf; isfinite().all() was 9x slower on CPU bf16, 0.26 s
    per 50 M elements) and one host synchronization a device."""
    names = [k for k, t in tensors.items() if t.is_floating_point() and t.numel()]
    by_device: dict[torch.device, list[str]] = {}
    for k in names:
        by_device.setdefault(tensors[k].device, []).append(k)
    bad = []
    with torch.no_grad():
        for keys in by_device.values():
            ends = torch.stack([torch.stack(torch.aminmax(tensors[k])).float() for k in keys])
            finite = torch.isfinite(ends).all(dim=1).tolist()
            bad += [k for k, ok in zip(keys, finite) if not ok]
    return bad


def _as_int(value, what: str, expected: str) -> int:
    """``value`` as a Python int: ints, bools, numpy ints and integer 0-d tensors (``__index__``);
    a float, a string or None raise, since int() would silently truncate or parse them."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} is {value!r} ({type(value).__name__}); expected {expected}") from None


def _token_ids(prompt, i: int) -> list[int]:
    """Prompt ``i`` as a list of Python ints (see :func:`_as_int`)."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
        hint = "tokenize the text first" if isinstance(prompt, (str, bytes)) else "for one prompt pass [[id, id, ...]]"
        raise TypeError(f"prompt {i} is a {type(prompt).__name__}, not a list of token ids; {hint}")
    if all(type(t) is int for t in prompt):
        return list(prompt)
    return [_as_int(t, f"prompt {i}'s token {j}", "an int token id") for j, t in enumerate(prompt)]


def _prefill_views(flat: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """(ids [rows, width], lens, slots, seed_lo, seed_hi [rows]) of a refill's packed int64 inputs."""
    ids, rest = flat[: rows * width].view(rows, width), flat[rows * width :]
    return (ids, *rest.view(4, rows).unbind(0))


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
        speculative_next: it will run in the next call (False once switched off, see
            :class:`RolloutEngine`).
        speculative_speedup: the switch-off rule's last estimate of (speculative tokens/s) /
            (plain tokens/s), from device-timed steps of both kinds and the measured acceptance. It
            extrapolates the mean tokens a verify and leaves out prefills and a call's tail (rows
            finishing at different verifies, the call waiting for the slowest), so it reads high
            (bench/RESULTS.md compares it with measured ratios). It only decides on or off;
            between calls the engine compares whole calls' tokens/s (see :class:`RolloutEngine`).
        switched_off_at_iteration: verify iteration of this call at which speculation was switched
            off (None: it was not).
        drafted_tokens, accepted_tokens: totals over the call.
        reached_per_depth, accepted_per_depth: per depth k = 1..D.
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
    speculative_next: bool = False
    speculative_speedup: float | None = None
    switched_off_at_iteration: int | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    reached_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    graph_captures: int = 0
    setup_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return 100.0 * self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else math.nan

    @property
    def acceptance_rate_per_depth(self) -> list[float]:
        return [100.0 * a / r if r else math.nan for a, r in zip(self.accepted_per_depth, self.reached_per_depth)]

    def as_metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        """Flat metrics for the logger (acceptance keys only when speculative decoding ran)."""
        out = {
            f"{prefix}tokens_per_s": self.tokens_per_s,
            f"{prefix}generated_tokens": float(self.generated_tokens),
            f"{prefix}wall_time_s": self.wall_time_s,
            f"{prefix}speculative_active": float(self.speculative_active),
            f"{prefix}speculative_next": float(self.speculative_next),
        }
        if self.speculative_active:
            out[f"{prefix}acceptance_rate"] = self.acceptance_rate
            for k, rate in enumerate(self.acceptance_rate_per_depth, start=1):
                out[f"{prefix}mtp_{k}_acceptance_rate"] = rate  # named like the training-side metric
            if self.speculative_speedup is not None:
                out[f"{prefix}speculative_speedup"] = self.speculative_speedup
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


class _SlotState:
    """Device state of every slot (one sample each); see the module docstring."""

    SMALL = ("tokens", "pos", "counter", "seed_lo", "seed_hi", "done", "stopped", "drafted", "accepted")

    def __init__(self, slots: int, width: int, D: int, hidden: int, dtype: torch.dtype, device: torch.device):
        def z(*shape, dt=torch.int64):
            return torch.zeros(shape, dtype=dt, device=device)

        self.tokens = z(slots)  # x_n: emitted, not yet fed to the backbone
        self.pos = z(slots)  # position of x_n (= tokens fed so far)
        self.counter = z(slots)  # response tokens emitted so far
        self.seed_lo, self.seed_hi = z(slots), z(slots)
        self.done = torch.ones(slots, dtype=torch.bool, device=device)  # empty slots are done
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self.out_tokens = z(slots, width)
        self.out_logprobs = z(slots, width, dt=torch.float32)
        self.drafted, self.accepted = z(slots), z(slots)
        self.reached_depth, self.accepted_depth = z(slots, D), z(slots, D)
        self.drafts = z(slots, D)
        self.carry = torch.zeros(max(D - 1, 0), slots, hidden, dtype=dtype, device=device)
        self.width = width

    def small(self) -> list[torch.Tensor]:
        """Everything a decode step changes besides caches and response buffers."""
        extra = [self.reached_depth, self.accepted_depth, self.drafts, self.carry]
        return [getattr(self, n) for n in self.SMALL] + extra

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.small()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self.small(), saved):
            t.copy_(s)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.small()[:-1] + [self.out_tokens, self.out_logprobs]:
            t[dst] = t[src]
        self.carry[:, dst] = self.carry[:, src]


class _DeviceTimer:
    """Seconds of the device work queued inside ``with`` (CUDA events; the wall clock on CPU).

    With ``synchronize=False`` the CUDA reading (``seconds``) waits for the end event only when
    read, so it can be read after a synchronization that happens anyway."""

    def __init__(self, device: torch.device, synchronize: bool = True):
        self.cuda = device.type == "cuda"
        self.sync = synchronize
        self._seconds = 0.0

    def __enter__(self) -> _DeviceTimer:
        if self.cuda:
            if self.sync:
                torch.cuda.synchronize()
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            if self.sync:
                self.end.synchronize()
        else:
            self._seconds = time.perf_counter() - self.t0

    @property
    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self._seconds


@dataclass
class _SpecTiming:
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


class RolloutEngine:
    """Samples responses from a :class:`PolicyModel` (DESIGN §4 "Rollouts").

    Args:
        model: the policy; it is moved to ``device`` and put in eval mode, in the dtype it has
            (cast it to bf16 beforehand for bf16 rollouts).
        config: the sampling rules.
        device: where to run (default: where the model's parameters are).

    Speculative switch-off (DESIGN §5): the engine times each chunk of verify iterations on the
    device (CUDA events around its graph replays) and by the wall clock (launch to the host's read
    of the done flags, which synchronizes), and, for each bucket they ran in, a plain step (CUDA
    events around replays, after a synchronize; the state is restored). After
    ``SWITCH_MIN_ITERATIONS`` iterations it estimates speedup = plain wall / speculative wall for
    the same tokens, plain wall = a · Σ t_plain + (a · iterations / SYNC_EVERY) · h, with a = 1 +
    accepted drafts per iteration and h the host time per chunk (wall - device of the verify
    chunks; a device-only estimate read high at batch 256, see bench/RESULTS.md). Below 1 it decodes the rest
    of the call plainly (same tokens, see the module docstring) and the next calls too
    (``stats.speculative_next`` = False, logged) until the next weight sync
    (:meth:`load_state_dict`), whose new MTP heads may draft better.

    Measured choice. The estimate can err (it misses prefill and scheduling work), so the engine
    also measures whole calls: tokens/s of speculative and of plain calls, per row bucket of the
    call (a running mean of the last calls of each kind), over the call's decoding time (its wall
    time less ``stats.setup_s``: a call that captures CUDA graphs is still a fair sample; counting
    the capture made the rule decode plainly at batch 1 where speculation was faster, and
    skipping such calls cost an extra plain call). A call during which torch.compile compiled a
    kernel (seconds, once per shape) is not a sample. Once a speculative call has run in a
    bucket, the next call there runs plainly to measure it; from then on each call runs the
    faster kind, and every ``EXPLORE_EVERY`` calls the slower kind runs once more. Plain and
    speculative calls emit the same tokens, so the choice changes speed only.

    Attributes:
        use_cuda_graphs: capture decode steps as CUDA graphs (CUDA only; default True there).
        speculative_switch_off: apply the switch-off rule and the measured choice (default True);
            when False every call is speculative and the rule's estimate is still computed and
            reported (benchmarks measure speculation this way).

    The engine keeps a validated copy of ``config``: changing the caller's object afterwards has
    no effect (build a new engine for other settings).

    Raises:
        TypeError: ``config`` is not a :class:`GenerationConfig`.
        ValueError: a field of ``config`` is invalid (e.g. set after construction by
            ``model_copy(update=...)``); a stop token outside the vocabulary; ``speculative=True``
            with a model without MTP heads or with more draft tokens than MTP depths; a device
            other than cpu / cuda, or cuda without a GPU; weights that are not finite; an
            unsupported backbone layout. Nothing is changed then (the model stays where it was).
    """

    def __init__(self, model: PolicyModel, config: GenerationConfig, device: str | torch.device | None = None):
        config = _validated_config(config)
        vocab = model.config.vocab_size
        bad = [t for t in config.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary of size {vocab}")
        self.num_drafts = 0
        if config.speculative:
            D = model.num_mtp_depths
            if D == 0:
                raise ValueError(
                    "speculative=True needs a model with MTP heads (mtp.mtp_num_layers > 0); "
                    "add MTP heads to the model or set speculative=False"
                )
            n = config.num_draft_tokens or D
            if n > D:
                raise ValueError(f"num_draft_tokens={n} exceeds the model's {D} MTP depths; use at most {D}")
            self.num_drafts = n
        self.device = _rollout_device(device, model)
        check_supported(model)  # before the model moves
        bad = _non_finite(model.state_dict())
        if bad:
            raise ValueError(
                f"the model has non-finite values (NaN / inf) in {len(bad)} tensor(s), e.g. {bad[:3]}: every "
                "token would be sampled from NaN logits; load finite weights (a diverged checkpoint?)"
            )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model = model.to(self.device).eval()
        self.fwd = DecoderForward(self.model, compiled=self.device.type == "cuda" and COMPILE_KERNELS)
        self.config = config
        self.policy_version = 0
        self.last_stats: RolloutStats | None = None
        # MoE layers route with data-dependent shapes, which a captured graph cannot replay
        self.use_cuda_graphs = self.device.type == "cuda" and not getattr(model, "is_moe", False)
        self.speculative_switch_off = True
        self._speculative_active = config.speculative
        self._warned_slow = False
        self._call_rates: dict[tuple[bool, int], float] = {}  # (speculative, row bucket) -> tokens/s
        self._since_explore: dict[int, int] = {}  # row bucket -> calls since the slower kind ran
        self._stop_ids = torch.tensor(sorted(set(config.stop_token_ids)), dtype=torch.int64, device=self.device)
        self._cache: StaticKVCache | None = None
        self._mtp_cache: StaticKVCache | None = None
        self._state: _SlotState | None = None
        self._drafter: MTPDrafter | None = None
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (kind, B, L) steps, ("prefill", rows, P, spec) refills
        # refills padded to (rows, length) buckets, as their CUDA graphs need (tests turn it on for the CPU)
        self.prefill_buckets = self.use_cuda_graphs
        self._prefill_inputs: dict[tuple, torch.Tensor] = {}  # a prefill graph's packed input buffer
        self._prefill_graphs = 0
        self._sink: int | None = None  # the slot a padded refill's extra rows write to
        self._pool = self._prefill_pool = None  # CUDA graph memory pools: decode steps, prefills
        self._step_times: dict[tuple[int, int], float] = {}
        self._captures = 0
        self._setup_s = 0.0  # seconds of graph captures and plain-step timings so far
        self._columns = column_keys(vocab, self.device)  # before any graph capture

    # ------------------------------------------------------------------------------ weights
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Receive a weight sync: the full PolicyModel state dict, MTP tensors included.

        The tensors are copied into the existing parameter storage, so captured CUDA graphs
        stay valid and read the new weights.

        Raises:
            ValueError: missing or unexpected keys (a sync without the ``mtp.`` tensors leaves a
                stale draft), a shape mismatch, or non-finite values (NaN / inf: a diverged
                update). Nothing is changed then.
            TypeError: ``version`` is not an int.
        """
        version = _as_int(version, "version", "the policy version (an int)")
        own = self.model.state_dict()
        missing = sorted(own.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - own.keys())
        if missing or unexpected:
            hint = ""
            if any(k.startswith("mtp.") for k in missing):
                hint = " (the MTP tensors must be synced too: a stale draft destroys acceptance)"
            raise ValueError(
                f"weight sync keys do not match the policy: {len(missing)} missing (e.g. {missing[:3]}), "
                f"{len(unexpected)} unexpected (e.g. {unexpected[:3]}){hint}; send PolicyModel.state_dict()"
            )
        wrong = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(own[k].shape)]
        if wrong:
            raise ValueError(f"weight sync shapes differ from the policy for {wrong[:5]}; send the same architecture")
        bad = _non_finite(state_dict)
        if bad:
            raise ValueError(
                f"weight sync has non-finite values (NaN / inf) in {len(bad)} tensor(s), e.g. {bad[:3]}; "
                f"the engine keeps policy version {self.policy_version}. The update diverged: lower the "
                "learning rate or check the loss"
            )
        with torch.no_grad():
            for name, tensor in own.items():  # in place: the graphs hold these storages
                tensor.copy_(state_dict[name])
        self.weights_updated(version)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's own weight tensors by ``PolicyModel`` name (MTP included; tied tensors are
        one object under several names): a weight sync that does not go through
        :meth:`load_state_dict` copies into these in place — captured CUDA graphs read their
        storage — and then calls :meth:`weights_updated`."""
        return self.model.state_dict(keep_vars=True)

    def weights_updated(self, version: int) -> None:
        """Mark the weights copied into :meth:`weight_tensors` as policy ``version`` (requests
        started after this sample with them; speculation is on again if configured)."""
        self.policy_version = _as_int(version, "version", "the policy version (an int)")
        self._speculative_active = self.config.speculative

    # ----------------------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[GenerationResult]:
        """Sample one response per prompt.

        Args:
            prompts: token ids of each prompt (non-empty, ids in [0, V)).
            seeds: one int per prompt; the same prompt, seed and weights give the same response
                whatever else is in the request (up to the logits' rounding on the device).

        Returns:
            One :class:`GenerationResult` per prompt, in order; the call's :class:`RolloutStats`
            are on each result and in ``self.last_stats``.

        Raises:
            ValueError: lengths of ``prompts`` and ``seeds`` differ, an empty prompt, a token id
                outside the vocabulary, or prompt + max_new_tokens beyond the model's positions.
            TypeError: ``prompts`` is not a list of token-id lists (text, a flat list of ids, a
                float id), or a seed is not an int. Seeds are taken modulo 2**64.
        """
        out: list[GenerationResult | None] = [None] * len(prompts)
        for i, res in self.generate_stream(prompts, seeds):
            out[i] = res
        return out  # type: ignore[return-value]

    def generate_stream(self, prompts: list[list[int]], seeds: list[int]) -> Iterator[tuple[int, GenerationResult]]:
        """Like :meth:`generate`, but yields (prompt index, result) as soon as each sample finishes.

        Prompts enter free slots in order (continuous batching), so the samples of a group sent
        together finish close to each other. The shared ``stats`` of the results are complete once
        the iterator is exhausted. Validation errors are raised at the first ``next``.
        """
        prompts, seeds = self._check_request(prompts, seeds)
        if not prompts:
            self.last_stats = RolloutStats(policy_version=self.policy_version)
            return
        with torch.inference_mode():
            yield from self._run(prompts, seeds)

    def _check_request(self, prompts: list[list[int]], seeds: list[int]) -> tuple[list[list[int]], list[int]]:
        """The request's prompts and seeds as lists of Python ints (ids given as integer tensors
        or numpy ints are converted), or the error that says what is wrong with them."""
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            raise TypeError(f"prompts must be a list of token-id lists, one per prompt; got {type(prompts).__name__}")
        if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__len__"):
            raise TypeError(f"seeds must be a list of ints, one per prompt; got {type(seeds).__name__}")
        if len(prompts) != len(seeds):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
        seeds = [_as_int(x, f"seed {i}", "an int (taken modulo 2**64)") for i, x in enumerate(seeds)]
        prompts = [_token_ids(p, i) for i, p in enumerate(prompts)]
        vocab = self.model.config.vocab_size
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            if max_pos is not None and len(p) + self.config.max_new_tokens > max_pos:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens) + max_new_tokens={self.config.max_new_tokens} exceeds the "
                    f"model's max_position_embeddings={max_pos}; shorten the prompt or lower max_new_tokens"
                )
        return prompts, seeds

    # ----------------------------------------------------------------------------- buffers
    def _ensure_buffers(self, max_prompt: int) -> None:
        cfg, D = self.config, self.num_drafts
        need = max_prompt + cfg.max_new_tokens + 2 * D + 3  # the last index is the scratch entry
        if self._cache is not None and self._cache.max_len >= need:
            if self.fwd.sync_rope_table(self._cache.max_len):  # in place if only the values changed
                self._drop_graphs()  # a new table (dtype / device moved): captured graphs read the old one
            return
        M = -(-need // 64) * 64
        mcfg = self.model.config
        S = cfg.batch_size
        dtype = self.model.output_weight.dtype
        head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
        self._drop_graphs()
        self._step_times.clear()
        self._cache = self._mtp_cache = self._state = None  # free before allocating
        # refills padded to a row bucket write their extra rows to one more slot, never decoded
        self._sink = S if self.prefill_buckets and any(_row_bucket(n, S) > n for n in range(1, S + 1)) else None
        slots = S + (self._sink is not None)
        self._cache = StaticKVCache(
            mcfg.num_hidden_layers, slots, mcfg.num_key_value_heads, M, head_dim, dtype, self.device
        )
        if D:
            # the MTP queries' masks are not a causal block: head-major, read by the Triton kernel with
            # per-query limits on CUDA (the masked path elsewhere)
            self._mtp_cache = StaticKVCache(
                D, slots, mcfg.num_key_value_heads, M, head_dim, dtype, self.device, flash=False,
                query_kernel=kv.query_kernel_default(self.device, head_dim),
            )  # fmt: skip
            c = self.config
            self._drafter = MTPDrafter(self.fwd, D, self._mtp_cache, c.temperature, c.top_k, c.top_p)
        self._state = _SlotState(slots, cfg.max_new_tokens + D + 1, D, mcfg.hidden_size, dtype, self.device)
        # cos/sin of every cache index, gathered by position in the decode forwards
        self.fwd.sync_rope_table(M)

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._prefill_inputs.clear()
        self._prefill_graphs = 0
        # a pool whose graphs are all gone is freed: capturing into its handle again trips an
        # allocator assertion (use_count > 0), so new graphs take new pools
        self._pool = self._prefill_pool = None

    # ----------------------------------------------------------------------------- device steps
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fwd.head_logits(hidden, self.config.temperature)

    def _sample(self, logits: torch.Tensor, seed_lo, seed_hi, counter) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their logprobs, any leading shape (seeds and counters broadcast to it)."""
        cfg = self.config
        shape = logits.shape[:-1]
        flat = logits.reshape(-1, logits.shape[-1])
        lo, hi, c = (t.expand(shape).reshape(-1) for t in (seed_lo, seed_hi, counter))
        y, lp = self.fwd.k.draw_with_logprobs(flat, lo, hi, c, cfg.top_k, cfg.top_p, self._columns)
        return y.view(shape), lp.view(shape)

    def _write_outputs(self, B: int, start: torch.Tensor, tokens_BQ: torch.Tensor, logprobs_BQ: torch.Tensor) -> None:
        st = self._state
        flat = self.fwd.k.output_index(start, st.width, tokens_BQ.shape[1])
        st.out_tokens.view(-1).index_copy_(0, flat, tokens_BQ.reshape(-1))
        st.out_logprobs.view(-1).index_copy_(0, flat, logprobs_BQ.reshape(-1))

    def _plain_step(self, B: int, L: int) -> None:
        st = self._state
        tok, pos, cnt = st.tokens[:B], st.pos[:B], st.counter[:B]
        h = self.fwd.backbone_decode(tok[:, None], pos[:, None], self._cache, L)
        y, lp = self._sample(self._logits(h[:, 0]), st.seed_lo[:B], st.seed_hi[:B], cnt)
        self._write_outputs(B, cnt, y[:, None], lp[:, None])  # a done row writes past its length
        self.fwd.k.plain_commit(tok, pos, cnt, st.done[:B], st.stopped[:B], y, self._stop_ids, self.config.max_new_tokens)

    def _spec_step(self, B: int, L: int) -> None:
        st, k = self._state, self.fwd.k
        tok, pos, cnt, done, drafts = st.tokens[:B], st.pos[:B], st.counter[:B], st.done[:B], st.drafts[:B]
        ids, positions, counters = k.verify_inputs(tok, drafts, pos, cnt)  # [B, D+1] each
        h = self.fwd.backbone_decode(ids, positions, self._cache, L)
        t, lp = self._sample(self._logits(h), st.seed_lo[:B, None], st.seed_hi[:B, None], counters)
        self._write_outputs(B, cnt, t, lp)  # entries past the emitted ones are rewritten later
        a, n, stopped, fin = k.spec_accept(drafts, t, cnt, done, self._stop_ids, self.config.max_new_tokens)
        _, new_carry = self._drafter.step(
            h, t, a, pos, n, st.carry[:, :B], st.seed_lo[:B], st.seed_hi[:B], L, drafts_out=drafts
        )  # reads the state before the commit below (pos: the verify's first position); writes the new drafts
        # into st.drafts (the old ones were last read by spec_accept above)
        k.spec_commit(
            tok, pos, cnt, done, st.stopped[:B], st.drafted[:B], st.accepted[:B],
            st.reached_depth[:B], st.accepted_depth[:B], t, a, n, stopped, fin,
        )  # fmt: skip
        st.carry[:, :B] = new_carry

    def _step_fn(self, kind: str, B: int, L: int):
        step = self._plain_step if kind == "plain" else self._spec_step
        return lambda: step(B, L)

    def _run_steps(self, kind: str, B: int, L: int, n: int) -> None:
        if not self.use_cuda_graphs:
            fn = self._step_fn(kind, B, L)
            for _ in range(n):
                fn()
            return
        graph = self._graph(kind, B, L)
        for _ in range(n):
            graph.replay()

    def _graph(self, kind: str, B: int, L: int) -> torch.cuda.CUDAGraph:
        key = (kind, B, L)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        with self._setup_time():
            fn = self._step_fn(kind, B, L)
            saved = self._state.snapshot()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = self._capture(fn, fn, self._pool)  # the warm-up's writes are undone below
            self._state.restore(saved)
        self._graphs[key] = graph
        self._captures += 1
        return graph

    def _capture(self, warmup, body, pool) -> torch.cuda.CUDAGraph:
        """A CUDA graph of ``body()`` in memory pool ``pool``, after ``warmup()`` ran twice on a
        side stream (lazy initializations and compilations stay outside the capture)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            warmup()
            warmup()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: with placement=colocated the train step runs in another thread of this
        # process; under the default "global" mode its allocations invalidated the capture
        # (cudaErrorStreamCaptureInvalidated on 2 H200s, async s=1)
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            body()
        return graph

    @contextmanager
    def _setup_time(self) -> Iterator[None]:
        """Count the enclosed seconds (the engine's device work included) into ``stats.setup_s``.
        Waits for the engine's stream only: with placement=colocated the train half of the process
        queues work on the same device, which is not the engine's setup."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            stream.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if stream is not None:
                stream.synchronize()
            self._setup_s += time.perf_counter() - start

    def _plain_step_time(self, B: int, L: int, reps: int = 3) -> float:
        """Seconds of one plain step of bucket (B, L), timed on the device (CUDA events after a
        synchronize; the wall clock on CPU), on the live state, which is restored afterwards."""
        key = (B, L)
        if key in self._step_times:
            return self._step_times[key]
        if self.use_cuda_graphs:
            self._graph("plain", B, L)
        with self._setup_time():
            saved = self._state.snapshot()
            with _DeviceTimer(self.device) as timer:
                self._run_steps("plain", B, L, reps)
            self._state.restore(saved)
        self._step_times[key] = timer.seconds / reps
        return self._step_times[key]

    # ----------------------------------------------------------------------------- prefill
    def _prefill(self, slots: list[int], prompts: list[list[int]], seeds: list[int], spec: bool) -> None:
        """Prefill ``prompts`` into ``slots`` and emit their first tokens (and drafts).

        On CUDA a refill of at most ``GRAPH_PREFILL_TOKENS`` runs as a CUDA graph of its bucket
        (rows: the decode row buckets, prompt length: 16, 24, 32, 48, 64, 96, ...; at most
        ``MAX_PREFILL_GRAPHS`` of them): the extra rows repeat the first row's inputs and write to
        a slot of their own that is never decoded (so no slot receives two rows' values, which
        the device may round differently), and the prompts are right-padded (causal: a prompt
        never reads its padding; its cache entries lie past the prompt and are written by
        decoding before any read). Other refills run eagerly, unpadded."""
        D, n = self.num_drafts, len(prompts)
        P = max(len(p) for p in prompts)
        key, rows, width = None, n, P
        if self.prefill_buckets:
            b_rows, b_width = self._prefill_bucket(n, P)
            k = ("prefill", b_rows, b_width, spec)
            if k in self._graphs or (
                b_rows * b_width <= GRAPH_PREFILL_TOKENS and self._prefill_graphs < MAX_PREFILL_GRAPHS
            ):
                key, rows, width = k, b_rows, b_width
        pad = rows - n
        ids = torch.zeros(rows, width + D, dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
        ids[n:] = ids[0]
        lens = torch.tensor([len(p) for p in prompts] + [len(prompts[0])] * pad, dtype=torch.int64)
        sl = torch.tensor(list(slots) + [self._sink] * pad, dtype=torch.int64)
        lo, hi = seed_words(list(seeds) + [seeds[0]] * pad, torch.device("cpu"))
        host = torch.cat([ids.view(-1), lens, sl, lo, hi])  # one copy to the device
        graph = self._prefill_graph(key, host, spec) if key is not None and self.use_cuda_graphs else None
        if graph is None:
            self._prefill_device(*_prefill_views(host.to(self.device), rows, width + D), spec)
            return
        self._prefill_inputs[key].copy_(host)  # the graph's input buffer (the device function writes ids)
        graph.replay()

    def _prefill_graph(self, key: tuple, host: torch.Tensor, spec: bool) -> torch.cuda.CUDAGraph | None:
        """The graph of bucket ``key``, captured now if new; None if the capture fails (refills run
        eagerly from then on: the same computation, slower)."""
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        try:
            return self._capture_prefill(key, host, spec)
        except Exception as err:  # noqa: BLE001 - any failure: the eager prefill is not wrong
            log.warning("CUDA-graph capture of a prefill failed (%s); refills run eagerly from now on", err)
            self._prefill_graphs = MAX_PREFILL_GRAPHS
            if not any(k[0] == "prefill" for k in self._graphs):
                self._prefill_pool = None  # freed with the failed graph (see _drop_graphs)
            return None

    def _capture_prefill(self, key: tuple, host: torch.Tensor, spec: bool) -> torch.cuda.CUDAGraph:
        """Capture the prefill of bucket ``key`` on the packed inputs ``host`` (its warm-up runs
        prefill them)."""
        _, rows, width, _ = key
        with self._setup_time():
            buf = host.to(self.device)
            views = _prefill_views(buf, rows, width + self.num_drafts)

            def warmup() -> None:
                buf.copy_(host)  # the device function writes into ids
                self._prefill_device(*views, spec)

            if self._prefill_pool is None:  # not the steps' pool: a failed capture here cannot free theirs
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph = self._capture(warmup, lambda: self._prefill_device(*views, spec), self._prefill_pool)
        self._prefill_inputs[key] = buf
        self._graphs[key] = graph
        self._captures += 1
        self._prefill_graphs += 1
        return graph

    def _prefill_bucket(self, n: int, P: int) -> tuple[int, int]:
        """(rows, prompt length) of a refill's graph: row bucket of ``n`` (``n`` without a sink
        slot), length bucket of ``P`` (capped so that the padded prompt and the drafts stay inside
        the cache, before its scratch entry)."""
        cap = self._cache.max_len - 1 - self.num_drafts
        rows = n if self._sink is None else _row_bucket(n, self.config.batch_size)
        return rows, max(P, _length_bucket(P, cap, start=16))

    def _prefill_device(
        self, ids: torch.Tensor, lens: torch.Tensor, sl: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, spec: bool
    ) -> None:
        """The device work of a prefill (no host synchronization: CUDA-graph capturable).

        Args:
            ids: int64 [n, P + D], right-padded prompts (overwritten: the first token at each
                prompt's end, for the drafter).
            lens: int64 [n] prompt lengths; sl: int64 [n] slots; lo, hi: [n] seed words.
        """
        st, cfg, D = self._state, self.config, self.num_drafts
        n, P = ids.shape[0], ids.shape[1] - D
        rows = torch.arange(n, device=ids.device)
        h = self.fwd.backbone_prefill(ids[:, :P], sl, self._cache)
        zero = torch.zeros(n, dtype=torch.int64, device=ids.device)
        y, lp = self._sample(self._logits(h[rows, lens - 1]), lo, hi, zero)
        stop = stop_mask(y, self._stop_ids)
        st.tokens[sl], st.pos[sl], st.counter[sl] = y, lens, zero + 1
        st.seed_lo[sl], st.seed_hi[sl] = lo, hi
        st.done[sl] = stop | (cfg.max_new_tokens <= 1)
        st.stopped[sl] = stop
        st.out_tokens[sl, 0], st.out_logprobs[sl, 0] = y, lp
        for t in (st.drafted, st.accepted, st.reached_depth, st.accepted_depth):
            # not ``t[sl] = 0``: that copies a CPU scalar tensor to the device, which a CUDA graph
            # capture refuses (it made every prefill capture fail; bench/RESULTS.md)
            t.index_fill_(0, sl, 0)
        if spec:
            ids[rows, lens] = y
            drafts, carry = self._drafter.prefill(h, ids, lens, sl, lo, hi)
            st.drafts[sl] = drafts
            st.carry[:, sl] = carry

    # ----------------------------------------------------------------------------- scheduler
    def _run(self, prompts: list[list[int]], seeds: list[int]) -> Iterator[tuple[int, GenerationResult]]:
        cfg = self.config
        start_time = time.perf_counter()
        bucket = _row_bucket(min(len(prompts), cfg.batch_size), cfg.batch_size)
        spec = self._choose_speculative(bucket)
        D = self.num_drafts
        self._ensure_buffers(max(len(p) for p in prompts))
        st = self._state
        S, M = cfg.batch_size, self._cache.max_len
        max_new = cfg.max_new_tokens
        stats = RolloutStats(
            num_samples=len(prompts),
            prompt_tokens=sum(len(p) for p in prompts),
            policy_version=self.policy_version,
            speculative_active=spec,
            reached_per_depth=[0] * (D if spec else 0),
            accepted_per_depth=[0] * (D if spec else 0),
        )
        self.last_stats = stats
        captures_before, setup_before, compiles_before = self._captures, self._setup_s, _compilations()
        st.done.fill_(True)
        waiting = deque(range(len(prompts)))
        item: list[int | None] = [None] * S  # sample index held by each slot
        count = [0] * S  # host copy of each slot's counter at the last sync
        live_drafted = [0] * S
        live_accepted = [0] * S
        iterations = 0
        timing = _SpecTiming()
        while True:
            free = [s for s in range(S) if item[s] is None]
            idle = len(free) == S
            if waiting and free and (idle or len(free) >= min(len(waiting), max(1, int(S * REFILL_MIN_FRACTION)))):
                take = free[: len(waiting)]
                new = [waiting.popleft() for _ in take]
                budget = max(1, PREFILL_TOKENS // max(len(prompts[i]) for i in new))
                for c in range(0, len(take), budget):
                    chunk_s, chunk_i = take[c : c + budget], new[c : c + budget]
                    self._prefill(chunk_s, [prompts[i] for i in chunk_i], [seeds[i] for i in chunk_i], spec)
                for s, i in zip(take, new):
                    item[s], count[s] = i, 1
                    live_drafted[s] = live_accepted[s] = 0
            active = [s for s in range(S) if item[s] is not None]
            if not active:
                break
            if not waiting and _row_bucket(len(active), S) < _row_bucket(active[-1] + 1, S):
                self._compact(active, item, count, live_drafted, live_accepted)
                active = list(range(len(active)))
            B = _row_bucket(active[-1] + 1, S)
            Q = D + 1 if spec else 1
            # with prompts waiting, stop when the first row can end (its slot is refilled then); with
            # none, when the last can: finished rows idle in the bucket until then (fewer host syncs
            # at a call's tail; results are fixed when a row finishes)
            left = [max_new - count[s] for s in active]
            remaining = min(left) if waiting else max(left)
            per_iter = 1.0
            if spec and stats.drafted_tokens + sum(live_drafted):
                per_iter = 1.0 + D * (stats.accepted_tokens + sum(live_accepted)) / (
                    stats.drafted_tokens + sum(live_drafted)
                )
            # a verify makes ~2 tokens: with prompts waiting, half the iterations keep the wait for a
            # free slot as long in tokens as a plain chunk's; with none, fewer host syncs are all that
            # count (each leaves the GPU idle a while: bench/RESULTS.md, the profile at batch 32)
            limit = SYNC_EVERY // 2 if spec and waiting else SYNC_EVERY
            n_steps = max(1, min(limit, math.ceil(remaining / per_iter)))
            top = max(len(prompts[item[s]]) + min(count[s] + n_steps * Q, max_new) for s in active)
            L = _length_bucket(top + 2 * D + 1, M)
            kind = "spec" if spec else "plain"
            if self.use_cuda_graphs:
                self._graph(kind, B, L)  # a capture is setup: not inside the chunk's timings
            timer = _DeviceTimer(self.device, synchronize=False) if spec else None
            t_launch = time.perf_counter()
            if timer is not None:
                with timer:
                    self._run_steps(kind, B, L, n_steps)
            else:
                self._run_steps(kind, B, L, n_steps)
            stats.num_forwards += n_steps
            if spec:
                iterations += n_steps
            host = torch.stack([st.done[:B].long(), st.counter[:B], st.drafted[:B], st.accepted[:B]]).cpu().tolist()
            finished = []
            for s in active:
                count[s], live_drafted[s], live_accepted[s] = host[1][s], host[2][s], host[3][s]
                if host[0][s]:
                    finished.append(s)
            if timer is not None:  # read after the sync above: no extra wait
                timing.wall_s += time.perf_counter() - t_launch
                timing.spec_s += timer.seconds
                timing.chunks += 1
                timing.iterations += n_steps
                timing.plain_s += n_steps * self._plain_step_time(B, L)
            if finished:
                yield from self._collect(finished, item, count, live_drafted, live_accepted, stats)
            if spec and iterations >= SWITCH_MIN_ITERATIONS and self._should_switch_off(
                timing, stats, live_drafted, live_accepted
            ):
                spec = False
                stats.switched_off_at_iteration = iterations
        stats.wall_time_s = time.perf_counter() - start_time
        stats.tokens_per_s = stats.generated_tokens / stats.wall_time_s if stats.wall_time_s > 0 else 0.0
        stats.graph_captures = self._captures - captures_before
        stats.setup_s = self._setup_s - setup_before
        decoding_s = stats.wall_time_s - stats.setup_s
        # a call during which torch.compile compiled something (a kernel's first shape: seconds)
        # is no speed sample; the measured setup (captures, plain-step timings) is left out of it
        compiled = _compilations() != compiles_before
        if stats.switched_off_at_iteration is None and stats.generated_tokens and decoding_s > 0 and not compiled:
            self._record_call(stats.speculative_active, bucket, stats.generated_tokens / decoding_s)
        stats.speculative_next = self._choose_speculative(bucket, peek=True)

    def _choose_speculative(self, bucket: int, peek: bool = False) -> bool:
        """Speculative or plain for a call of row bucket ``bucket`` (see "Measured choice")."""
        if not self.config.speculative:
            return False
        if not self.speculative_switch_off:
            return True
        if not self._speculative_active:  # the in-call rule switched it off until the next sync
            return False
        spec_rate, plain_rate = self._call_rates.get((True, bucket)), self._call_rates.get((False, bucket))
        if spec_rate is None:
            return True
        if plain_rate is None:
            return False  # measure plain once
        faster = spec_rate >= plain_rate
        due = self._since_explore.get(bucket, 0) >= EXPLORE_EVERY
        if not peek:
            self._since_explore[bucket] = 0 if due else self._since_explore.get(bucket, 0) + 1
        return (not faster) if due else faster

    def _record_call(self, speculative: bool, bucket: int, tokens_per_s: float) -> None:
        key = (speculative, bucket)
        old = self._call_rates.get(key)
        self._call_rates[key] = tokens_per_s if old is None else 0.5 * (old + tokens_per_s)

    def _should_switch_off(self, timing: _SpecTiming, stats: RolloutStats, live_drafted, live_accepted) -> bool:
        """Estimate speedup = (tokens per verify) · (plain step time) / (verify iteration time) over
        the iterations so far, each bucket's plain time measured on the device; switch off below 1."""
        drafted = stats.drafted_tokens + sum(live_drafted)
        if not drafted or timing.wall_s <= 0 or not timing.chunks:
            return False
        per_iter = 1.0 + self.num_drafts * (stats.accepted_tokens + sum(live_accepted)) / drafted
        # plain decoding of the same tokens: per_iter plain steps per verify iteration, plus the
        # host's per-chunk work (the done-flag read, bookkeeping: measured on the verify chunks,
        # wall - device) once per SYNC_EVERY plain steps
        host_per_chunk = max(0.0, timing.wall_s - timing.spec_s) / timing.chunks
        plain_wall = per_iter * timing.plain_s + per_iter * timing.iterations / SYNC_EVERY * host_per_chunk
        stats.speculative_speedup = plain_wall / timing.wall_s
        if stats.speculative_speedup >= 1.0 or not self.speculative_switch_off:
            return False
        self._speculative_active = False
        level = logging.INFO if self._warned_slow else logging.WARNING  # afterwards: rollout/speculative_next
        self._warned_slow = True
        log.log(
            level,
            SLOW_SPECULATION_WARNING + " at %.2fx plain speed (%.2f tokens per verify, acceptance %.1f%%): "
            "decoding plainly until the next weight sync",
            stats.speculative_speedup,
            per_iter,
            100.0 * (per_iter - 1.0) / self.num_drafts,
        )
        return True

    def _compact(self, active: list[int], item, count, live_drafted, live_accepted) -> None:
        """Move the rows of ``active`` to slots 0..len-1 (a smaller bucket)."""
        n = len(active)
        src = [s for s in active if s >= n]
        dst = [s for s in range(n) if item[s] is None]
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.int64, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=self.device)
        self._cache.move(src_t, dst_t)
        if self._mtp_cache is not None:
            self._mtp_cache.move(src_t, dst_t)
        self._state.move(src_t, dst_t)
        self._state.done[src_t] = True
        for a, b in zip(src, dst):
            for lst in (item, count, live_drafted, live_accepted):
                lst[b] = lst[a]
            item[a] = None

    def _collect(self, finished: list[int], item, count, live_drafted, live_accepted, stats: RolloutStats):
        st = self._state
        idx = torch.tensor(finished, dtype=torch.int64, device=self.device)
        w = max(count[s] for s in finished)
        host = torch.cat(
            [
                st.out_tokens[idx, :w].double(),
                st.out_logprobs[idx, :w].double(),
                st.stopped[idx, None].double(),
                st.reached_depth[idx].double(),
                st.accepted_depth[idx].double(),
            ],
            dim=1,
        ).cpu()
        D = len(stats.reached_per_depth)
        for r, s in enumerate(finished):
            n = count[s]
            row = host[r]
            tokens = row[:n].long().tolist()
            stats.generated_tokens += n
            stats.drafted_tokens += live_drafted[s]
            stats.accepted_tokens += live_accepted[s]
            for k in range(D):
                stats.reached_per_depth[k] += int(row[2 * w + 1 + k])
                stats.accepted_per_depth[k] += int(row[2 * w + 1 + D + k])
            result = GenerationResult(
                response_ids=tokens,
                logprobs=row[w : w + n].tolist(),
                finish_reason="stop" if row[2 * w] > 0 else "length",
                policy_version=self.policy_version,
                stats=stats,
                drafted_tokens=live_drafted[s],
                accepted_tokens=live_accepted[s],
            )
            index = item[s]
            item[s] = None
            live_drafted[s] = live_accepted[s] = 0
            yield index, result
