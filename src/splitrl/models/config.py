"""Configuration of the policy model: backbone, MTP heads (DESIGN.md §3) and capabilities."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SUPPORTED_FAMILIES = ("qwen3", "llama")


class ModelCapabilities(BaseModel):
    """What a model does itself instead of the microbatch builder (DESIGN.md §3).

    Attributes:
        owns_sequence_packing: the model takes unpacked, padded samples and packs them itself.
        owns_mtp_loss_mask_packing: the model also packs the MTP loss mask (needs the above).
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
        mtp_use_repeated_layer: one MTP layer applied D times instead of D layers.
        mtp_detach_heads: the MTP branch reads detached backbone tensors, so MTP parameters get only
            MTP gradients and the backbone only main-loss gradients.
    """

    model_config = ConfigDict(extra="forbid")

    mtp_num_layers: int = Field(0, ge=0, description="D; 0 disables MTP entirely")
    mtp_loss_scaling_factor: float = Field(0.1, ge=0.0, description="lambda; each depth weighs lambda/D")
    mtp_use_repeated_layer: bool = False
    mtp_detach_heads: bool = True


class ModelConfig(BaseModel):
    """How to build the policy: from a local Hugging Face directory, or from a backbone config.

    Attributes:
        pretrained_path: local directory written by ``save_pretrained`` (ours or stock Hugging
            Face); when set, ``family`` and ``backbone`` are ignored and read from the directory.
        family: backbone family for random init (``qwen3`` or ``llama``).
        backbone: keyword arguments of the family's transformers config (hidden_size,
            num_hidden_layers, ...). The default is a tiny model that trains in seconds on CPU.
        attn_implementation: ``sdpa`` (default) or ``eager``.
        seed: seed of the random init.
    """

    model_config = ConfigDict(extra="forbid")

    pretrained_path: str | None = None
    family: Literal["qwen3", "llama"] = "qwen3"
    backbone: dict[str, Any] = Field(default_factory=lambda: dict(TINY_BACKBONE))
    mtp: MTPConfig = Field(default_factory=MTPConfig)
    capabilities: ModelCapabilities = Field(default_factory=ModelCapabilities)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    seed: int = 0


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
