"""The MTP block (DESIGN.md §3), wired as the Qwen3-Next / DeepSeek-V3 drafters are.

Legend: B = rows, S = positions, H = hidden size.

Depth k (1-indexed) at position t:
    u_t   = concat[enorm_k(Emb(x_{t+k})), hnorm_k(h^{k-1}_t)]      (embedding first)
    h^k_t = norm_k(layer_k(fc_k(u_t)))                              (fc = eh_proj, bias-free [2H -> H])

Every depth owns its two input norms, ``fc``, decoder layer and final norm (Megatron-Core and
DeepSeek-V3 semantics). With ``mtp_use_repeated_layer`` the whole depth module is one, applied D
times (stored once).

In memory a depth module is ``depths.{i}`` with ``pre_fc_norm_embedding`` (enorm),
``pre_fc_norm_hidden`` (hnorm), ``fc`` (eh_proj), ``layer`` and ``norm``. Checkpoint names are
Qwen3-Next's, chosen by the number M of stored depth modules (M = 1 when D = 1 or the layer is
repeated, else D) — see :func:`mtp_checkpoint_names`:

    M = 1   mtp.pre_fc_norm_embedding  mtp.pre_fc_norm_hidden  mtp.fc  mtp.layers.0.*  mtp.norm
            (exactly Qwen3-Next's MTP layout)
    M > 1   mtp.layers.{i}.pre_fc_norm_embedding  mtp.layers.{i}.pre_fc_norm_hidden
            mtp.layers.{i}.fc  mtp.layers.{i}.*  mtp.layers.{i}.norm        (i = 0 .. M-1)

For M > 1 the depth index is Qwen3-Next's own layer index: an engine that reads Qwen3-Next already
builds one ``mtp.layers.{i}`` per draft step, and with per-depth modules each of those layers also
owns its projection and norms, next to its attention and MLP tensors — the way DeepSeek-V3, GLM-4.5
and MiMo store a per-depth MTP module under one layer index. The decoder layer's own tensors
(``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``) never collide with the
four depth tensors; the block checks this when it is built.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn
from transformers import PretrainedConfig

# the per-depth tensors that are not part of the decoder layer (in-memory and checkpoint names agree)
DEPTH_EXTRAS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")


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


class MTPDepth(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj (``fc``), one decoder layer of the backbone's family,
    final norm.

    Args:
        layer_config: config of the MTP decoder layers (:func:`mtp_layer_config`).
        layer_idx: the decoder layer's index (its slot in a KV cache).
        layer_cls: the backbone's decoder-layer class (e.g. ``Qwen3DecoderLayer``).
        norm_cls: the backbone's RMSNorm class (so norm weights keep the family's convention).
    """

    def __init__(
        self, layer_config: PretrainedConfig, layer_idx: int, layer_cls: type[nn.Module], norm_cls: type[nn.Module]
    ) -> None:
        super().__init__()
        hidden = layer_config.hidden_size
        eps = layer_config.rms_norm_eps
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer_cls(layer_config, layer_idx)
        self.norm = norm_cls(hidden, eps=eps)

    def forward(
        self,
        embeds_BSH: torch.Tensor,
        hidden_BSH: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor,
        past_key_values=None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """h^k [B, S, H] from Emb(x_{t+k}) [B, S, H] and h^{k-1} [B, S, H] (see :meth:`MTPBlock.depth_forward`)."""
        u = torch.cat([self.pre_fc_norm_embedding(embeds_BSH), self.pre_fc_norm_hidden(hidden_BSH)], dim=-1)
        x = self.layer(
            self.fc(u),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        if isinstance(x, tuple):  # older decoder layers return (hidden, ...)
            x = x[0]
        return self.norm(x)


class MTPBlock(nn.Module):
    """D MTP depths on top of a Hugging Face decoder backbone.

    Args:
        backbone_config: the backbone's transformers config (hidden size, eps, attention ...).
        num_depths: D >= 1.
        repeated: one depth module applied D times instead of D modules.
        layer_cls: the backbone's decoder-layer class (e.g. ``Qwen3DecoderLayer``).
        norm_cls: the backbone's RMSNorm class (so norm weights keep the family's convention).

    Raises:
        ValueError: ``num_depths < 1``, or the family's decoder layer has a tensor whose name is
            one of the depth tensors (the M > 1 checkpoint names would collide).
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
        self.num_depths = num_depths
        self.repeated = repeated
        num_modules = 1 if repeated else num_depths
        self.layer_config = mtp_layer_config(backbone_config, num_modules)
        # depth k's decoder layer keeps index k-1 (0 when repeated): the rollout drafter gives
        # every depth a cache of its own and the layer writes its slot of it
        self.depths = nn.ModuleList(
            [MTPDepth(self.layer_config, i, layer_cls, norm_cls) for i in range(num_modules)]
        )
        clash = {n.split(".")[0] for n, _ in self.depths[0].layer.named_parameters()} & set(DEPTH_EXTRAS)
        if clash:
            raise ValueError(
                f"{layer_cls.__name__} has tensors named {sorted(clash)}, which collide with the MTP depth "
                "tensors in the checkpoint layout; this family cannot carry MTP heads as is"
            )

    @property
    def num_modules(self) -> int:
        """M: depth modules stored (1 with a repeated layer, else D)."""
        return len(self.depths)

    def depth_module(self, depth: int) -> MTPDepth:
        """The module of depth ``depth`` (1-indexed; the same one for every depth when repeated)."""
        if not 1 <= depth <= self.num_depths:
            raise IndexError(f"MTP depth {depth} out of range 1..{self.num_depths}")
        return self.depths[0 if self.repeated else depth - 1]

    def layer_for_depth(self, depth: int) -> nn.Module:
        """Decoder layer of depth ``depth`` (1-indexed)."""
        return self.depth_module(depth).layer

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
        return self.depth_module(depth)(
            embeds_BSH,
            hidden_BSH,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )


# ------------------------------------------------------------------------------ checkpoint names
_IN_MEMORY = re.compile(r"^depths\.(\d+)\.(.+)$")
_PER_DEPTH = re.compile(r"^layers\.(\d+)\.(.+)$")


def mtp_checkpoint_names(block_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory MTP names (``depths.{i}.*``, no ``mtp.`` prefix) to checkpoint names (module
    docstring: Qwen3-Next's when M = 1, indexed by depth under ``layers.{i}.`` when M > 1).

    M is read off the names, so this also serves a full state dict gathered from FSDP2 shards.
    """
    parsed = {}
    for name, t in block_sd.items():
        m = _IN_MEMORY.match(name)
        if m is None:
            raise ValueError(f"{name!r} is not an MTP depth tensor (expected depths.<i>.<name>)")
        parsed[name] = (int(m.group(1)), m.group(2), t)
    num_modules = 1 + max((i for i, _, _ in parsed.values()), default=-1)
    out = {}
    for i, rest, t in parsed.values():
        head, _, tail = rest.partition(".")
        if head == "layer":
            out[f"layers.{i}.{tail}"] = t
        elif num_modules == 1:
            out[rest] = t
        else:
            out[f"layers.{i}.{rest}"] = t
    return out


def mtp_state_from_checkpoint(stored: dict[str, torch.Tensor], num_modules: int) -> tuple[dict[str, torch.Tensor], str]:
    """Checkpoint MTP tensors (``mtp.`` prefix stripped) to in-memory names for M = ``num_modules``.

    Three layouts are recognized:

    - ``per_depth`` (M > 1): ``layers.{i}.{fc, pre_fc_norm_*, norm, <decoder layer>}``.
    - ``qwen3_next`` with one stored layer: ``fc``, ``pre_fc_norm_*``, ``norm``, ``layers.0.*``
      (Qwen3-Next's layout, and ours for M = 1).
    - ``shared`` (splitrl before 2026-11-30, and Qwen3-Next directories with
      ``mtp_num_hidden_layers`` > 1): top-level ``fc``, ``pre_fc_norm_*``, ``norm`` shared by
      the depths, ``layers.{i}.*`` per depth. Converted exactly: the shared tensors are copied into
      every depth module, so the loaded model computes the same function as the saved one (the
      copies then train apart).

    Values are passed through (tensors are cloned where copied), so a name → shape map works too.

    Returns:
        (in-memory tensors ``depths.{i}.*``, the layout's name). Tensors whose count does not fit
        ``num_modules`` are mapped as found; the caller compares names and reports the mismatch.
    """
    top = {k: v for k, v in stored.items() if k.split(".")[0] in DEPTH_EXTRAS}
    out: dict[str, torch.Tensor] = {}
    if not top:  # per-depth layout
        for name, t in stored.items():
            m = _PER_DEPTH.match(name)
            if m is None:
                out[name] = t  # unknown: left for the caller's name check
                continue
            i, rest = m.group(1), m.group(2)
            head = rest.split(".")[0]
            out[f"depths.{i}.{rest}" if head in DEPTH_EXTRAS else f"depths.{i}.layer.{rest}"] = t
        return out, "per_depth"
    layer_ids = sorted({int(m.group(1)) for k in stored if (m := _PER_DEPTH.match(k))})
    for name, t in stored.items():
        m = _PER_DEPTH.match(name)
        if m is not None:
            out[f"depths.{m.group(1)}.layer.{m.group(2)}"] = t
        elif name not in top:
            out[name] = t
    for i in layer_ids or [0]:
        for name, t in top.items():
            out[f"depths.{i}.{name}"] = t.clone() if isinstance(t, torch.Tensor) else t
    return out, "qwen3_next" if len(layer_ids) <= 1 else "shared"


# ------------------------------------------------------------------------------ warm start
WARM_STARTS = ("random", "last_layer", "last_layer_embedding", "last_layer_sum")


@torch.no_grad()
def warm_start_from_backbone(block: MTPBlock, backbone: nn.Module, mode: str) -> None:
    """Start every depth module from the backbone's own next-token computation (DESIGN §3).

    For each depth module: the decoder layer is a copy of the backbone's last decoder layer, the
    final norm a copy of the backbone's final norm (the output head reads what it was trained on),
    the two input norms are identities (weight 1), and ``fc`` [H, 2H] = [E | Hd] passes
    through

    - ``last_layer``: the hidden half (E = 0, Hd = I): the depth first computes the backbone's
      last layer again on h^{k-1};
    - ``last_layer_embedding``: the embedding half (E = I, Hd = 0);
    - ``last_layer_sum``: both (E = Hd = I).

    ``random`` leaves the block as initialized. Which one drafts best after the heads-only
    warm-up is measured in ``bench/bench_mtp_warmstart.py`` (results: ``bench/RESULTS.md``).

    Args:
        block: the MTP block (changed in place).
        backbone: the transformers ``*ForCausalLM`` it sits on.
        mode: one of ``WARM_STARTS``.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in WARM_STARTS:
        raise ValueError(f"unknown MTP warm start {mode!r}; use one of {WARM_STARTS}")
    if mode == "random":
        return
    inner = backbone.model
    last = inner.layers[-1].state_dict()
    for depth in block.depths:
        missing, unexpected = depth.layer.load_state_dict(last, strict=False)
        if missing or unexpected:  # same class and config: only a family quirk could cause this
            raise ValueError(f"cannot copy the backbone's last layer into an MTP depth: {missing or unexpected}")
        depth.norm.weight.copy_(inner.norm.weight)
        depth.pre_fc_norm_embedding.weight.fill_(1.0)
        depth.pre_fc_norm_hidden.weight.fill_(1.0)
        H = depth.fc.weight.shape[0]
        eye = torch.eye(H, dtype=depth.fc.weight.dtype, device=depth.fc.weight.device)
        depth.fc.weight.zero_()
        if mode in ("last_layer_embedding", "last_layer_sum"):
            depth.fc.weight[:, :H] = eye
        if mode in ("last_layer", "last_layer_sum"):
            depth.fc.weight[:, H:] = eye
