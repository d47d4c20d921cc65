"""The heads-only MTP warm-up in slices (``mtp_warmup_update_samples`` = m; DESIGN.md §3).

A warm-up step with m set does not update at finish over all its samples: its chunks are kept
(``StepState.warmup_chunks``) and run at finish as consecutive steps of m samples each, one AdamW
update of the MTP parameters per slice (:func:`finish_warmup_in_slices`); the step's metrics
combine those of the slices (:func:`combine_slice_metrics`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from splitrl.distributed import utils as du
from splitrl.train.batch import TrainBatch
from splitrl.train.step_state import StepState

if TYPE_CHECKING:
    from splitrl.train.worker import TrainWorker


def sliced_warmup(worker: TrainWorker) -> bool:
    """This step is a heads-only warm-up step that applies one update per
    ``mtp_warmup_update_samples`` of its samples (and no slice of it is running yet)."""
    cfg = worker.config
    return (
        cfg.mtp_warmup_update_samples is not None
        and worker.steps_finished < cfg.mtp_warmup_steps
        and not worker._in_warmup_slice
    )


def finish_warmup_in_slices(worker: TrainWorker, st: StepState) -> dict[str, float]:
    """A heads-only warm-up step as consecutive updates of m = ``mtp_warmup_update_samples``
    samples each: this rank's samples in the order its chunks came, cut into slices of m, each
    slice a step of its own (normalized by its own N_t, clipped, one AdamW update of the MTP
    parameters). Every rank runs as many slices as the rank with the most (empty ones pad).
    The LR schedule and the step count advance once, as for any step.

    Returns:
        the metrics of ``TrainWorker.finish_train_step``, combined over the slices: counts summed,
        ``mtp/mtp_{k}_loss`` / ``_acceptance_rate`` weighted by the depth's counted targets
        (each slice measured before its own update), other metrics weighted by N_t, the flags
        of the last slice except ``skipped_step`` (1 only when no slice updated) and
        ``nonfinite_grad`` (1 when any slice had one); ``mtp_warmup_updates`` = the slices.
    """
    chunks = st.warmup_chunks
    full = [c for c in chunks if len(c)]
    batch = TrainBatch.concat(full) if full else None
    n, m = (len(batch) if batch is not None else 0), worker.config.mtp_warmup_update_samples
    count = int(du.all_reduce(torch.tensor([-(-n // m)], dtype=torch.float64), "max")[0])
    template = chunks[0] if chunks else None
    worker._step = None
    slices = []
    worker._in_warmup_slice = True
    try:
        for i in range(max(count, 1)):
            if batch is not None and i * m < n:
                part = batch.select(list(range(i * m, min(n, (i + 1) * m))))
            else:
                part = (batch or template).select([]) if (batch or template) is not None else None
            worker.begin_train_step(st.loss_fn, expected_num_tokens=st.expected_num_tokens)
            try:
                if part is not None:
                    worker.train_microbatch(part)
                slices.append(worker._finish_update(worker._step, advance=False))
            except BaseException:
                worker.abort_train_step()
                raise
    finally:
        worker._in_warmup_slice = False
    applied = any(r["skipped_step"] == 0.0 for r in slices)
    if applied:
        worker.scheduler.step()
    worker.steps_finished += 1
    return combine_slice_metrics(slices, worker.model.num_mtp_depths)


def combine_slice_metrics(slices: list[dict[str, float]], num_depths: int) -> dict[str, float]:
    """One step's metrics from those of its warm-up slices (see :func:`finish_warmup_in_slices`)."""

    def weighted(key: str, weight_key: str) -> float:
        pairs = [(r[key], r[weight_key]) for r in slices if r[weight_key] > 0 and math.isfinite(r[key])]
        total = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / total if total else float("nan")

    out = dict(slices[-1])
    summed = {"num_valid_tokens", "num_valid_samples"} | {f"mtp/mtp_{k}_num_tokens" for k in range(1, num_depths + 1)}
    per_depth = {f"mtp/mtp_{k}_{x}": f"mtp/mtp_{k}_num_tokens" for k in range(1, num_depths + 1)
                 for x in ("loss", "acceptance_rate")}  # fmt: skip
    flags = {"skipped_step", "empty_step", "nonfinite_grad", "mtp_warmup", "lr", "loss_scale"}
    for key in out:
        if key in summed:
            out[key] = sum(r[key] for r in slices)
        elif key in per_depth:
            out[key] = weighted(key, per_depth[key])
        elif key not in flags:
            out[key] = weighted(key, "num_valid_tokens")
    out["skipped_step"] = float(all(r["skipped_step"] for r in slices))
    out["empty_step"] = float(all(r["empty_step"] for r in slices))
    out["nonfinite_grad"] = float(any(r["nonfinite_grad"] for r in slices))
    out["mtp_warmup_updates"] = float(sum(1 for r in slices if not r["skipped_step"]))
    return out
