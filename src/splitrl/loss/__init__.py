"""Losses of the split step: contracts (``base``), GRPO (``grpo``), target logprobs (``logprobs``)."""

from splitrl.loss.base import LossOutput, LossType, Metric, Normalizer, PolicyLoss
from splitrl.loss.grpo import ClippedPGLoss, GRPOLossConfig

__all__ = ["ClippedPGLoss", "GRPOLossConfig", "LossOutput", "LossType", "Metric", "Normalizer", "PolicyLoss"]
