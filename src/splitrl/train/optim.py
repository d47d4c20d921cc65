"""Optimizer, LR schedule and the fp16 loss scaler of the train worker."""

from __future__ import annotations

import torch

from splitrl.train.config import OptimConfig  # noqa: F401 - defined there, torch-free


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
