"""Rollouts at GPU speed: static KV cache, CUDA graphs, continuous batching, MTP self-speculation.

Legend: S = slots (rows held at once, ``batch_size``), B = slots of one decode step (a bucket),
L = cache prefix a step reads (a bucket), W = response buffer width, V = vocabulary, D = drafts.

Slots. Each slot holds one sample: its keys and values at index = position in a preallocated
:class:`~splitrl.rollout.kv.StaticKVCache`, its last emitted token, position, response counter,
seed, done flag and response buffer, all on the device. A decode step runs slots 0..B-1 with
static shapes: the forward (:mod:`splitrl.rollout.forward`), sampling, logprobs, stop and length
checks and the state update, with no host synchronization; on CUDA it is captured once per
(B, L) bucket as a CUDA graph and replayed (:mod:`splitrl.rollout.runner`). The host
synchronizes every few steps (``SYNC_EVERY``) to collect finished slots, refill them with waiting
prompts (a batched ragged prefill; on CUDA a graph per (rows, prompt length) bucket) and move rows
to lower slots when a smaller bucket suffices (:mod:`splitrl.rollout.scheduler`). Finished rows in
a bucket keep computing until that sync, writing only their own slot; their results are fixed.

Sampling (DESIGN §5). The token at response index c is argmax(filtered logits / T + G(seed, c)),
G a Gumbel-max noise keyed by (seed, c) (:func:`~splitrl.rollout.sampling.race_sample`): a
sample's tokens depend only on its prompt, its seed and the logits. Logprobs are of the
unfiltered softmax(logits / T).

Speculative decoding. The MTP depths draft D tokens with the same noise (:mod:`splitrl.rollout.
drafter`); the backbone scores [x_n, drafts] in one forward, recomputes the target token at every
drafted index with that index's noise and accepts the leading drafts that equal it; the first
mismatch (or the bonus position) emits the target token. Speculative and plain decoding therefore
emit the same tokens by construction (up to the rounding of logits computed in differently shaped
forwards), and switching speculation off in the middle of a call changes nothing but speed and
the last bits of logprobs: a verify's matrix products have other shapes than a plain step's, and
GEMM kernels round by shape (on CPU fp32 a token's logit differs by ~1e-6; exact equality would
need shape-invariant kernels in every layer). ``GenerationConfig.deterministic`` keeps the
switch from following the clock, so that the logprobs do not depend on timing. The acceptance is
P(draft race winner = target race winner) instead of the rejection rule's
Σ min(p, q) (``bench/bench_rollout.py`` measures both per depth on held-out samples; figures in
bench/RESULTS.md): determinism costs acceptance. Whether a call decodes speculatively is
decided by :class:`~splitrl.rollout.spec_policy.SpecPolicy`.

Layout: this module holds the API and the decode loop (:meth:`RolloutEngine._run`); the slots
and their bookkeeping are in :mod:`~splitrl.rollout.scheduler`, the device work (buffers, step
functions, CUDA graphs, prefill buckets) in :mod:`~splitrl.rollout.runner`, the speculation
switch in :mod:`~splitrl.rollout.spec_policy`, the results in :mod:`~splitrl.rollout.results`.
"""

from __future__ import annotations

import contextlib
import operator
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from splitrl.models.policy import PolicyModel
from splitrl.rollout import env
from splitrl.rollout.config import DETERMINISTIC_DRAFT_VOCAB, GenerationConfig
from splitrl.rollout.forward import DecoderForward, check_supported
from splitrl.rollout.results import GenerationResult, RolloutStats
from splitrl.rollout.runner import DeviceTimer, ModelRunner, row_bucket, step_kind
from splitrl.rollout.scheduler import Scheduler
from splitrl.rollout.spec_policy import SpecPolicy, SpecTiming

__all__ = ["GenerationResult", "RolloutEngine", "RolloutStats"]

# Fuse the elementwise ops of the forward with torch.compile on CUDA (fewer kernel launches).
COMPILE_KERNELS = env.flag("SPLITRL_COMPILE_KERNELS")
# Queue the next chunk of decode steps before reading the flags of the one running, when no prompt
# waits (scheduler docstring, "Chunks ahead"); SPLITRL_LOOK_AHEAD=0: read every chunk's flags first.
LOOK_AHEAD = env.flag("SPLITRL_LOOK_AHEAD")


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
        raise ValueError(
            f"the rollout engine decodes on cpu or cuda; {where} {dev}: move the model or pass device='cpu'"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {dev} asked for, but torch sees no CUDA GPU (torch.cuda.is_available() is False); use device='cpu'"
        )
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


class RolloutEngine:
    """Samples responses from a :class:`PolicyModel` (DESIGN §4 "Rollouts").

    Args:
        model: the policy; it is moved to ``device`` and put in eval mode, in the dtype it has
            (cast it to bf16 beforehand for bf16 rollouts).
        config: the sampling rules.
        device: where to run (default: where the model's parameters are).

    Speculation (DESIGN §5): with ``config.speculative`` each call decodes speculatively or plainly
    as :class:`~splitrl.rollout.spec_policy.SpecPolicy` decides (an in-call switch-off rule from
    device-timed steps, and a measured choice between calls); a weight sync
    (:meth:`load_state_dict`, :meth:`weights_updated`) switches speculation on again. Both kinds
    emit the same tokens (see the module docstring); with ``config.deterministic`` every call is
    speculative, so that the logprobs do not depend on timing either.

    Attributes:
        use_cuda_graphs: capture decode steps as CUDA graphs (CUDA only; default True there).
        prefill_buckets: pad refills to the (rows, length) buckets of their CUDA graphs (default:
            ``use_cuda_graphs``; tests turn it on for the CPU).
        look_ahead: queue the next chunk of steps before reading the flags of the one running, when
            no prompt waits (default: on CUDA, where the GPU would otherwise idle through the
            read; tests turn it on for the CPU). The tokens do not depend on it.
        speculative_switch_off: apply the switch-off rule and the measured choice (default True);
            when False every call is speculative and the rule's estimate is still computed and
            reported (benchmarks measure speculation this way).
        runner, policy: the model runner (:class:`~splitrl.rollout.runner.ModelRunner`) and the
            speculation policy (:class:`~splitrl.rollout.spec_policy.SpecPolicy`).

    The engine keeps a validated copy of ``config``: changing the caller's object afterwards has
    no effect (build a new engine for other settings).

    Raises:
        TypeError: ``config`` is not a :class:`GenerationConfig`.
        ValueError: a field of ``config`` is invalid (e.g. set after construction by
            ``model_copy(update=...)``); a stop token outside the vocabulary; ``speculative=True``
            with a model without MTP heads or with more draft tokens than MTP depths;
            ``num_draft_tokens`` or ``draft_vocab_size`` without ``speculative``; a
            ``draft_vocab_size`` over the vocabulary size; a device
            other than cpu / cuda, or cuda without a GPU; weights that are not finite; an
            unsupported backbone layout. Nothing is changed then (the model stays where it was).
    """

    def __init__(self, model: PolicyModel, config: GenerationConfig, device: str | torch.device | None = None):
        config = _validated_config(config)
        vocab = model.config.vocab_size
        bad = [t for t in config.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary of size {vocab}")
        for key in ("num_draft_tokens", "draft_vocab_size"):
            value = getattr(config, key)
            if value is not None and not config.speculative:
                raise ValueError(
                    f"{key}={value} is set but speculative=False: only speculative decoding drafts tokens; "
                    f"set speculative=True, or leave {key} unset"
                )
        if config.draft_vocab_size is not None and config.deterministic:
            raise ValueError(DETERMINISTIC_DRAFT_VOCAB.format(size="draft_vocab_size", det="deterministic"))
        if config.draft_vocab_size is not None and config.draft_vocab_size > vocab:
            raise ValueError(
                f"draft_vocab_size={config.draft_vocab_size} exceeds the model's vocabulary of {vocab} tokens; "
                f"use at most {vocab}, or leave it unset to draft from the whole vocabulary"
            )
        self.num_drafts = 0
        if config.speculative:
            D = model.num_mtp_depths
            if D == 0:
                raise ValueError(
                    "speculative=True needs a model with MTP heads (mtp.mtp_num_layers > 0); "
                    "add MTP heads to the model or set speculative=False (rollout.speculative=false in a run)"
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
        self.runner = ModelRunner(self.model, self.fwd, config, self.num_drafts, self.device)
        self.policy = SpecPolicy(config, self.num_drafts)
        self.look_ahead = LOOK_AHEAD and self.device.type == "cuda"

    @property
    def use_cuda_graphs(self) -> bool:
        return self.runner.use_cuda_graphs

    @use_cuda_graphs.setter
    def use_cuda_graphs(self, value: bool) -> None:
        self.runner.use_cuda_graphs = value

    @property
    def prefill_buckets(self) -> bool:
        return self.runner.prefill_buckets

    @prefill_buckets.setter
    def prefill_buckets(self, value: bool) -> None:
        self.runner.prefill_buckets = value

    @property
    def speculative_switch_off(self) -> bool:
        return self.policy.switch_off

    @speculative_switch_off.setter
    def speculative_switch_off(self, value: bool) -> None:
        self.policy.switch_off = value

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
        self.policy.weights_updated()

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

    # ----------------------------------------------------------------------------- the loop
    def _run(self, prompts: list[list[int]], seeds: list[int]) -> Iterator[tuple[int, GenerationResult]]:
        """Decode the (checked) request: refill free slots, run a chunk of steps, sync, collect the
        finished samples, ask the policy whether to keep speculating; until every slot is empty."""
        cfg, runner, policy = self.config, self.runner, self.policy
        start_time = time.perf_counter()
        bucket = row_bucket(min(len(prompts), cfg.batch_size), cfg.batch_size)
        drafts = policy.choose(bucket)  # drafts a verify in this call, 0: plain
        D = self.num_drafts
        runner.ensure_buffers(max(len(p) for p in prompts))
        vocab = runner.draft_vocab
        if vocab is not None:  # the drafts' tokens: the most frequent so far, this call's prompts included
            vocab.count(torch.tensor([t for p in prompts for t in p], dtype=torch.int64), prompt=True)
            vocab.refresh()
        responses: list[int] = []  # this call's tokens (with a draft vocabulary)
        stats = RolloutStats(
            num_samples=len(prompts),
            prompt_tokens=sum(len(p) for p in prompts),
            policy_version=self.policy_version,
            speculative_active=drafts > 0,
            num_drafts=drafts,
            reached_per_depth=[0] * (D if drafts else 0),
            accepted_per_depth=[0] * (D if drafts else 0),
            draft_vocab_size=vocab.size if vocab is not None else 0,
        )
        self.last_stats = stats
        captures_before, setup_before = runner.captures, runner.setup_s
        policy.call_started(bucket)
        slots = Scheduler(runner, prompts, seeds, self.policy_version)
        timing = SpecTiming()
        queued: deque[_Chunk] = deque()  # chunks launched whose flags the host has not read
        active: list[int] = []
        try:
            while True:
                if not queued:  # refills and compactions move rows: only with nothing in flight
                    slots.refill(drafts)
                    active = slots.active()
                    if not active:
                        break
                    queued.append(self._launch(slots, drafts, *slots.next_chunk(active, drafts, stats)))
                if len(queued) == 1 and active and self.look_ahead:  # the next chunk behind it (scheduler: "Chunks ahead")
                    ahead = slots.next_chunk(active, drafts, stats, ahead=(queued[0].steps, queued[0].drafts))
                    if ahead is not None:
                        queued.append(self._launch(slots, drafts, *ahead, behind=True))
                chunk = queued.popleft()
                finished = slots.read(chunk.flags, active)
                stats.num_forwards += chunk.steps
                if chunk.timer is not None:  # a timed verify chunk
                    # its wall: launch to flag read, the host work the GPU waited for included; a chunk
                    # queued behind another ran while the host worked, so its wall is its device time
                    # (setup and the caller's work between reads are no part of it)
                    device_s = chunk.timer.seconds
                    wall = device_s if chunk.behind else time.perf_counter() - chunk.launched_at
                    B, L = chunk.bucket
                    timing.add_chunk(wall, device_s, chunk.steps, runner.plain_step_time(B, L))
                if finished:
                    for i, result in slots.collect(finished, stats):
                        if vocab is not None:
                            responses.extend(result.response_ids)
                        yield i, result
                    active = [s for s in active if slots.item[s] is not None]
                if drafts and policy.should_switch_off(timing, stats, slots.live_drafted, slots.live_accepted):
                    drafts = 0  # a verify chunk already queued still runs: the same tokens
                    stats.switched_off_at_iteration = timing.iterations
        finally:  # also when the caller closes the stream early: what it was given is counted
            if vocab is not None:  # once a call, for the next call's set
                tokens = torch.tensor(responses, dtype=torch.int64)
                stats.draft_vocab_covered = vocab.covered(tokens)
                vocab.count(tokens)
        stats.wall_time_s = time.perf_counter() - start_time
        stats.tokens_per_s = stats.generated_tokens / stats.wall_time_s if stats.wall_time_s > 0 else 0.0
        stats.graph_captures = runner.captures - captures_before
        stats.setup_s = runner.setup_s - setup_before
        policy.call_finished(stats, bucket)

    def _launch(self, slots: Scheduler, drafts: int, B: int, L: int, n_steps: int, behind: bool = False) -> _Chunk:
        """Queue ``n_steps`` decode steps (``drafts`` 0) or verify iterations of ``drafts`` drafts of
        bucket (B, L), and the copy of the slots' flags behind them (read later: :meth:`Scheduler.read`);
        ``behind``: queued behind a chunk not read yet. Verify chunks are timed on the device for the
        switch-off rule (not when deterministic)."""
        runner = self.runner
        kind = step_kind(drafts, self.num_drafts)
        if runner.use_cuda_graphs:
            runner.graph(kind, B, L)  # a capture is setup: not inside the chunk's timings
        launched_at = time.perf_counter()
        # deterministic: no clock decides, nothing is timed
        timer = DeviceTimer(self.device, synchronize=False) if drafts and not self.policy.deterministic else None
        with timer or contextlib.nullcontext():
            runner.run_steps(kind, B, L, n_steps)
        return _Chunk(n_steps, drafts, (B, L), slots.snapshot(B), timer, launched_at, behind)


@dataclass
class _Chunk:
    """A chunk of decode steps queued on the device: its steps, drafts a verify (0: plain), bucket
    (B, L), the flags copy queued behind it, its device timer (timed verify chunks), launch time,
    and whether it was queued behind a chunk not read yet."""

    steps: int
    drafts: int
    bucket: tuple[int, int]
    flags: tuple
    timer: DeviceTimer | None
    launched_at: float
    behind: bool = False
