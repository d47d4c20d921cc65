"""Logprobs of given targets without keeping the full logits alive.

Legend: N = flattened positions, H = hidden size, V = vocabulary.

The output head is applied chunk by chunk under activation checkpointing, so only one chunk of
logits [chunk, V] exists at a time, in the forward and again in the backward (recomputed). This is
what lets a 150 k-token vocabulary train on long rows without a [N, V] fp32 tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_stats(
    hidden_CH: torch.Tensor, weight_VH: torch.Tensor, targets_C: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits_CV = F.linear(hidden_CH, weight_VH).float()
    if temperature != 1.0:
        logits_CV = logits_CV / temperature
    logp_CV = torch.log_softmax(logits_CV, dim=-1)
    logprobs_C = logp_CV.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1)
    if with_entropy:
        entropy_C = -(logp_CV.exp() * logp_CV).sum(-1)
    else:
        entropy_C = torch.zeros_like(logprobs_C)
    hit_C = (logits_CV.detach().argmax(-1) == targets_C).float()
    return logprobs_C, entropy_C, hit_C


def target_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob of each target under softmax(hidden @ weightᵀ / temperature).

    Args:
        hidden_NH: [N, H] hidden states (any float dtype; logits are upcast to fp32).
        weight_VH: [V, H] output-head weight.
        targets_N: [N] int64 target ids in [0, V).
        temperature: sampling temperature T (DESIGN §5: logprobs are of logits / T).
        with_entropy: also return the entropy of each distribution (differentiable).
        chunk_size: positions per checkpointed chunk.

    Returns:
        (logprobs [N] fp32, entropy [N] fp32 (zeros unless ``with_entropy``),
        hit [N] fp32 — 1.0 where argmax == target, not differentiable).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define logprobs, got {temperature}")
    need_grad = torch.is_grad_enabled() and (hidden_NH.requires_grad or weight_VH.requires_grad)
    outs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for start in range(0, max(hidden_NH.shape[0], 1), chunk_size):
        h = hidden_NH[start : start + chunk_size]
        t = targets_N[start : start + chunk_size]
        if need_grad:
            outs.append(checkpoint(_chunk_stats, h, weight_VH, t, temperature, with_entropy, use_reentrant=False))
        else:
            outs.append(_chunk_stats(h, weight_VH, t, temperature, with_entropy))
    return tuple(torch.cat([o[i] for o in outs]) for i in range(3))  # type: ignore[return-value]
