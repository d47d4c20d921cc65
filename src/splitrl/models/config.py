"""Configuration of the policy model: backbone, MTP heads (DESIGN.md §3) and capabilities."""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitrl.config_types import UserPath
from splitrl.models.families import SUPPORTED_FAMILIES, TINY_MOE, FamilyName, get_family, missing_defaults

# SUPPORTED_FAMILIES and TINY_MOE live in the family registry; imported from here too
__all__ = [
    "SIZE_KEYS", "SUPPORTED_FAMILIES", "TINY_BACKBONE", "TINY_MOE", "ModelCapabilities", "ModelConfig", "MTPConfig",
    "fill_family_defaults",
]


class ModelCapabilities(BaseModel):
    """What a model does itself instead of the microbatch builder (DESIGN.md §3).

    Attributes:
        owns_sequence_packing: the model takes unpacked, padded samples and packs them itself.
        owns_mtp_loss_mask_packing: the model also packs the MTP loss mask (only together with
            owns_sequence_packing: a model that packs its samples packs their masks too).
        slices_context_parallel_inputs: the model takes packed, unsharded rows and shards them.

    These flags travel unchanged through the synchronous and the split path.

    Raises:
        ValueError: on the impossible combinations (validated on construction).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    owns_sequence_packing: bool = False
    owns_mtp_loss_mask_packing: bool = False
    slices_context_parallel_inputs: bool = False

    @model_validator(mode="after")
    def _check(self) -> "ModelCapabilities":
        if self.owns_mtp_loss_mask_packing and not self.owns_sequence_packing:
            raise ValueError(
                "owns_mtp_loss_mask_packing=True requires owns_sequence_packing=True: a model can only "
                "pack the MTP loss mask itself if it also packs the sequences. Set both, or neither."
            )
        if self.slices_context_parallel_inputs and self.owns_sequence_packing:
            raise ValueError(
                "slices_context_parallel_inputs=True cannot be combined with owns_sequence_packing=True: "
                "the builder hands context-parallel models packed rows, which a model that packs itself "
                "cannot take. Turn one of the two off."
            )
        return self


class MTPConfig(BaseModel):
    """Multi-Token Prediction heads (DESIGN.md §3 knobs).

    Attributes:
        mtp_num_layers: D, the number of depths; 0 disables MTP entirely.
        mtp_loss_scaling_factor: λ; each depth's loss weighs λ / D. 0 keeps the heads for metrics
            only (their parameters stay out of the optimizer).
        mtp_use_repeated_layer: one depth module (input norms, ``fc``, decoder layer, final
            norm) applied D times and stored once, instead of D depth modules.
        mtp_detach_heads: the MTP branch reads detached copies of the backbone's hidden state,
            embeddings and output head, so the backbone trains on the main loss only. With
            ``false`` the MTP loss also trains the backbone. Cost: with a ``SEQUENCE_LEVEL`` loss
            and λ > 0 the backbone gradient mixes 1/N_s (policy loss) and 1/N_t (MTP loss), which
            the train step keeps apart with a second backward pass per microbatch and one extra
            fp32 gradient buffer of the policy parameters (``splitrl.train.side_grads``); every other
            combination runs a single backward.
        mtp_objective: the per-position term of the MTP loss (DESIGN §3). ``ce`` (default):
            cross-entropy on the sampled target token (the seed system's, Megatron's).
            ``distill``: KL(p̄ ‖ q_k), p̄ the policy's own next-token distribution at the target
            position (main logits / T, detached), q_k the depth's at the same T (T = the rollout
            temperature), what speculative acceptance depends on. Same masks, N_t normalization,
            detach rule and loss scale either way; ``mtp/mtp_{k}_loss`` reports the chosen term.
            ``ce`` is the default because it drafted as well or better on SmolLM2-135M-Instruct
            (``bench/bench_mtp_warmstart.py``; figures in bench/RESULTS.md).
        mtp_init: how depths start when a checkpoint has no MTP weights (a random-init backbone
            always starts them at random). ``random`` (default, measured best in the same bench);
            ``last_layer``: each depth copies the backbone's last decoder layer and final norm and
            ``fc`` passes the hidden half through; ``last_layer_embedding`` / ``last_layer_sum``:
            ``fc`` passes the embedding half / both (:func:`splitrl.models.mtp.warm_start_from_backbone`).
    """

    model_config = ConfigDict(extra="forbid")

    mtp_num_layers: int = Field(0, ge=0, description="D; 0 disables MTP entirely")
    mtp_loss_scaling_factor: float = Field(0.1, ge=0.0, description="lambda; each depth weighs lambda/D")
    mtp_use_repeated_layer: bool = False
    mtp_detach_heads: bool = True
    mtp_objective: Literal["ce", "distill"] = "ce"
    mtp_init: Literal["random", "last_layer", "last_layer_embedding", "last_layer_sum"] = "random"


class ModelConfig(BaseModel):
    """How to build the policy: from a local Hugging Face directory, or from a backbone config.

    Attributes:
        pretrained_path: local directory written by ``save_pretrained`` (ours or stock Hugging
            Face); when set, ``family`` and ``backbone`` are ignored and read from the directory.
        family: backbone family for random init, a ``model_type`` of
            :data:`splitrl.models.families.FAMILIES`: ``qwen3``, ``llama``, ``qwen3_moe``
            (transformers' Qwen3-MoE; its router load-balancing loss enters the step with
            ``router_aux_loss_coef`` of the backbone config, see :mod:`splitrl.models.moe`) or
            ``qwen2`` (Qwen2 / Qwen2.5: q/k/v biases, no q/k norms).
        backbone: keyword arguments of the family's transformers config (hidden_size,
            num_hidden_layers, ...). The default is a tiny model that trains in seconds on CPU;
            a dict given here replaces it, and the keys it lacks come from transformers' full-size
            defaults (``PolicyModel.from_config`` refuses a model that those make > 10x larger
            and over 100 M parameters, see ``policy.check_defaulted_size``: give every key of
            ``SIZE_KEYS``);
            the family's ``backbone_defaults`` fill the keys it lacks before transformers' defaults
            do (``qwen3_moe``: ``TINY_MOE``, 4 experts, 2 per token, not 128); they are written
            into ``backbone`` on validation, so that the resolved config (``--print-config``,
            ``config.yaml``, ``run_config.json``) shows every key the model is built from.
        attn_implementation: ``sdpa`` (default) or ``eager``.
        seed: seed of the random init.
    """

    model_config = ConfigDict(extra="forbid")

    pretrained_path: UserPath | None = None
    family: FamilyName = "qwen3"
    backbone: dict[str, Any] = Field(default_factory=lambda: dict(TINY_BACKBONE))
    mtp: MTPConfig = Field(default_factory=MTPConfig)
    capabilities: ModelCapabilities = Field(default_factory=ModelCapabilities)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    seed: int = 0

    @model_validator(mode="after")
    def _family_defaults(self) -> "ModelConfig":
        if self.pretrained_path is None:  # the family's keys, shown where the model is built from them
            fill_family_defaults(self.backbone, self.family)  # validation made the dict: ours to change
        return self

    def backbone_kwargs(self) -> dict[str, Any]:
        """The keyword arguments the family's transformers config is built from: ``backbone``,
        over the family's ``backbone_defaults`` (``TINY_MOE`` for ``qwen3_moe``; already in
        ``backbone`` once validated)."""
        return {**self.backbone, **missing_defaults(get_family(self.family), self.backbone)}


def fill_family_defaults(backbone: dict[str, Any], family: str | None) -> dict[str, Any]:
    """Add the family's ``backbone_defaults`` that ``backbone`` lacks (under either name) to it,
    in place, after the keys given; returns it. Also brings a ``run_config.json`` written before
    they were added to what this release writes (``family`` None: the default family; one that is
    not supported: nothing is added)."""
    if family is None:
        family = ModelConfig.model_fields["family"].default
    if family in SUPPORTED_FAMILIES:
        backbone.update(copy.deepcopy(missing_defaults(get_family(family), backbone)))
    return backbone


# the keys that set a backbone's size: a backbone dict without them gets transformers' full-size
# defaults, and PolicyModel.from_config refuses it when those make it large (see check_defaulted_size)
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

TINY_BACKBONE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
