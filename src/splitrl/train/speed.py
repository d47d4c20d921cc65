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
    checkpointing: bool | None = None,
) -> None:
    """Apply the switches to ``model`` in place (parameter names and values are unchanged).

    Args:
        checkpointing: activation checkpointing as decided by the memory planner
            (:mod:`splitrl.train.memory_plan`, which resolves ``activation_checkpointing: auto``);
            None: the config's setting, ``auto`` read as off.
    """
    set_fused_kernels(config.fused_head_kernels)
    if hasattr(model, "packed_attention"):
        model.packed_attention = config.packed_attention
    if checkpointing is None:
        checkpointing = config.activation_checkpointing is True
    set_activation_checkpointing(model, checkpointing)
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
