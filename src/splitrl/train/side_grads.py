"""Exact gradients when the policy gradient mixes N_s and N_t (DESIGN §3).

Under a ``SEQUENCE_LEVEL`` loss the policy loss is normalized by N_s, while the losses that are
normalized by N_t whatever the loss type — the MTP loss, and the router load-balancing loss of a
mixture-of-experts backbone (:mod:`splitrl.models.moe`) — may reach the same parameters: the MTP
loss does with attached heads (``mtp_detach_heads=false``, λ > 0), the router loss always does.
The gradient of such a parameter has two parts with different denominators:

    g = ∇ raw_main / N_s + ∇ raw_side / N_t
    raw_side = (λ/D) Σ_k Σ_t CE_k(t)·mask_k(t)  [attached heads]  +  c_aux · Σ_mb n_t(mb)·L_aux(mb)  [MoE]

(λ/D and c_aux are inside the raw side sum, as on every other path.) N_s and N_t are known only at
finish, so one accumulator cannot hold the sum. :class:`SideLossGradients` keeps two: per
microbatch the side loss is backpropagated first, into a second fp32 buffer per policy parameter,
then the main loss into ``.grad``; finish combines them once. The buffers are swapped in and out of
``.grad`` (no copies), so under FSDP2 both backward passes are reduce-scattered (summed over ranks)
into their own sharded accumulator exactly as a single backward is — every rank runs both passes
for every microbatch, empty ones included, so the collectives match. MTP parameters only ever get
side-loss gradient and keep using ``.grad``.

Cost (these combinations only; all others run one backward): a second backward pass through the
backbone per microbatch (with FSDP2 also its all-gathers and reduce-scatters), the graph kept
alive between the two passes, and one fp32 gradient buffer the size of the (local shard of the)
policy parameters.

The fp16 loss scale and the per-step loss multiplier multiply both losses alike; finish divides
them out together with 1/N_s and 1/N_t.
"""

from __future__ import annotations

import torch

from splitrl.loss.base import LossType


def needs_side_gradients(loss_type: LossType, model) -> bool:
    """True when the policy gradient mixes N_s and N_t (module docstring): a ``SEQUENCE_LEVEL``
    loss with attached, trained MTP heads or with a router load-balancing loss."""
    if LossType(loss_type) != LossType.SEQUENCE_LEVEL:
        return False
    attached_mtp = model.mtp_trains and not model.mtp_config.mtp_detach_heads
    return attached_mtp or model.moe_aux_loss_coef > 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class SideLossGradients:
    """The side losses' share of the policy parameters' gradient, accumulated apart from ``.grad``.

    Args:
        params: the policy (non-MTP) parameters both losses reach.
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.side_grads: list[torch.Tensor | None] = [None] * len(params)

    def backward(self, main_loss: torch.Tensor, side_loss: torch.Tensor) -> None:
        """Backpropagate both (already scaled) scalars: the side one into the second buffers, the
        main one into ``.grad``. MTP parameters receive their gradient in ``.grad`` as usual."""
        main_grads = [p.grad for p in self.params]
        for p, g in zip(self.params, self.side_grads):
            p.grad = g
        try:
            side_loss.backward(retain_graph=True)
        finally:
            self.side_grads = [p.grad for p in self.params]
            for p, g in zip(self.params, main_grads):
                p.grad = g
        main_loss.backward()

    def local_sq_terms(self) -> torch.Tensor:
        """[3] float64 on CPU: (Σ a², Σ b², Σ a·b) over this rank's elements, a = the main
        accumulation (``.grad``), b = the side one — all-reduced (summed) with the step's counts,
        they give ‖α·a + β·b‖² for any α, β without another collective."""
        dev = self.params[0].device if self.params else torch.device("cpu")
        out = torch.zeros(3, dtype=torch.float64, device=dev)
        for p, b in zip(self.params, self.side_grads):
            a = None if p.grad is None else _local(p.grad).detach().double()
            bl = None if b is None else _local(b).detach().double()
            if a is not None:
                out[0] += a.pow(2).sum()
            if bl is not None:
                out[1] += bl.pow(2).sum()
            if a is not None and bl is not None:
                out[2] += (a * bl).sum()
        return out.cpu()

    @torch.no_grad()
    def combine_into_grad(self, main_factor: float, side_factor: float) -> None:
        """``.grad`` ← main_factor·``.grad`` + side_factor·buffer, then drop the buffers."""
        for p, b in zip(self.params, self.side_grads):
            if p.grad is None:
                if b is not None:
                    p.grad = b.mul_(side_factor)
                continue
            p.grad.mul_(main_factor)
            if b is not None:
                p.grad.add_(b, alpha=side_factor)
        self.side_grads = [None] * len(self.params)
