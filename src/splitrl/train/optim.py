"""Optimizer, LR schedule and the fp16 loss scaler of the train worker."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class OptimConfig(BaseModel):
    """AdamW, warmup + constant/cosine schedule, gradient clipping.

    Attributes:
        lr: peak learning rate of the policy parameters.
        mtp_lr: peak learning rate of the MTP parameters (default: ``lr``).
        weight_decay: AdamW decay of matrices (norm weights and biases are not decayed).
        warmup_steps: linear warmup from lr/warmup_steps to lr.
        schedule: ``constant`` after warmup, or ``cosine`` decay to ``min_lr_ratio``·lr at
            ``total_steps`` (required for cosine; a run config fills in its ``num_steps``
            before this config validates).
        max_grad_norm: clip of the policy gradient norm (None: no clipping).
        mtp_max_grad_norm: clip of the MTP group with detached heads (None: same as
            ``max_grad_norm``; ``inf`` to disable for MTP only).
    """

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-5, gt=0.0)
    mtp_lr: float | None = Field(None, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int | None = Field(None, ge=1)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    mtp_max_grad_norm: float | None = Field(None, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> "OptimConfig":
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("schedule='cosine' needs total_steps (the step at which the decay ends)")
        return self

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak LR at optimizer step ``step`` (0-indexed)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    main_params: list[tuple[str, torch.nn.Parameter]],
    mtp_params: list[tuple[str, torch.nn.Parameter]],
    config: OptimConfig,
    fused: bool = False,
) -> torch.optim.AdamW:
    """AdamW with groups ``main``/``mtp`` × decay/no-decay (matrices decay; norms, biases don't)."""
    groups = []
    for name, params, lr in (("main", main_params, config.lr), ("mtp", mtp_params, config.mtp_lr or config.lr)):
        decay = [p for _, p in params if p.ndim >= 2]
        no_decay = [p for _, p in params if p.ndim < 2]
        if decay:
            groups.append({"params": decay, "lr": lr, "weight_decay": config.weight_decay, "name": name})
        if no_decay:
            groups.append({"params": no_decay, "lr": lr, "weight_decay": 0.0, "name": name})
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=fused or None)


class DynamicLossScaler:
    """fp16 dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training", §3.2).

    The loss is multiplied by ``scale`` before backward; finish unscales as part of its single
    gradient scaling. A non-finite gradient skips the step and multiplies the scale by
    ``backoff_factor``; ``growth_interval`` finite steps in a row multiply it by ``growth_factor``.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0

    def update(self, found_nonfinite: bool) -> None:
        if found_nonfinite:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
