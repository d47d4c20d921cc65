"""The train worker and its split optimizer step (DESIGN.md §2, §3).

    begin_train_step(loss_fn)       zero grads, open the step
    train_microbatch(chunk) × N     forward/backward of raw sums; grads and counts accumulate
    finish_train_step() -> metrics  all-reduce counts, scale grads once, clip, step, LR step
    abort_train_step()              drop everything of the open step (idempotent)

``train(batch, loss_fn)`` is begin → train_microbatch(batch) → finish: the reference the split
path is tested against. The gradient of a step is

    g_main = (1 / D_main) · Σ_chunks ∇ raw_main          D_main = N_t (TOKEN_LEVEL) or N_s
    g_mtp  = (1 / N_t)    · Σ_chunks ∇ (λ/D) Σ_k raw_k    (MTP parameters, whatever the loss type)

applied once at finish together with the unscaling of the fp16 loss scale and of the optional
per-step loss multiplier; both are fixed at begin, so nothing a chunk does depends on counts that
are only known at finish. With attached heads the MTP loss also reaches the policy parameters,
and so does the router load-balancing loss of a MoE backbone (raw sum Σ_mb n_t·L_aux, also over
N_t; :mod:`splitrl.models.moe`): under TOKEN_LEVEL every part shares 1/N_t (one backward); under
SEQUENCE_LEVEL the N_t-normalized part is accumulated apart and combined at finish
(:mod:`splitrl.train.side_grads`, a second backward).

The worker runs the microbatches; the rest sits next to it: the open step's sums
(:mod:`~splitrl.train.step_state`), the finish arithmetic (:mod:`~splitrl.train.finish`), the
heads-only warm-up in slices (:mod:`~splitrl.train.warmup`), state dicts and checkpoints
(:mod:`~splitrl.train.worker_state`), the device and memory plan (:mod:`~splitrl.train.worker_memory`).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from splitrl.config_checks import mtp_warmup_problem
from splitrl.distributed import utils as du
from splitrl.loss.base import LossType, PolicyLoss
from splitrl.models.policy import PolicyModel
from splitrl.train.batch import MicroBatch, TrainBatch
from splitrl.train.checkpoint import ShardedCheckpointer
from splitrl.train.config import TrainConfig  # noqa: F401 - defined there, torch-free
from splitrl.train.finish import all_reduce_sums, apply_update, finish_metrics, norms_and_clip, sq_norm
from splitrl.train.memory_plan import GiB
from splitrl.train.microbatch import build_microbatches, build_ready_microbatches, empty_microbatch
from splitrl.train.mixed_precision import ComputeWeights
from splitrl.train.offload import HostOffload
from splitrl.train.optim import DynamicLossScaler, build_optimizer
from splitrl.train.side_grads import SideLossGradients, needs_side_gradients
from splitrl.train.speed import apply_speed_config
from splitrl.train.step_state import StepState
from splitrl.train.warmup import finish_warmup_in_slices, sliced_warmup
from splitrl.train.worker_memory import plan_worker_memory, worker_device
from splitrl.train.worker_state import WorkerState

log = logging.getLogger(__name__)


class TrainWorker(WorkerState):
    """One data-parallel train worker (or the only one).

    With ``torch.distributed`` initialized the model is sharded with FSDP2 over the default group
    and every count is all-reduced at finish; without a group it runs as is.

    At start-up the memory planner (:mod:`splitrl.train.memory_plan`) estimates the step's peak
    memory, resolves ``activation_checkpointing: auto`` and ``max_tokens_per_microbatch: auto``
    (``self.config`` holds the resolved budget) and logs one line (``self.memory_plan``); on
    CUDA the measured peak of the first two steps is logged next to the estimate.

    Args:
        model: the policy (fp32 parameters on the CPU, or already on the worker's device; moved
            to the device, except with ``optim.offload: cpu``, where the parameters stay on the
            CPU as the masters and only the buffers move).
        config: :class:`TrainConfig`.

    Raises:
        ValueError: ``mtp_warmup_steps`` without MTP heads that train, mixed precision with a
            model that is not fp32, or ``optim.offload: cpu`` under data parallelism.
    """

    def __init__(self, model: PolicyModel, config: TrainConfig | None = None) -> None:
        self.config = config or TrainConfig()
        cfg = self.config
        # a run config refuses this on load; this guards a worker built directly (library use)
        problem = mtp_warmup_problem(cfg.mtp_warmup_steps, model.mtp_config)
        if problem:
            raise ValueError(problem)
        self.device = worker_device(cfg.device)
        if cfg.precision != "fp32" and any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError("mixed precision keeps fp32 master weights: build the model in fp32")
        self.distributed = du.is_distributed()
        offload = cfg.optim.offload == "cpu"
        if offload and self.distributed:
            raise ValueError(
                "train.optim.offload=cpu runs on one process; with data parallelism FSDP2 shards the optimizer "
                "state over the ranks instead: set train.optim.offload=none (or cluster.num_train_workers=1)"
            )
        # what this process held on the device before the worker (e.g. a colocated rollout engine)
        self._memory_base = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.memory_plan = plan_worker_memory(model, cfg, self.device, self.distributed)
        log.info("%s", self.memory_plan.summary())
        if not self.memory_plan.fits:
            log.warning(
                "the estimated peak memory (%.1f GiB) exceeds the usable %.1f GiB: expect an out-of-memory error; "
                "lower train.microbatch.max_tokens_per_microbatch, turn on train.speed.activation_checkpointing%s",
                self.memory_plan.estimate.peak / GiB,
                (self.memory_plan.usable_bytes or 0) / GiB,
                "" if offload or self.distributed else ", or set train.optim.offload=cpu",
            )
        if cfg.microbatch.max_tokens_per_microbatch == "auto":
            budget = self.memory_plan.max_tokens_per_microbatch
            cfg = self.config = cfg.model_copy(
                update={"microbatch": cfg.microbatch.model_copy(update={"max_tokens_per_microbatch": budget})}
            )
        if offload:  # the parameters stay on the CPU as the fp32 masters
            self.model = _buffers_to(model, self.device)
        else:
            self.model = model.to(self.device)
        apply_speed_config(
            self.model, cfg.speed, self.device, self.distributed, self.memory_plan.activation_checkpointing
        )
        if self.distributed:
            from splitrl.distributed.fsdp import apply_fsdp2

            apply_fsdp2(self.model, cfg.precision, cfg.fsdp_reshard_after_forward)
        self.main_params = [(n, p) for n, p in self.model.main_named_parameters() if p.requires_grad]
        self.mtp_params = [(n, p) for n, p in self.model.mtp_named_parameters() if p.requires_grad]
        # the fused kernel on CUDA; with offload the fused CPU kernel (one pass, no temporaries)
        self.optimizer = build_optimizer(
            self.main_params, self.mtp_params, cfg.optim, fused=self.device.type == "cuda" or offload
        )
        # this run's AdamW settings per group, put back over a checkpoint's (_apply_configured_optim)
        self._configured_optim = [
            {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in self.optimizer.param_groups
        ]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, cfg.optim.lr_factor)
        # one rank: low-precision compute weights made once per step (FSDP2 casts its gathers itself)
        self.compute_weights: ComputeWeights | None = None
        self.offload: HostOffload | None = None
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]
        if offload:
            bucket = int(cfg.optim.offload_bucket_mb * 2**20)
            self.offload = HostOffload(self.model, self.device, dtype, bucket)
        elif cfg.precision != "fp32" and not self.distributed and cfg.speed.compute_weight_copy:
            self.compute_weights = ComputeWeights(self.model, dtype)
        self.scaler = (
            DynamicLossScaler(cfg.initial_loss_scale, growth_interval=cfg.loss_scale_growth_interval)
            if cfg.precision == "fp16"
            else None
        )
        self.steps_finished = 0
        self._in_warmup_slice = False
        self.updates_applied = 0
        self._step: StepState | None = None
        # sharded checkpoints (made here so that their imports happen at start-up, not in a save)
        self.checkpointer = ShardedCheckpointer(self.model, self.optimizer)

    def _report_memory(self) -> None:
        """Log the measured peak of the step just finished (steps 1 and 2, CUDA) next to the estimate."""
        if self.device.type != "cuda" or self.steps_finished not in (1, 2):
            return
        measured = torch.cuda.max_memory_allocated(self.device) - self._memory_base
        line, low = self.memory_plan.compare(measured, self.steps_finished)
        (log.warning if low else log.info)("%s", line)

    # ------------------------------------------------------------------------------ properties
    @property
    def step_open(self) -> bool:
        return self._step is not None

    @property
    def detached_heads(self) -> bool:
        return self.model.num_mtp_depths > 0 and self.model.mtp_config.mtp_detach_heads

    def _autocast(self):
        # FSDP2 casts the gathered parameters itself; a single process uses autocast instead.
        if self.config.precision == "fp32" or self.distributed:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _zero_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = None
        if self.offload is not None:
            self.offload.zero_grads()

    def _grads(self, params: list[tuple[str, torch.nn.Parameter]]) -> list[torch.Tensor | None]:
        """The step's gradients of ``params``: ``.grad``, or with offload the device accumulators."""
        if self.offload is not None:
            return self.offload.grads([p for _, p in params])
        return [p.grad for _, p in params]

    # ------------------------------------------------------------------------------ the step
    def begin_train_step(self, loss_fn: PolicyLoss, *, expected_num_tokens: int | None = None) -> None:
        """Open a step: zero the gradients and the counters.

        Args:
            loss_fn: the policy loss of this step (declares ``loss_type``).
            expected_num_tokens: optional; per-chunk losses are multiplied by
                1 / expected_num_tokens so that fp16 activation gradients stay in range; finish
                divides it out, so the result does not depend on it.

        Raises:
            RuntimeError: a step is already open.
            ValueError: a bad argument; nothing has changed.
        """
        if self._step is not None:
            raise RuntimeError(
                "begin_train_step() called while a step is open; call finish_train_step() or abort_train_step() first"
            )
        loss_type = LossType(loss_fn.loss_type)
        if expected_num_tokens is not None and expected_num_tokens <= 0:
            raise ValueError(f"expected_num_tokens must be > 0, got {expected_num_tokens}")
        if self.offload is not None and needs_side_gradients(loss_type, self.model):
            raise ValueError(
                "train.optim.offload=cpu does not run the second backward of a SEQUENCE_LEVEL loss whose policy "
                "gradient also gets N_t-normalized terms (attached MTP heads with mtp_loss_scaling_factor > 0, or a "
                "MoE router loss): use a TOKEN_LEVEL loss, mtp_detach_heads=true, or train.optim.offload=none"
            )
        self._zero_grads()
        if self.compute_weights is not None:
            self.compute_weights.refresh()  # the masters may have changed since (step, load)
        if self.offload is not None:
            self.offload.refresh()  # the masters written from outside since their last copy (a load)
        if self.device.type == "cuda" and self.steps_finished < 2:
            torch.cuda.reset_peak_memory_stats(self.device)  # for the comparison with the plan (_report_memory)
        D = self.model.num_mtp_depths
        zero = torch.zeros((), dtype=torch.float64)
        self._step = StepState(
            loss_fn=loss_fn,
            loss_multiplier=1.0 / expected_num_tokens if expected_num_tokens else 1.0,
            num_tokens=zero.clone(),
            num_samples=zero.clone(),
            mtp_sums=torch.zeros(3, D, dtype=torch.float64),
            moe_sums=torch.zeros(2, dtype=torch.float64),
            side=(
                SideLossGradients([p for _, p in self.main_params])
                if needs_side_gradients(loss_type, self.model)
                else None
            ),
            expected_num_tokens=expected_num_tokens,
            warmup_chunks=[] if sliced_warmup(self) else None,
        )

    def _validate_chunk(self, chunk: TrainBatch, loss_fn: PolicyLoss) -> None:
        if not isinstance(chunk, TrainBatch):
            raise ValueError(f"train_microbatch takes a TrainBatch, got {type(chunk).__name__}")
        chunk.validate()
        loss_fn.validate_batch(chunk)
        vocab = self.model.config.vocab_size
        for i, ids in enumerate(chunk.input_ids):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise ValueError(f"input_ids[{i}] has ids outside [0, {vocab}); check the tokenizer / vocab_size")

    def train_microbatch(self, chunk: TrainBatch | None, *, error: Exception | None = None) -> dict[str, int]:
        """Forward/backward one chunk (cut into microbatches); gradients accumulate.

        Every data-parallel rank must call this once per chunk (with its share, possibly empty):
        ranks agree on the number of microbatches and pad with empty ones (DESIGN §2 inv. 7).

        Args:
            chunk: this rank's share of the chunk.
            error: a failure that happened on this rank while preparing its share (fetching it,
                computing reference logprobs): the rank still joins the agreement every rank
                makes before the first forward, so all of them raise instead of the others
                waiting in a collective; then ``error`` is raised here.

        Returns:
            local counts: ``{"num_microbatches", "num_samples", "num_tokens"}`` of this rank.

        Raises:
            RuntimeError: no step is open, or another rank rejected the chunk.
            ValueError: the chunk is malformed or lacks a field the loss needs — raised before
                any forward, the step stays open (abort it, or keep feeding it).
        """
        st = self._step
        if st is None:
            raise RuntimeError("train_microbatch() called with no open step; call begin_train_step(loss_fn) first")
        mbs: list[MicroBatch] = []
        if error is None:
            try:
                self._validate_chunk(chunk, st.loss_fn)
                mbs = self._cut(chunk, st)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it before any collective
                error = e
        agreed = du.all_reduce(torch.tensor([len(mbs), int(error is not None)], dtype=torch.float64), "max")
        if error is not None:
            raise error
        if agreed[1] > 0:
            raise RuntimeError("another data-parallel rank rejected this chunk (see its error); abort the step")
        if st.warmup_chunks is not None:  # run at finish, in slices of mtp_warmup_update_samples
            st.warmup_chunks.append(chunk)
            st.num_chunks += 1
            return {"num_microbatches": 0, "num_samples": len(chunk), "num_tokens": chunk.num_tokens}
        mbs += [empty_microbatch(chunk, self.model.capabilities) for _ in range(int(agreed[0]) - len(mbs))]
        for mb in mbs:
            self._run_microbatch(mb, st)
        st.num_chunks += 1
        return {"num_microbatches": len(mbs), "num_samples": len(chunk), "num_tokens": chunk.num_tokens}

    def _cut(self, chunk: TrainBatch, st: StepState) -> list[MicroBatch]:
        """The microbatches to run now (see ``MicrobatchConfig.coalesce_chunks``); no state changes on error."""
        cfg, caps = self.config.microbatch, self.model.capabilities
        if not cfg.coalesce_chunks:
            return build_microbatches(chunk, cfg, caps)
        mbs: list[MicroBatch] = []
        carry = st.carry
        if carry is not None and not _same_fields(carry, chunk):
            mbs += build_microbatches(carry, cfg, caps)  # cannot share a microbatch: run it alone
            carry = None
        stream = chunk if carry is None else TrainBatch.concat([carry, chunk])
        ready, rest = build_ready_microbatches(stream, cfg, caps)
        st.carry, st.template = rest, chunk
        return mbs + ready

    def _flush(self, st: StepState) -> None:
        """Run the carried samples (collective: every rank agrees on the count, as per chunk)."""
        if not self.config.microbatch.coalesce_chunks:
            return
        carry, st.carry = st.carry, None
        mbs = build_microbatches(carry, self.config.microbatch, self.model.capabilities) if carry is not None else []
        agreed = int(du.all_reduce(torch.tensor([len(mbs)], dtype=torch.float64), "max")[0])
        if agreed > len(mbs):
            mbs += [empty_microbatch(st.template, self.model.capabilities) for _ in range(agreed - len(mbs))]
        for mb in mbs:
            self._run_microbatch(mb, st)

    def _run_microbatch(self, mb: MicroBatch, st: StepState) -> None:
        if self.device.type == "cuda":
            # from pinned memory the copy is queued behind the running kernels instead of waiting for them
            mb = mb.pin_memory().to(self.device, non_blocking=True)
        else:
            mb = mb.to(self.device)
        # The compute copies fold every backward into one fp32 accumulator, which would merge the
        # side pass into the main gradient: the side-gradient path runs on the masters (autocast).
        # (offload refuses that path at begin: its masters are on the host)
        cw = self.offload or (self.compute_weights if st.side is None else None)
        with cw.active() if cw is not None else contextlib.nullcontext():
            self._forward_backward(mb, st)

    def _forward_backward(self, mb: MicroBatch, st: StepState) -> None:
        model = self.model
        D = model.num_mtp_depths
        # an MTP warm-up step drops the policy's gradients at finish; with detached heads on one
        # rank they need not be computed at all (the MTP gradients are the same, the backward
        # through the backbone is skipped)
        main_grad = not (
            self.steps_finished < self.config.mtp_warmup_steps
            and self.detached_heads
            and st.side is None
            and not self.distributed
        )
        with self._autocast():
            out = model(
                mb.input_ids,
                mb.segment_ids,
                mb.position_ids,
                mtp_loss_mask=mb.mtp_loss_mask if D > 0 else None,
                temperature=st.loss_fn.temperature,
                with_entropy=st.loss_fn.needs_entropy,
                logprob_mask=mb.loss_mask,
                # known on the host: no device-to-host sync to find out
                one_sample_per_row=not mb.packed or len(mb.sample_mask) <= 1,
                main_grad=main_grad,
            )
        error: Exception | None = None
        try:
            lo = st.loss_fn(out, mb)
            if st.metric_specs and set(lo.metrics) != set(st.metric_specs):
                raise RuntimeError(
                    f"the loss returned metrics {sorted(lo.metrics)} after {sorted(st.metric_specs)}; every "
                    "microbatch of a step must return the same metric names"
                )
        except Exception as e:  # noqa: BLE001 - agreed on below, before any rank runs backward
            error = e
        if self.distributed:
            # a loss that fails on one rank must stop every rank before the backward's collectives
            failed = du.all_reduce(torch.tensor([float(error is not None)], dtype=torch.float64), "max")
            if error is None and failed[0] > 0:
                raise RuntimeError("the loss failed on another data-parallel rank (see its error); abort the step")
        if error is not None:
            raise error
        # FSDP2 reduce-scatters per microbatch, so every rank must backpropagate through every
        # module even when its loss has no path to them (an empty microbatch under a
        # sequence-level loss sums nothing); the zero-weighted anchor gives that path.
        total = lo.loss + 0.0 * out.logprobs.sum()
        n_valid = mb.loss_mask.sum()
        side = None  # raw sums normalized by N_t at finish, whatever the loss type
        if model.mtp_trains:
            side = (model.mtp_config.mtp_loss_scaling_factor / D) * torch.stack(out.mtp_loss_sums).sum()
        if model.moe_aux_loss_coef > 0:
            aux = model.moe_aux_loss_coef * n_valid * out.moe_aux
            side = aux if side is None else side + aux
        scale = st.loss_multiplier * (self.scaler.scale if self.scaler is not None else 1.0)
        if st.side is not None:
            # the side pass needs the anchor too: FSDP2 re-gathers a layer's weights when the
            # gradient reaches the layer's output, and a router loss alone enters mid-layer
            anchored = side + 0.0 * out.logprobs.sum()
            st.side.backward(total * scale, anchored * scale)
        else:
            # one scalar, one backward: main and MTP gradients share the loss scale (DESIGN §3)
            ((total if side is None else total + side) * scale).backward()

        # every count and metric of the microbatch stays on the device until finish: no sync here,
        # so the host queues the next microbatch while this one runs
        st.record_microbatch(n_valid, mb.sample_mask.sum(), out, lo.metrics, D, model.is_moe)

    def abort_train_step(self) -> None:
        """Drop the open step's gradients, counts and metrics; no optimizer step. Idempotent."""
        self._zero_grads()
        self._step = None

    def finish_train_step(self) -> dict[str, float]:
        """All-reduce the counts, normalize and clip the gradients, step, and return metrics.

        A heads-only warm-up step with ``mtp_warmup_update_samples`` = m applies one update per
        m samples instead (:func:`splitrl.train.warmup.finish_warmup_in_slices`).

        Returns:
            metrics (floats): the loss's metrics, each divided by its own denominator;
            ``grad_norm`` (pre-clip; policy parameters, plus MTP ones with attached heads);
            ``mtp/grad_norm`` (detached heads); ``mtp/mtp_{k}_loss`` and
            ``mtp/mtp_{k}_acceptance_rate`` (percent) and ``mtp/mtp_{k}_num_tokens`` (the depth's
            counted targets, Σ mask_k over the step) for k = 1..D; MoE backbones:
            ``moe/aux_loss`` (L_aux, valid-token-weighted over the microbatches, without the
            coefficient) and ``moe/expert_load_max`` (:mod:`splitrl.models.moe`); ``lr``; ``num_valid_tokens``
            (N_t), ``num_valid_samples`` (N_s); ``skipped_step`` (1 when no update was applied),
            ``empty_step`` (the loss denominator was 0), ``nonfinite_grad``; ``loss_scale``
            (fp16). Metrics whose denominator is 0 are NaN.

        Raises:
            RuntimeError: no step is open.
        """
        st = self._step
        if st is None:
            raise RuntimeError("finish_train_step() called with no open step; call begin_train_step(loss_fn) first")
        if st.warmup_chunks is not None:
            metrics = finish_warmup_in_slices(self, st)
        else:
            metrics = self._finish_update(st, advance=True)
        self._report_memory()
        return metrics

    def _finish_update(self, st: StepState, *, advance: bool) -> dict[str, float]:
        """The body of :meth:`finish_train_step`; ``advance=False`` (a warm-up slice) leaves the LR
        schedule and the step count alone."""
        D, is_moe = self.model.num_mtp_depths, self.model.is_moe
        self._flush(st)
        st.absorb_pending(D, is_moe)
        sq_mtp = sq_norm(self._grads(self.mtp_params), self.device)
        sq_main = sq_norm(self._grads(self.main_params), self.device) if st.side is None else None
        totals = all_reduce_sums(st, D, sq_main, sq_mtp)
        clip = norms_and_clip(
            st,
            totals,
            loss_scale=self.scaler.scale if self.scaler is not None else 1.0,
            optim=self.config.optim,
            detached_heads=self.detached_heads,
            warmup=self.steps_finished < self.config.mtp_warmup_steps,
        )
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer.param_groups else 0.0
        apply_update(self, st, clip, advance=advance)
        loss_scale = None if self.scaler is None else self.scaler.scale  # after the update of the scale
        metrics = finish_metrics(st, totals, clip, lr, num_mtp_depths=D, is_moe=is_moe, loss_scale=loss_scale)
        if advance:
            self.steps_finished += 1
        self._step = None
        return metrics

    def train(
        self, batch: TrainBatch, loss_fn: PolicyLoss, *, expected_num_tokens: int | None = None
    ) -> dict[str, float]:
        """The synchronous step: begin → train_microbatch(batch) → finish (aborts on error)."""
        self.begin_train_step(loss_fn, expected_num_tokens=expected_num_tokens)
        try:
            self.train_microbatch(batch)
        except BaseException:
            self.abort_train_step()
            raise
        return self.finish_train_step()


def _same_fields(a: TrainBatch, b: TrainBatch) -> bool:
    names = ("generation_logprobs", "prev_logprobs", "reference_logprobs", "sample_ids")
    return all((getattr(a, n) is None) == (getattr(b, n) is None) for n in names)


def _buffers_to(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move ``module``'s buffers (rotary frequencies, ...) to ``device``; parameters stay where they are."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)
    return module
