"""Configuration of the losses; no torch import, so a run config validates before torch loads."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LossType(str, Enum):
    """Denominator of the gradient: global valid tokens N_t or global valid samples N_s."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class GRPOLossConfig(BaseModel):
    """Options of :class:`~splitrl.loss.grpo.ClippedPGLoss` (formulas: that module's docstring).

    Attributes:
        loss_type: ``token_level`` (Σ over tokens / N_t, DAPO-style) or ``sequence_level`` (mean
            per sample, then Σ / N_s).
        clip_eps_low: ε_low, the ratio is clipped below at 1 − ε_low.
        clip_eps_high: ε_high, the ratio is clipped above at 1 + ε_high (> ε_low: DAPO clip-higher).
        dual_clip_c: c > 1 enables dual clip for negative advantages (None: off).
        ratio_level: ``token`` ratios (PPO) or one ``sequence`` ratio per sample (GSPO).
        kl_coef: β, weight of the KL to the reference policy (0: no reference model is run).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (Schulman 2020).
        tis_cap: truncated importance-sampling cap C on exp(prev − gen); None disables the correction
            (a run turns it on by default when samples can be stale, see
            ``splitrl.config.RunLossConfig``).
        recompute_prev_logprobs: prev logprobs are the trainer's at the step's start (else the
            rollout engine's).
        entropy_coef: α, weight of the entropy bonus.
        temperature: the T of the distribution the tokens were sampled from (logprobs are of
            logits / T); it must be the sampler's, and a run derives it from ``rollout.temperature``.
    """

    model_config = ConfigDict(extra="forbid")

    loss_type: LossType = LossType.TOKEN_LEVEL
    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_eps_high: float = Field(0.2, ge=0.0)
    dual_clip_c: float | None = Field(None, description="c > 1 enables dual clip for negative advantages")
    ratio_level: Literal["token", "sequence"] = "token"
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    tis_cap: float | None = Field(None, gt=0.0, description="truncated IS cap C; None disables the correction")
    recompute_prev_logprobs: bool = True
    entropy_coef: float = Field(0.0, ge=0.0)
    temperature: float = Field(1.0, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> "GRPOLossConfig":
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (got {self.dual_clip_c}); use None to disable dual clip")
        return self
