"""The MTP block (DESIGN.md §3), wired as the Qwen3-Next / DeepSeek-V3 drafters are.

Legend: B = rows, S = positions, H = hidden size.

Depth k (1-indexed) at position t:
    u_t   = concat[enorm(Emb(x_{t+k})), hnorm(h^{k-1}_t)]      (embedding first)
    h^k_t = norm(layer_k(fc(u_t)))                              (fc = eh_proj, bias-free [2H -> H])

Parameter names follow Qwen3-Next: ``pre_fc_norm_embedding`` (enorm), ``pre_fc_norm_hidden``
(hnorm), ``fc`` (eh_proj), ``layers.{i}``, ``norm``. As in Qwen3-Next, the two input norms, ``fc``
and the final ``norm`` are shared by the depths; each depth has its own decoder layer, or all depths
apply ``layers.0`` when ``mtp_use_repeated_layer`` is set (stored once).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig


def mtp_layer_config(backbone_config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    """Copy of the backbone config for the MTP decoder layers: ``num_layers`` full-attention layers.

    The MTP layers use full attention even on hybrid / sliding-window backbones (DESIGN §3), and
    their layer indices count from 0 so that they index a KV cache of their own.
    """
    cfg = copy.deepcopy(backbone_config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * num_layers
    return cfg


class MTPBlock(nn.Module):
    """D MTP depths on top of a Hugging Face decoder backbone.

    Args:
        backbone_config: the backbone's transformers config (hidden size, eps, attention ...).
        num_depths: D >= 1.
        repeated: apply one decoder layer D times instead of D layers.
        layer_cls: the backbone's decoder-layer class (e.g. ``Qwen3DecoderLayer``).
        norm_cls: the backbone's RMSNorm class (so norm weights keep the family's convention).
    """

    def __init__(
        self,
        backbone_config: PretrainedConfig,
        num_depths: int,
        repeated: bool,
        layer_cls: type[nn.Module],
        norm_cls: type[nn.Module],
    ) -> None:
        super().__init__()
        if num_depths < 1:
            raise ValueError(f"MTPBlock needs num_depths >= 1, got {num_depths}")
        hidden = backbone_config.hidden_size
        eps = backbone_config.rms_norm_eps
        self.num_depths = num_depths
        self.repeated = repeated
        num_layers = 1 if repeated else num_depths
        self.layer_config = mtp_layer_config(backbone_config, num_layers)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([layer_cls(self.layer_config, i) for i in range(num_layers)])
        self.norm = norm_cls(hidden, eps=eps)

    def layer_for_depth(self, depth: int) -> nn.Module:
        """Decoder layer of depth ``depth`` (1-indexed)."""
        return self.layers[0 if self.repeated else depth - 1]

    def depth_forward(
        self,
        depth: int,
        embeds_BSH: torch.Tensor,
        hidden_BSH: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor,
        past_key_values=None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """h^k from Emb(x_{t+k}) [B, S, H] and h^{k-1} [B, S, H]; returns [B, S, H].

        ``attention_mask`` is what the backbone's layers take (a 4D mask, or None for plain causal);
        ``past_key_values`` is a cache owned by this depth (its layer index is the layer's own).
        """
        u = torch.cat([self.pre_fc_norm_embedding(embeds_BSH), self.pre_fc_norm_hidden(hidden_BSH)], dim=-1)
        x = self.fc(u)
        x = self.layer_for_depth(depth)(
            x,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        if isinstance(x, tuple):  # older decoder layers return (hidden, ...)
            x = x[0]
        return self.norm(x)
