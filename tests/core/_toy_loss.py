"""A toy loss registered by the loss-registry tests: REINFORCE, −Σ_t A · logπ(x_t) · m_t · scale.

Torch-free at import (as a loss's options must be), so a subprocess can register it before
``splitrl.config`` is imported."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from splitrl.loss import LossType


class ToyLossConfig(BaseModel):
    """Options of :class:`ToyLoss`.

    Attributes:
        kind: ``toy``.
        scale: multiplies the loss.
        temperature: the sampler's T.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["toy"] = "toy"
    scale: float = Field(1.0, gt=0.0)
    temperature: float = Field(1.0, gt=0.0)


class ToyLoss:
    def __init__(self, config: ToyLossConfig) -> None:
        self.config = config
        self.loss_type = LossType.TOKEN_LEVEL
        self.temperature = config.temperature
        self.needs_entropy = False
        self.needs_reference_logprobs = False

    def validate_batch(self, batch) -> None:
        pass

    def __call__(self, output, mb):
        from splitrl.loss.base import LossOutput, Metric

        loss = -(mb.token_advantages() * output.logprobs * mb.loss_mask).sum() * self.config.scale
        return LossOutput(loss=loss, metrics={"loss": Metric(loss.detach())})


def register() -> None:
    from splitrl.loss import register_loss

    register_loss("toy", ToyLossConfig, ToyLoss)
