"""The open step's state (:class:`StepState`): what a step accumulates between
``begin_train_step`` and ``finish_train_step`` of :class:`splitrl.train.worker.TrainWorker`.

Per microbatch the counts and metrics stay on the device, one row each
(:meth:`StepState.record_microbatch`); finish reads them back once and adds them into the host
sums (:meth:`StepState.absorb_pending`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from splitrl.loss.base import Metric, Normalizer, PolicyLoss
from splitrl.train.batch import TrainBatch
from splitrl.train.side_grads import SideLossGradients

if TYPE_CHECKING:
    from splitrl.models.policy import PolicyOutput


@dataclass
class StepState:
    """What the open step has gathered so far (``TrainWorker._step``; ``None`` between steps)."""

    loss_fn: PolicyLoss
    loss_multiplier: float
    num_tokens: torch.Tensor  # float64 scalar, local N_t
    num_samples: torch.Tensor  # local N_s
    mtp_sums: torch.Tensor  # [3, D] float64: CE, hits, counts
    moe_sums: torch.Tensor  # [2] float64: Σ n_t·L_aux, Σ n_t·expert_load_max
    # SEQUENCE_LEVEL with N_t-normalized losses reaching the policy: their share, kept apart
    side: SideLossGradients | None = None
    metric_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    metric_specs: dict[str, tuple[Normalizer | None, str]] = field(default_factory=dict)
    num_microbatches: int = 0
    num_chunks: int = 0
    # per microbatch: its counts and metrics, still on the device; read back once, at finish
    pending: list[tuple[torch.Tensor, list[str]]] = field(default_factory=list)
    # coalesce_chunks: the samples of the last, unfilled microbatch, and a chunk to shape empty ones
    carry: TrainBatch | None = None
    template: TrainBatch | None = None
    expected_num_tokens: int | None = None
    # a heads-only warm-up step with ``mtp_warmup_update_samples``: its chunks, run at finish
    warmup_chunks: list[TrainBatch] | None = None

    def record_microbatch(
        self,
        n_valid: torch.Tensor,
        n_samples: torch.Tensor,
        out: PolicyOutput,
        metrics: dict[str, Metric],
        num_mtp_depths: int,
        is_moe: bool,
    ) -> None:
        """Queue a microbatch's counts and metrics as one device-side row (no sync: the host
        queues the next microbatch while this one runs); :meth:`absorb_pending` reads them."""
        D = num_mtp_depths
        names = list(metrics)
        parts = [n_valid, n_samples]
        if is_moe:
            parts += [n_valid * out.moe_aux, n_valid * out.moe_load_max]
        if D > 0:
            parts += [*out.mtp_loss_sums, *out.mtp_hit_sums, *out.mtp_counts]
        parts += [metrics[k].value for k in names]
        self.pending.append((torch.stack([p.detach().double().reshape(()) for p in parts]), names))
        if not self.metric_specs:
            self.metric_specs = {k: (m.normalizer, m.reduce) for k, m in metrics.items()}
        self.num_microbatches += 1

    def absorb_pending(self, num_mtp_depths: int, is_moe: bool) -> None:
        """Add the microbatches' device-side counts and metrics into the step's host sums (one copy)."""
        if not self.pending:
            return
        rows = torch.stack([v for v, _ in self.pending]).cpu()
        names_of = [n for _, n in self.pending]
        self.pending = []
        for host, names in zip(rows, names_of):
            self._absorb(host, names, num_mtp_depths, is_moe)

    def _absorb(self, host: torch.Tensor, names: list[str], D: int, is_moe: bool) -> None:
        self.num_tokens += host[0]
        self.num_samples += host[1]
        if is_moe:
            self.moe_sums += host[2:4]
            host = torch.cat([host[:2], host[4:]])
        if D > 0:
            self.mtp_sums += host[2 : 2 + 3 * D].reshape(3, D)
        for k, v in zip(names, host[2 + 3 * D :]):
            reduce = self.metric_specs[k][1]
            if k not in self.metric_sums:
                self.metric_sums[k] = v
            elif reduce == "sum":
                self.metric_sums[k] = self.metric_sums[k] + v
            elif reduce == "min":
                self.metric_sums[k] = torch.minimum(self.metric_sums[k], v)
            else:
                self.metric_sums[k] = torch.maximum(self.metric_sums[k], v)
