"""Speed and memory switches of the train worker: compiled decoder layers, activation checkpointing.

Neither changes what a step computes: activation checkpointing recomputes each decoder layer's
forward in the backward (same kernels, same inputs), and a compiled layer fuses the elementwise
work around the matrix products (RMSNorm, rotary embedding, SwiGLU), which can round differently
in the last bf16 bit but is the same function. The CPU tests run with both off.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from splitrl.compile_lock import serialized
from splitrl.models.head import set_fused_kernels
from splitrl.train.config import SpeedConfig


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every Hugging Face decoder layer of the policy (backbone and MTP depths)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def apply_speed_config(
    model: nn.Module,
    config: SpeedConfig,
    device: torch.device,
    distributed: bool = False,
    tokens_per_microbatch: int | None = None,
) -> None:
    """Apply the switches to ``model`` in place (parameter names and values are unchanged);
    ``tokens_per_microbatch`` (the microbatch token budget) decides ``activation_checkpointing: auto``."""
    set_fused_kernels(config.fused_head_kernels)
    if hasattr(model, "packed_attention"):
        model.packed_attention = config.packed_attention
    set_activation_checkpointing(model, config.checkpointing_for(device.type, tokens_per_microbatch))
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
        # the instance's forward, compiled: hooks and activation checkpointing stay outside it;
        # serialized because a rollout engine may compile on another thread of this process
        layer.forward = serialized(torch.compile(layer.forward, dynamic=None))
