"""Preallocated per-slot KV caches and the attention that reads them.

Legend: S = slots (rows the engine can hold), N = layers, Hk = key/value heads, M = cache length,
d = head dim, B = rows of a forward (slots 0..B-1), Q = new tokens per row, L = cache prefix read.

A slot's entry for position p lives at index p: no padding, no compaction. A query at position p
attends to the indices j <= limit (its committed context, ``limit`` = p for the backbone) and to
its own index. Entries past the context may hold stale values (rejected drafts, a finished row's
leftovers): they are never read before being rewritten, because every position is written by the
forward that first makes it part of a context. Writes that must not land anywhere (invalid draft
window entries) go to the last index, ``scratch``, which no context reaches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionPlan:
    """Write indices and the additive mask of one forward (see :meth:`StaticKVCache.plan`).

    Attributes:
        flat_index: int64 [B*Q*Hk] rows of the cache layer viewed as [S*Hk*M, d].
        mask: fp32 [B, 1, 1, Q, L], 0 where allowed, -inf elsewhere.
        length: L, the cache prefix read.
        slots: the rows' slots, or None for slots 0..B-1.
    """

    flat_index: torch.Tensor
    mask: torch.Tensor
    length: int
    slots: torch.Tensor | None
    _grouped: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def grouped_mask(self, G: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask repeated for G query heads per key/value head, [B, 1, G*Q, L] in ``dtype``
        (0 and -inf are exact in every float dtype); built once per plan (the first layer) and
        shared by the others."""
        key = (G, dtype)
        if key not in self._grouped:
            B, _, _, Q, L = self.mask.shape
            self._grouped[key] = self.mask.expand(B, 1, G, Q, L).reshape(B, 1, G * Q, L).to(dtype)
        return self._grouped[key]


class StaticKVCache:
    """Keys and values of ``num_layers`` attention layers for ``slots`` rows of ``max_len`` positions.

    Args:
        num_layers, slots, kv_heads, max_len, head_dim: the shape [N, S, Hk, M, d].
        dtype, device: of the tensors (the model's compute dtype).
    """

    def __init__(
        self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device
    ) -> None:
        shape = (num_layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.max_len = slots, max_len

    @property
    def scratch(self) -> int:
        return self.max_len - 1

    def write_prefix(self, layer: int, slot_ids: torch.Tensor, k_BMHd: torch.Tensor, v_BMHd: torch.Tensor) -> None:
        """Positions 0..M'-1 of the slots ``slot_ids`` [B] (a prefill)."""
        M = k_BMHd.shape[1]
        self.k[layer, :, :, :M].index_copy_(0, slot_ids, k_BMHd.transpose(1, 2))
        self.v[layer, :, :, :M].index_copy_(0, slot_ids, v_BMHd.transpose(1, 2))

    def plan(
        self,
        write_pos_BQ: torch.Tensor,
        positions_BQ: torch.Tensor,
        limit_BQ: torch.Tensor,
        length: int,
        slots_B: torch.Tensor | None = None,
    ) -> AttentionPlan:
        """Where a forward's Q entries per row go and what each may read (shared by all layers).

        Entry (b, q) is written to slot b (or ``slots_B[b]``) at index ``write_pos_BQ[b, q]``; as a
        query it reads the first ``length`` indices j with j <= ``limit_BQ[b, q]`` or
        j = ``positions_BQ[b, q]`` (its own entry). At least one index must be allowed (``limit``
        >= 0, or the own entry within ``length``).
        """
        B, Q = write_pos_BQ.shape
        Hk, M = self.k.shape[2], self.max_len
        device = write_pos_BQ.device
        rows = torch.arange(B, device=device) if slots_B is None else slots_B
        heads = torch.arange(Hk, device=device)
        flat = ((rows[:, None, None] * Hk + heads) * M + write_pos_BQ[:, :, None]).reshape(-1)  # [B*Q*Hk]
        j = torch.arange(length, device=device)
        allowed = (j <= limit_BQ[..., None]) | (j == positions_BQ[..., None])  # [B, Q, L]
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device).masked_fill(~allowed, float("-inf"))
        return AttentionPlan(flat, mask[:, None, None], length, slots_B)

    def write(self, layer: int, plan: AttentionPlan, k_BQHd: torch.Tensor, v_BQHd: torch.Tensor) -> None:
        """Store a forward's keys and values where ``plan`` says (graph-safe: one index_copy_ each)."""
        d = k_BQHd.shape[-1]
        self.k[layer].view(-1, d).index_copy_(0, plan.flat_index, k_BQHd.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, plan.flat_index, v_BQHd.reshape(-1, d))

    def attend(self, layer: int, q_BQHd: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
        """Attention of the queries of slots 0..B-1 (or ``plan.slots``, then with a copy) over
        their first ``plan.length`` entries, masked as :meth:`plan` says.

        Heads are grouped as in transformers' ``repeat_kv`` (query head h reads kv head h // G); the
        G query heads of a kv head are folded into the query dimension, so one
        ``scaled_dot_product_attention`` call (one fused kernel on CUDA, softmax in fp32) reads
        each key and value once, without repeating them.

        Returns:
            [B, Q, H * d] in the query's dtype.
        """
        B, Q, H, d = q_BQHd.shape
        length = plan.length
        if plan.slots is None:
            k = self.k[layer, :B, :, :length]  # [B, Hk, L, d], a view: no copy
            v = self.v[layer, :B, :, :length]
        else:
            k = self.k[layer][plan.slots, :, :length]
            v = self.v[layer][plan.slots, :, :length]
        Hk = k.shape[1]
        G = H // Hk
        q = q_BQHd.view(B, Q, Hk, G, d).permute(0, 2, 3, 1, 4).reshape(B, Hk, G * Q, d)
        mask = plan.grouped_mask(G, q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, Hk, G*Q, d]
        return out.view(B, Hk, G, Q, d).permute(0, 3, 1, 2, 4).reshape(B, Q, H * d)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` [n] to ``dst`` [n] (all layers, all positions)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


def causal_attention(q_BMHd: torch.Tensor, k_BMHd: torch.Tensor, v_BMHd: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of a right-padded prefill (real tokens never see the padding after them).

    Returns [B, M, H * d].
    """
    B, M, H, d = q_BMHd.shape
    G = H // k_BMHd.shape[2]
    q = q_BMHd.transpose(1, 2)
    k = k_BMHd.transpose(1, 2).repeat_interleave(G, dim=1)
    v = v_BMHd.transpose(1, 2).repeat_interleave(G, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(B, M, H * d)
