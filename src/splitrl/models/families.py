"""The backbone families splitrl builds: one entry per family, read by everything that differs by family.

Adding a family is an entry in ``FAMILIES`` (and its tests): ``ModelConfig.family``'s choices, the
policy's random init and its load check, the checkpoint check, the run's preflight, the GGUF
converter and the rollout engine's decoder forward all read this table, and nothing else in
splitrl names a family.

What a family must be for an entry to suffice: a transformers ``*ForCausalLM`` whose decoder
layers are input RMSNorm → q/k/v projections (optionally biased) → optional per-head q/k RMSNorm
→ rotary embedding (rotate-half) → attention → o_proj → residual → post-attention
RMSNorm → MLP (SwiGLU, or a routed MoE block with its own forward) → residual, with RMSNorms of
the ``weight · x̂`` convention and full attention in every layer. That is the op sequence the
rollout engine reproduces (:mod:`splitrl.rollout.forward`) and the layer the MTP depths reuse
(:mod:`splitrl.models.mtp`). A family that differs anywhere else (a ``(1 + weight)`` norm, a
norm after each sublayer (sandwich norms), sliding-window layers, ...) needs code there, not only an
entry here.

This module imports neither torch nor transformers (``splitrl.models.config`` reads it at import):
a family names its transformers config class, resolved on use by :meth:`Family.config_class`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

# the integer sizes of a dense decoder (Family.size_keys): each must be >= 1
DENSE_SIZE_KEYS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
# and of a routed mixture of experts (decoder_sparse_step: every how many layers one is MoE)
MOE_SIZE_KEYS: tuple[str, ...] = (
    *DENSE_SIZE_KEYS,
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
)


@dataclass(frozen=True, kw_only=True)
class Family:
    """What splitrl needs to know about one backbone family.

    Attributes:
        name: transformers' ``model_type`` (the value of ``model.family`` and of a checkpoint's
            ``config.json``).
        config_class_name: the family's transformers config class (``transformers.<name>``).
        qk_norm: attention normalizes each query and key head (RMSNorm modules ``q_norm`` /
            ``k_norm`` of the attention) before the rotary embedding (Qwen3, Qwen3-MoE).
        qkv_bias: the q/k/v projections carry biases (Qwen2); the rollout engine fuses them with
            the weights (:func:`splitrl.rollout.forward.fuse_projections`).
        moe: the MLP of (some) layers is a routed mixture of experts whose router load-balancing
            loss enters the train step (:mod:`splitrl.models.moe`, transformers' Qwen3-MoE loss).
        backbone_defaults: keys merged under ``ModelConfig.backbone`` where it lacks them (the
            tiny MoE preset: transformers' defaults are 128 experts).
        undeclared_config_keys: keys the config class does not declare but the family's modules
            read when the config has them (``head_dim``); the preflight accepts them in
            ``model.backbone``.
        config_aliases: the config class's ``attribute_map`` (a key → the name it is stored
            under: ``num_experts`` → ``num_local_experts``), so that a default of
            ``backbone_defaults`` is not added where the backbone gives its other name.
        size_keys: the config's integer sizes (widths, counts of layers, heads and experts): each
            must be >= 1 where the config sets it (None: transformers derives it, e.g. llama's
            ``head_dim``); checked by :mod:`splitrl.models.backbone_checks`. A 0 or a negative
            size failed only inside a worker, or trained on nothing.
        gguf_architecture: the GGUF ``general.architecture`` converted to this family
            (:mod:`splitrl.models.gguf`); None: GGUF files of it are refused.
    """

    name: str
    config_class_name: str
    qk_norm: bool = False
    qkv_bias: bool = False
    moe: bool = False
    backbone_defaults: Mapping[str, Any] = field(default_factory=dict)
    undeclared_config_keys: tuple[str, ...] = ()
    config_aliases: Mapping[str, str] = field(default_factory=dict)
    size_keys: tuple[str, ...] = DENSE_SIZE_KEYS
    gguf_architecture: str | None = None

    def config_class(self) -> type:
        """The transformers config class (imports transformers)."""
        import transformers

        return getattr(transformers, self.config_class_name)


# MoE keys of the tiny qwen3_moe preset (merged under ModelConfig.backbone when missing there)
TINY_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.01,
}

_ENTRIES = (
    Family(name="qwen3", config_class_name="Qwen3Config", qk_norm=True, gguf_architecture="qwen3"),
    Family(name="llama", config_class_name="LlamaConfig", gguf_architecture="llama"),
    Family(
        name="qwen3_moe",
        config_class_name="Qwen3MoeConfig",
        qk_norm=True,
        moe=True,
        backbone_defaults=TINY_MOE,
        undeclared_config_keys=("head_dim",),
        config_aliases={"num_experts": "num_local_experts"},
        size_keys=MOE_SIZE_KEYS,
    ),
    Family(
        name="qwen2",
        config_class_name="Qwen2Config",
        qkv_bias=True,
        undeclared_config_keys=("head_dim",),
        gguf_architecture="qwen2",
    ),
)

FAMILIES: Mapping[str, Family] = MappingProxyType({f.name: f for f in _ENTRIES})
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(FAMILIES)
# ``ModelConfig.family``'s type: the names above (a Literal, so config help lists them)
FamilyName = Literal[SUPPORTED_FAMILIES]  # type: ignore[valid-type]
# GGUF architectures the converter reads (sorted)
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(sorted(f.gguf_architecture for f in _ENTRIES if f.gguf_architecture))


def get_family(name: str | None, *, what: str = "backbone family") -> Family:
    """The registry entry of ``name`` (a ``model_type``).

    Raises:
        ValueError: ``name`` is not a supported family; the message lists those that are.
    """
    found = FAMILIES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(
            f"{what} {name!r} is not supported; use one of {', '.join(SUPPORTED_FAMILIES)} "
            "(their decoder layers and RMSNorm are reused by the MTP heads and the rollout engine)"
        )
    return found


def other_names(aliases: Mapping[str, str], key: str) -> list[str]:
    """``key``'s other names in an ``attribute_map`` (a config class's, or ``Family.config_aliases``),
    either way round: ``num_experts`` ↔ ``num_local_experts``."""
    return [v for a, v in aliases.items() if a == key] + [a for a, v in aliases.items() if v == key]


def missing_defaults(family: Family, backbone: Mapping[str, Any]) -> dict[str, Any]:
    """The family's ``backbone_defaults`` that ``backbone`` gives under neither name (see
    ``Family.config_aliases``)."""
    return {
        k: v
        for k, v in family.backbone_defaults.items()
        if k not in backbone and not any(n in backbone for n in other_names(family.config_aliases, k))
    }


def family_of(hf_config: Any) -> Family:
    """The entry of a transformers config (its ``model_type``); ValueError as :func:`get_family`."""
    return get_family(getattr(hf_config, "model_type", None))
