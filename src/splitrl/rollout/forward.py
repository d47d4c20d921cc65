"""The decoder forward of the rollout engine, over the Hugging Face backbone's own modules.

Legend: B = rows, M = tokens per row, H = hidden size, V = vocabulary.

The layers are those of the backbone (Qwen3 and Llama families): input RMSNorm, q/k/v projections
(Qwen3: per-head q_norm / k_norm), rotary embedding from the backbone's ``rotary_emb``, attention,
o_proj, residual, post-attention RMSNorm, MLP, residual. Only the attention differs from
transformers': keys and values go to a preallocated :class:`~splitrl.rollout.kv.StaticKVCache`, so
a decode step has static shapes and can be captured in a CUDA graph. Every weight is read through
the modules at call time, so an in-place weight update (``copy_``) is seen by captured graphs.

The MTP depth forward follows ``MTPBlock.depth_forward`` (DESIGN §3):
h^k = norm(layer_k(fc(concat[enorm(Emb), hnorm(h^{k-1})]))), with the parts read through
:func:`mtp_parts` so that a per-depth layout of the norms and ``fc`` only changes that function.
"""

from __future__ import annotations

import torch
from torch import nn

from splitrl.models.policy import PolicyModel
from splitrl.rollout.kv import StaticKVCache, causal_attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x_BMHd: torch.Tensor, cos_BMd: torch.Tensor, sin_BMd: torch.Tensor) -> torch.Tensor:
    # transformers' apply_rotary_pos_emb, with heads after positions
    return x_BMHd * cos_BMd[:, :, None] + _rotate_half(x_BMHd) * sin_BMd[:, :, None]


def mtp_parts(model: PolicyModel, depth: int) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module, nn.Module]:
    """(enorm, hnorm, fc, decoder layer, final norm) of MTP depth ``depth`` (1-indexed)."""
    mtp = model.mtp
    assert mtp is not None
    per_depth = getattr(mtp, "depth_modules", None)
    if callable(per_depth):  # a per-depth layout names its own parts
        return per_depth(depth)
    return mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc, mtp.layer_for_depth(depth), mtp.norm


def check_supported(model: PolicyModel) -> None:
    """Raise ValueError for backbones whose layers this forward does not reproduce."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in types) or getattr(cfg, "use_sliding_window", False):
        raise ValueError(
            "the rollout engine supports full-attention layers only (no sliding window); "
            f"got layer_types={sorted(set(types))}"
        )
    rope = getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) == "dynamic":
        raise ValueError("dynamic RoPE scaling depends on the sequence length; the rollout engine needs a static RoPE")


class DecoderForward:
    """Prefill and cached decode through the backbone (and the MTP depths) of ``model``."""

    def __init__(self, model: PolicyModel):
        check_supported(model)
        self.model = model
        self.layers = list(model.backbone.model.layers)
        self.final_norm = model.backbone.model.norm

    # ------------------------------------------------------------------------------ one layer
    def _layer(
        self,
        layer: nn.Module,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: StaticKVCache,
        index: int,
        *,
        prefill_slots: torch.Tensor | None = None,
        write_pos: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        limit: torch.Tensor | None = None,
        length: int = 0,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = layer.self_attn
        B, M, _ = h.shape
        d = attn.head_dim
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(B, M, -1, d)
        k = attn.k_proj(x).view(B, M, -1, d)
        v = attn.v_proj(x).view(B, M, -1, d)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if prefill_slots is not None:
            cache.write_prefix(index, prefill_slots, k, v)
            o = causal_attention(q, k, v, attn.scaling)
        else:
            cache.write(index, write_pos, k, v, slots)
            o = cache.attend(index, q, positions, limit, length, attn.scaling, slots)
        h = h + attn.o_proj(o)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    # ------------------------------------------------------------------------------ backbone
    def backbone_prefill(self, ids_BM: torch.Tensor, slots_B: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """h⁰ [B, M, H] (after the final norm) of right-padded prompts at positions 0..M-1,
        writing their keys and values to slots ``slots_B``."""
        B, M = ids_BM.shape
        h = self.model.embed_tokens(ids_BM)
        pos = torch.arange(M, device=ids_BM.device).expand(B, M)
        cos, sin = self.model.rotary_emb(h, pos)
        for i, layer in enumerate(self.layers):
            h = self._layer(layer, h, cos, sin, cache, i, prefill_slots=slots_B)
        return self.final_norm(h)

    def backbone_decode(
        self, ids_BQ: torch.Tensor, positions_BQ: torch.Tensor, cache: StaticKVCache, length: int
    ) -> torch.Tensor:
        """h⁰ [B, Q, H] of Q new tokens per slot 0..B-1 (causal among them and over the cache)."""
        h = self.model.embed_tokens(ids_BQ)
        cos, sin = self.model.rotary_emb(h, positions_BQ)
        for i, layer in enumerate(self.layers):
            h = self._layer(
                layer, h, cos, sin, cache, i,
                write_pos=positions_BQ, positions=positions_BQ, limit=positions_BQ, length=length,
            )  # fmt: skip
        return self.final_norm(h)

    # ------------------------------------------------------------------------------ MTP
    def _mtp_input(self, depth: int, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        enorm, hnorm, fc, _, _ = mtp_parts(self.model, depth)
        return fc(torch.cat([enorm(embeds), hnorm(hidden)], dim=-1))

    def mtp_prefill(
        self, depth: int, embeds_BMH: torch.Tensor, hidden_BMH: torch.Tensor, slots_B: torch.Tensor, cache: StaticKVCache
    ) -> torch.Tensor:
        """h^k [B, M, H] at positions 0..M-1 (valid entries must be a prefix of each row)."""
        _, _, _, layer, norm = mtp_parts(self.model, depth)
        x = self._mtp_input(depth, embeds_BMH, hidden_BMH)
        B, M, _ = x.shape
        cos, sin = self.model.rotary_emb(x, torch.arange(M, device=x.device).expand(B, M))
        return norm(self._layer(layer, x, cos, sin, cache, depth - 1, prefill_slots=slots_B))

    def mtp_decode(
        self,
        depth: int,
        embeds_BQH: torch.Tensor,
        hidden_BQH: torch.Tensor,
        positions_BQ: torch.Tensor,
        write_pos_BQ: torch.Tensor,
        limit_BQ: torch.Tensor,
        cache: StaticKVCache,
        length: int,
        slots_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h^k [B, Q, H] of entries at ``positions_BQ`` (>= 0), written at ``write_pos_BQ``,
        reading cache indices <= ``limit_BQ`` and their own; rows are slots 0..B-1 or ``slots_B``."""
        _, _, _, layer, norm = mtp_parts(self.model, depth)
        x = self._mtp_input(depth, embeds_BQH, hidden_BQH)
        cos, sin = self.model.rotary_emb(x, positions_BQ)
        h = self._layer(
            layer, x, cos, sin, cache, depth - 1,
            write_pos=write_pos_BQ, positions=write_pos_BQ, limit=limit_BQ, length=length, slots=slots_B,
        )  # fmt: skip
        return norm(h)
