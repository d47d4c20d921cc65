"""Configuration of the losses; no torch import, so a run config validates before torch loads.

Each loss has two forms of its options: the trainer's (:class:`GRPOLossConfig`: every value
fixed) and the run's ``loss:`` section (:class:`RunGRPOLossConfig`: the settings a run derives
from its other sections may be left open). Which loss a run trains is its ``kind``
(:mod:`splitrl.loss.registry`).
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LossType(str, Enum):
    """Denominator of the gradient: global valid tokens N_t or global valid samples N_s."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class GRPOLossConfig(BaseModel):
    """Options of :class:`~splitrl.loss.grpo.ClippedPGLoss` (formulas: that module's docstring).

    Attributes:
        kind: the loss, ``grpo`` (also when a run's ``loss`` section names none; the kinds:
            :mod:`splitrl.loss.registry`).
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
            :class:`RunGRPOLossConfig`).
        recompute_prev_logprobs: prev logprobs are the trainer's at the step's start (else the
            rollout engine's).
        entropy_coef: α, weight of the entropy bonus.
        temperature: the T of the distribution the tokens were sampled from (logprobs are of
            logits / T); it must be the sampler's, and a run derives it from ``rollout.temperature``.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["grpo"] = "grpo"
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


class RunLossOptions:
    """Mixin of a run's ``loss`` section class: the loss's options with ``temperature`` left open
    (None: ``rollout.temperature``); :meth:`trainer_options` fills in what the run derives."""

    def trainer_options(self, *, temperature: float, max_staleness: int) -> dict[str, Any]:
        """The trainer's options as data (validated by the loss's own config class).

        Args:
            temperature: the run's ``rollout.temperature``.
            max_staleness: the run's ``buffer.max_staleness``.
        """
        return {**self.model_dump(), "temperature": temperature}


# the truncated importance-sampling cap a run uses when max_staleness > 0 and loss.tis_cap is
# left at "auto" (the value decoupled-PPO / TIS setups commonly use)
DEFAULT_TIS_CAP = 2.0


class RunGRPOLossConfig(GRPOLossConfig, RunLossOptions):
    """The run's ``loss`` section of ``kind: grpo``: :class:`GRPOLossConfig`, with two settings that
    depend on the rest of the run derived from it unless given (:meth:`trainer_options` resolves
    them; the section itself keeps what the user wrote).

    Attributes:
        temperature: ``null`` (default): ``rollout.temperature`` — the one source of truth of the
            sampling temperature (DESIGN §5), so the trainer scores tokens at the temperature
            they were sampled at. A value that differs from ``rollout.temperature`` is refused on
            load. (Top-k / top-p change which tokens are drawn, not their logprobs, so they have
            no trainer-side counterpart.)
        tis_cap: ``auto`` (default): truncated importance weights min(exp(prev − gen), C) with
            C = ``DEFAULT_TIS_CAP`` when ``buffer.max_staleness > 0`` (stale samples are then
            corrected, as in decoupled PPO), off when it is 0. A number: on, with that cap.
            ``null``: off — with ``max_staleness > 0`` the run warns that stale samples are
            trained as if on-policy.
    """

    temperature: float | None = Field(None, gt=0.0)
    tis_cap: Annotated[float, Field(gt=0.0)] | Literal["auto"] | None = "auto"

    def resolved_tis_cap(self, max_staleness: int) -> float | None:
        """The cap the trainer uses at this ``buffer.max_staleness`` (None: no correction)."""
        if self.tis_cap == "auto":
            return DEFAULT_TIS_CAP if max_staleness > 0 else None
        return self.tis_cap

    def trainer_options(self, *, temperature: float, max_staleness: int) -> dict[str, Any]:
        data = super().trainer_options(temperature=temperature, max_staleness=max_staleness)
        return {**data, "tis_cap": self.resolved_tis_cap(max_staleness)}
