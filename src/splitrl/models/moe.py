"""Router statistics and load-balancing loss of mixture-of-experts backbones (Qwen3-MoE).

Legend: B = rows, S = positions, E = experts, k = experts per token, L = MoE layers.

Definition (per microbatch; routing statistics of that microbatch only, as Megatron-Core computes
them — not of the whole step, which no chunk knows before finish):

    L_aux(mb) = E · Σ_e f_e · P_e                         (Switch Transformer eqs. 4–6)
        f_e = share of top-k assignments to expert e, over the microbatch's real (non-padding)
              tokens and all MoE layers of the backbone, times k  (Σ_e f_e = k)
        P_e = mean router probability of expert e over the same tokens and layers

This is transformers' own ``load_balancing_loss_func`` for the family (the loss
``Qwen3MoeForCausalLM`` adds with ``output_router_logits=True``), padding excluded; prompt tokens
count, since the router sees them as well. A perfectly balanced router gives L_aux = k.

In the split step each microbatch contributes the raw sum ``n_t(mb) · L_aux(mb)`` (n_t: its valid
tokens, the ones N_t counts), and finish divides once by N_t:

    aux_loss(step) = Σ_mb n_t(mb) · L_aux(mb) / N_t       (gradient: router_aux_loss_coef × this)

— the valid-token-weighted mean of the microbatches' losses, so a microbatch with nothing to learn
from (an empty or fully masked one) contributes nothing, and the router loss shares the MTP loss's
denominator. Promise: the result does not depend on how a step is chunked, in which order, or how
it is spread over data-parallel ranks, as long as every microbatch holds the same samples
(``micro_batch_size=1`` without packing fixes that). Not promised: invariance to the microbatch
composition itself (micro_batch_size, token budget, packing) — L_aux is not linear in a
microbatch's tokens, exactly as in Megatron-Core. Only the backbone's routers enter L_aux; the
routers of MoE MTP layers are trained by the MTP loss alone.

``expert_load_max(mb)``: per MoE layer the share of the layer's top-k assignments that went to its
busiest expert (1/E when balanced, 1 when collapsed), averaged over layers; reported
valid-token-weighted over the step like ``aux_loss``.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func


def router_statistics(
    router_logits: tuple[torch.Tensor, ...], real_BS: torch.Tensor, num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_aux, expert_load_max) of one microbatch, both fp32 scalars.

    Args:
        router_logits: one [B·S, E] tensor per MoE layer of the backbone (transformers'
            ``router_logits`` output), rows in [B, S] order.
        real_BS: [B, S] bool, True at real (non-padding) tokens.
        num_experts, top_k: E and k of the family's config.

    Returns:
        L_aux (differentiable through the router probabilities; 0 with the graph kept when the
        microbatch has no real token) and expert_load_max (no gradient).
    """
    if not router_logits:
        raise ValueError("router_statistics needs the router logits of at least one MoE layer")
    if not bool(real_BS.any()):
        # an all-padding microbatch: nothing to balance, but the routers stay in the graph
        # (FSDP2 reduce-scatters per microbatch on every rank)
        zero = sum(r.float().sum() for r in router_logits) * 0.0
        return zero, zero.detach()
    mask = real_BS.to(torch.float32)
    aux = load_balancing_loss_func(tuple(router_logits), num_experts, top_k, attention_mask=mask)
    with torch.no_grad():
        flat = mask.reshape(-1)
        shares = []
        for logits in router_logits:
            chosen = logits.topk(top_k, dim=-1).indices  # softmax is monotone: same top-k as the probs
            counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
            counts.scatter_add_(0, chosen.reshape(-1), flat.to(logits.device).repeat_interleave(top_k))
            shares.append(counts.max() / counts.sum())
        load_max = torch.stack(shares).mean()
    return aux.float(), load_max
