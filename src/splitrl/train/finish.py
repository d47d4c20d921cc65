"""The finish of a train step (DESIGN.md §2, §3): from the accumulated raw sums to one update.

    all_reduce_sums   the step's counts, squared gradient norms and metric sums over every rank
    norms_and_clip    the loss denominator, the normalizing factors, the norms, the clip coefficients
    apply_update      scale the gradients once, optimizer and LR step, fp16 loss-scale update
    finish_metrics    every metric over its own denominator

:meth:`splitrl.train.worker.TrainWorker.finish_train_step` runs them in this order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitrl.distributed import utils as du
from splitrl.loss.base import LossType, Normalizer
from splitrl.train.config import OptimConfig
from splitrl.train.memory_plan import NORM_CHUNK
from splitrl.train.step_state import StepState

if TYPE_CHECKING:
    from splitrl.train.worker import TrainWorker


@dataclass
class StepTotals:
    """A finishing step's sums over every chunk and rank (floats; see :func:`all_reduce_sums`)."""

    n_tokens: float  # N_t
    n_samples: float  # N_s
    sq_main: float  # Σ g² of the policy parameters (one accumulator)
    sq_mtp: float  # Σ g² of the MTP parameters
    sq_a: float  # side gradients: Σ a², Σ b², Σ a·b of the two policy accumulators
    sq_b: float
    dot_ab: float
    moe_aux_sum: float  # Σ n_t·L_aux
    moe_load_sum: float  # Σ n_t·expert_load_max
    mtp_sums: torch.Tensor  # [3, D]: CE, hits, counts
    metric_sums: dict[str, float]  # summed metrics (raw)
    extrema: dict[str, float]  # min / max metrics


@dataclass
class Clipping:
    """How a finishing step scales its gradients (see :func:`norms_and_clip`)."""

    main_denom: float  # N_t or N_s, the loss type's
    empty: bool  # the denominator is 0: nothing to learn from
    nonfinite: bool  # a squared norm is inf / NaN
    warmup: bool  # an MTP warm-up step: only the heads train
    inv_main: float  # 1 / (loss scale · multiplier · main_denom)
    inv_mtp: float  # 1 / (loss scale · multiplier · N_t)
    main_coef: float  # clip coefficients
    mtp_coef: float
    norm_metrics: dict[str, float]  # grad_norm (and mtp/grad_norm with detached heads)

    @property
    def skipped(self) -> bool:
        return self.empty or self.nonfinite


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def sq_norm(grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Σ g² in fp64 over this rank's elements of ``grads``, read in pieces of ``NORM_CHUNK``
    elements (a whole fp64 copy and its square of the largest gradient, 16 bytes an element,
    was the largest buffer of finish: 10 GB for the 8 B shape's embedding)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g is not None:
            for piece in _local(g).detach().reshape(-1).split(NORM_CHUNK):
                total += piece.double().pow(2).sum()
    return total.cpu()


def all_reduce_sums(
    st: StepState, num_mtp_depths: int, sq_main: torch.Tensor | None, sq_mtp: torch.Tensor
) -> StepTotals:
    """The step's global counts, squared gradient norms and metric sums: one all-reduce for
    every sum (counts, norms, the side-gradient terms, MoE and MTP sums, summed metrics), one
    each for the min and the max metrics.

    Args:
        sq_main, sq_mtp: this rank's Σ g² (:func:`sq_norm`) of the policy and of the MTP
            parameters; ``sq_main`` is None with side gradients (their terms come from ``st.side``).
    """
    D = num_mtp_depths
    names = sorted(st.metric_specs)
    sum_names = [k for k in names if st.metric_specs[k][1] == "sum"]
    if st.side is None:
        sep = torch.zeros(3, dtype=torch.float64)
    else:  # (Σa², Σb², Σa·b) of the two policy accumulators (see side_grads)
        sq_main, sep = torch.zeros((), dtype=torch.float64), st.side.local_sq_terms()
    sums = torch.cat(
        [
            torch.stack([st.num_tokens, st.num_samples, sq_main, sq_mtp]),
            sep,
            st.moe_sums,
            st.mtp_sums.reshape(-1),
            torch.stack([st.metric_sums[k] for k in sum_names]) if sum_names else torch.zeros(0, dtype=torch.float64),
        ]
    )
    du.all_reduce(sums, "sum")
    extrema = {}
    for op in ("min", "max"):
        ks = [k for k in names if st.metric_specs[k][1] == op]
        if ks:
            vals = du.all_reduce(torch.stack([st.metric_sums[k] for k in ks]), op)
            extrema.update(dict(zip(ks, vals.tolist())))
    n_tokens, n_samples, sq_main, sq_mtp = sums[:4].tolist()
    sq_a, sq_b, dot_ab = sums[4:7].tolist()
    moe_aux_sum, moe_load_sum = sums[7:9].tolist()
    return StepTotals(
        n_tokens=n_tokens,
        n_samples=n_samples,
        sq_main=sq_main,
        sq_mtp=sq_mtp,
        sq_a=sq_a,
        sq_b=sq_b,
        dot_ab=dot_ab,
        moe_aux_sum=moe_aux_sum,
        moe_load_sum=moe_load_sum,
        mtp_sums=sums[9 : 9 + 3 * D].reshape(3, D),
        metric_sums=dict(zip(sum_names, sums[9 + 3 * D :].tolist())),
        extrema=extrema,
    )


def norms_and_clip(
    st: StepState,
    t: StepTotals,
    *,
    loss_scale: float,
    optim: OptimConfig,
    detached_heads: bool,
    warmup: bool,
) -> Clipping:
    """The loss denominator, the factors that normalize the gradients (and unscale the fp16
    loss scale and the loss multiplier), the pre-clip norms and the clip coefficients:
    policy and MTP groups apart with detached heads, one norm over both with attached ones.

    Args:
        loss_scale: the fp16 loss scale of the step (1.0 without one).
        warmup: an MTP warm-up step (only the heads train).
    """
    loss_type = LossType(st.loss_fn.loss_type)
    main_denom = t.n_tokens if loss_type == LossType.TOKEN_LEVEL else t.n_samples
    raw_scale = st.loss_multiplier * loss_scale
    empty = main_denom == 0
    norm_metrics: dict[str, float] = {}

    inv_main = 1.0 / (raw_scale * main_denom) if not empty else 0.0
    inv_mtp = 1.0 / (raw_scale * t.n_tokens) if t.n_tokens > 0 else 0.0
    mtp_norm = math.sqrt(t.sq_mtp) * inv_mtp
    if st.side is not None:
        # ‖a/N_s + b/N_t‖ of the combined policy gradient, from the all-reduced terms
        sq = inv_main**2 * t.sq_a + inv_mtp**2 * t.sq_b + 2.0 * inv_main * inv_mtp * t.dot_ab
        main_norm = math.sqrt(max(sq, 0.0)) if math.isfinite(sq) else sq
        nonfinite = not all(math.isfinite(x) for x in (t.sq_a, t.sq_b, t.dot_ab, t.sq_mtp))
    else:
        main_norm = math.sqrt(t.sq_main) * inv_main
        nonfinite = not (math.isfinite(t.sq_main) and math.isfinite(t.sq_mtp))
    if detached_heads:
        main_coef = clip_coef(main_norm, optim.max_grad_norm)
        mtp_limit = optim.mtp_max_grad_norm if optim.mtp_max_grad_norm is not None else optim.max_grad_norm
        mtp_coef = clip_coef(mtp_norm, mtp_limit)
        norm_metrics["grad_norm"] = main_norm
        norm_metrics["mtp/grad_norm"] = mtp_norm
    else:
        # attached heads: MTP parameters are part of the policy's norm and clip
        total_norm = math.sqrt(main_norm**2 + mtp_norm**2)
        main_coef = mtp_coef = clip_coef(total_norm, optim.max_grad_norm)
        norm_metrics["grad_norm"] = total_norm
    if warmup and not detached_heads:  # the heads' own norm: the policy's grads are dropped
        mtp_limit = optim.mtp_max_grad_norm if optim.mtp_max_grad_norm is not None else optim.max_grad_norm
        mtp_coef = clip_coef(mtp_norm, mtp_limit)
    return Clipping(
        main_denom=main_denom,
        empty=empty,
        nonfinite=nonfinite,
        warmup=warmup,
        inv_main=inv_main,
        inv_mtp=inv_mtp,
        main_coef=main_coef,
        mtp_coef=mtp_coef,
        norm_metrics=norm_metrics,
    )


def apply_update(worker: TrainWorker, st: StepState, c: Clipping, *, advance: bool = True) -> None:
    """Scale the gradients once (normalization × clip; an MTP warm-up drops the policy's),
    step the optimizer and the LR schedule (``advance``) — neither on an empty or non-finite
    step — update the fp16 loss scale and drop the gradients."""
    if not c.skipped:
        with torch.no_grad():
            if c.warmup:  # MTP warmup: AdamW skips parameters without a gradient (no decay, no state)
                for _, p in worker.main_params:
                    p.grad = None
                if worker.offload is not None:
                    worker.offload.drop_grads([p for _, p in worker.main_params])
            elif st.side is not None:
                st.side.combine_into_grad(c.inv_main * c.main_coef, c.inv_mtp * c.main_coef)
            else:
                scale_grads(worker._grads(worker.main_params), c.inv_main * c.main_coef)
            scale_grads(worker._grads(worker.mtp_params), c.inv_mtp * c.mtp_coef)
        if worker.offload is not None:
            worker.offload.step(worker.optimizer)  # on the host, bucket by bucket; weights copied back
        else:
            worker.optimizer.step()
        if advance:
            worker.scheduler.step()
        worker.updates_applied += 1
    if worker.scaler is not None and not c.empty:
        worker.scaler.update(c.nonfinite)
    worker._zero_grads()


def finish_metrics(
    st: StepState,
    t: StepTotals,
    c: Clipping,
    lr: float,
    *,
    num_mtp_depths: int,
    is_moe: bool,
    loss_scale: float | None,
) -> dict[str, float]:
    """The step's metrics (see ``TrainWorker.finish_train_step``), each over its own denominator;
    ``loss_scale``: the fp16 loss scale after the step's update (None without one)."""
    D = num_mtp_depths
    metrics = dict(c.norm_metrics)
    denoms = {
        Normalizer.TOKENS: t.n_tokens,
        Normalizer.SEQUENCES: t.n_samples,
        Normalizer.NONE: 1.0,
        None: c.main_denom,
    }
    for k in sorted(st.metric_specs):
        normalizer, reduce = st.metric_specs[k]
        if reduce != "sum":
            v = t.extrema[k]
            metrics[k] = v if math.isfinite(v) else float("nan")
        else:
            d = denoms[normalizer]
            metrics[k] = t.metric_sums[k] / d if d else float("nan")
    for k in range(D):
        ce, hit, cnt = t.mtp_sums[:, k].tolist()
        metrics[f"mtp/mtp_{k + 1}_loss"] = ce / cnt if cnt else float("nan")
        metrics[f"mtp/mtp_{k + 1}_acceptance_rate"] = 100.0 * hit / cnt if cnt else float("nan")
        # the count explains a NaN loss: depth k had no target inside any kept response
        metrics[f"mtp/mtp_{k + 1}_num_tokens"] = cnt
    if is_moe:
        metrics["moe/aux_loss"] = t.moe_aux_sum / t.n_tokens if t.n_tokens else float("nan")
        metrics["moe/expert_load_max"] = t.moe_load_sum / t.n_tokens if t.n_tokens else float("nan")
    metrics.update(
        {
            "lr": lr,
            "num_valid_tokens": t.n_tokens,
            "num_valid_samples": t.n_samples,
            "skipped_step": float(c.skipped),
            "empty_step": float(c.empty),
            "nonfinite_grad": float(c.nonfinite),
            "mtp_warmup": float(c.warmup),
        }
    )
    if loss_scale is not None:
        metrics["loss_scale"] = loss_scale
    return metrics


def clip_coef(norm: float, limit: float | None) -> float:
    if limit is None or not math.isfinite(norm):
        return 1.0
    return min(1.0, limit / (norm + 1e-6))


def scale_grads(grads: list[torch.Tensor | None], factor: float) -> None:
    for g in grads:
        if g is not None:
            g.mul_(factor)
