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
from splitrl.rollout.fused import Kernels
from splitrl.rollout.kv import AttentionPlan, StaticKVCache, causal_attention


def mtp_parts(model: PolicyModel, depth: int) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module, nn.Module]:
    """(enorm, hnorm, fc, decoder layer, final norm) of MTP depth ``depth`` (1-indexed)."""
    mtp = model.mtp
    assert mtp is not None
    d = mtp.depth_module(depth)  # each depth owns its norms, projection and layer (DESIGN §3)
    return d.pre_fc_norm_embedding, d.pre_fc_norm_hidden, d.fc, d.layer, d.norm


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

    def __init__(self, model: PolicyModel, compiled: bool = False):
        check_supported(model)
        self.model = model
        self.layers = list(model.backbone.model.layers)
        self.final_norm = model.backbone.model.norm
        self.k = Kernels(compiled, model.output_weight.device, model.output_weight.dtype)
        self.silu = model.config.hidden_act == "silu"

    def _norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.k.rms_norm(x, module.weight, module.variance_epsilon)

    # ------------------------------------------------------------------------------ one layer
    def _layer(
        self,
        layer: nn.Module,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: StaticKVCache,
        index: int,
        *,
        prefill_slots: torch.Tensor | None = None,
        plan: AttentionPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer on the residual stream h + delta (delta: the previous layer's MLP
        output, added here so that the add and this layer's input norm are one fused op).

        Returns (residual stream after attention, MLP output): the layer's output is their sum.
        """
        attn = layer.self_attn
        B, M, _ = h.shape
        d = attn.head_dim
        norm = layer.input_layernorm
        if delta is None:
            x = self.k.rms_norm(h, norm.weight, norm.variance_epsilon)
        else:
            h, x = self.k.add_rms_norm(delta, h, norm.weight, norm.variance_epsilon)
        q = attn.q_proj(x).view(B, M, -1, d)
        k = attn.k_proj(x).view(B, M, -1, d)
        v = attn.v_proj(x).view(B, M, -1, d)
        if hasattr(attn, "q_norm"):  # Qwen3
            eps = attn.q_norm.variance_epsilon
            q, k = self.k.qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, eps, cos, sin)
        else:
            q, k = self.k.qk_rope(q, k, cos, sin)
        if prefill_slots is not None:
            cache.write_prefix(index, prefill_slots, k, v)
            o = causal_attention(q, k, v, attn.scaling)
        else:
            cache.write(index, plan, k, v)
            o = cache.attend(index, q, plan, attn.scaling, self.k.masked_softmax)
        post = layer.post_attention_layernorm
        h, x = self.k.add_rms_norm(attn.o_proj(o), h, post.weight, post.variance_epsilon)
        mlp = layer.mlp
        if self.silu and hasattr(mlp, "down_proj"):  # dense SwiGLU; MoE blocks route in their own forward
            return h, mlp.down_proj(self.k.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        return h, mlp(x)

    def _stack(self, h, cos, sin, cache, **kw) -> torch.Tensor:
        """The backbone's layers, then its final norm."""
        delta = None
        for i, layer in enumerate(self.layers):
            h, delta = self._layer(layer, h, delta, cos, sin, cache, i, **kw)
        norm = self.final_norm
        return self.k.add_rms_norm(delta, h, norm.weight, norm.variance_epsilon)[1]

    # ------------------------------------------------------------------------------ backbone
    def backbone_prefill(self, ids_BM: torch.Tensor, slots_B: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """h⁰ [B, M, H] (after the final norm) of right-padded prompts at positions 0..M-1,
        writing their keys and values to slots ``slots_B``."""
        B, M = ids_BM.shape
        h = self.model.embed_tokens(ids_BM)
        pos = torch.arange(M, device=ids_BM.device).expand(B, M)
        cos, sin = self.model.rotary_emb(h, pos)
        return self._stack(h, cos, sin, cache, prefill_slots=slots_B)

    def backbone_decode(
        self, ids_BQ: torch.Tensor, positions_BQ: torch.Tensor, cache: StaticKVCache, length: int
    ) -> torch.Tensor:
        """h⁰ [B, Q, H] of Q new tokens per slot 0..B-1 (causal among them and over the cache)."""
        h = self.model.embed_tokens(ids_BQ)
        cos, sin = self.model.rotary_emb(h, positions_BQ)
        plan = cache.plan(positions_BQ, positions_BQ, positions_BQ, length)  # shared by all layers
        return self._stack(h, cos, sin, cache, plan=plan)

    # ------------------------------------------------------------------------------ MTP
    def _mtp_input(self, depth: int, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        enorm, hnorm, fc, _, _ = mtp_parts(self.model, depth)
        return fc(torch.cat([self._norm(enorm, embeds), self._norm(hnorm, hidden)], dim=-1))

    def mtp_prefill(
        self,
        depth: int,
        embeds_BMH: torch.Tensor,
        hidden_BMH: torch.Tensor,
        slots_B: torch.Tensor,
        cache: StaticKVCache,
    ) -> torch.Tensor:
        """h^k [B, M, H] at positions 0..M-1 (valid entries must be a prefix of each row)."""
        _, _, _, layer, norm = mtp_parts(self.model, depth)
        x = self._mtp_input(depth, embeds_BMH, hidden_BMH)
        B, M, _ = x.shape
        cos, sin = self.model.rotary_emb(x, torch.arange(M, device=x.device).expand(B, M))
        h, delta = self._layer(layer, x, None, cos, sin, cache, depth - 1, prefill_slots=slots_B)
        return self.k.add_rms_norm(delta, h, norm.weight, norm.variance_epsilon)[1]

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
        plan = cache.plan(write_pos_BQ, write_pos_BQ, limit_BQ, length, slots_B)
        h, delta = self._layer(layer, x, None, cos, sin, cache, depth - 1, plan=plan)
        return self.k.add_rms_norm(delta, h, norm.weight, norm.variance_epsilon)[1]
