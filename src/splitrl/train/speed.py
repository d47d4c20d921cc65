"""Speed and memory switches of the train worker: compiled decoder layers, activation checkpointing.

Neither changes what a step computes: activation checkpointing recomputes each decoder layer's
forward in the backward (same kernels, same inputs), and a compiled layer fuses the elementwise
work around the matrix products (RMSNorm, rotary embedding, SwiGLU), which can round differently
in the last bf16 bit but is the same function. The CPU tests run with both off.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from splitrl.loss.logprobs import set_fused_kernels


class SpeedConfig(BaseModel):
    """Switches of :func:`apply_speed_config` (defaults chosen by measurement on one H200, see README).

    Attributes:
        compile_layers: ``torch.compile`` each decoder layer (backbone and MTP) on one CUDA
            device (measured 1.58x the eager step, Qwen3-0.6B shape + 2 MTP depths, packed rows;
            the first steps pay the compilation). Not applied under FSDP2, where it was not measured.
        activation_checkpointing: recompute each decoder layer in the backward instead of
            keeping its activations (saves most activation memory for ~1/3 more layer compute).
        fused_head_kernels: compile the output head's per-chunk softmax statistics and gradient
            into fused kernels on CUDA (see ``splitrl.loss.logprobs``).
        packed_attention: packed rows on CUDA: ``flex`` (FlexAttention block mask), ``varlen``
            (flash variable-length kernel) or ``dense`` (an [S, S] mask, the CPU path).
        compute_weight_copy: bf16/fp16 on one process: compute on low-precision weight copies made
            once per step, fp32 masters and gradients (``splitrl.train.mixed_precision``); off:
            autocast re-casts the fp32 weights on every microbatch.
    """

    model_config = ConfigDict(extra="forbid")

    compile_layers: bool = True
    activation_checkpointing: bool = False
    fused_head_kernels: bool = True
    packed_attention: Literal["flex", "varlen", "dense"] = "flex"
    compute_weight_copy: bool = True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every Hugging Face decoder layer of the policy (backbone and MTP depths)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def apply_speed_config(model: nn.Module, config: SpeedConfig, device: torch.device, distributed: bool = False) -> None:
    """Apply the switches to ``model`` in place (parameter names and values are unchanged)."""
    set_fused_kernels(config.fused_head_kernels)
    if hasattr(model, "packed_attention"):
        model.packed_attention = config.packed_attention
    set_activation_checkpointing(model, config.activation_checkpointing)
    if config.compile_layers and device.type == "cuda" and not distributed:
        compile_layers(model)


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn per-decoder-layer activation checkpointing on or off (non-reentrant)."""
    if enabled:
        model.train()  # the layers checkpoint only in training mode
    for layer in decoder_layers(model):
        layer.gradient_checkpointing = enabled
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` every decoder layer in place (names and parameters unchanged)."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=None)
