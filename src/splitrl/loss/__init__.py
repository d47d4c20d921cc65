"""Losses of the split step: contracts (``base``), GRPO (``grpo``) and the registry that builds a
loss from its ``kind`` (``registry``); the chunked output head that computes target logprobs lives
with the model (``splitrl.models.head``)."""

from typing import TYPE_CHECKING

from splitrl._lazy import lazy_getattr
from splitrl.loss.config import GRPOLossConfig, LossType, RunGRPOLossConfig
from splitrl.loss.registry import loss_kinds, make_loss, parse_loss_config, register_loss

if TYPE_CHECKING:
    from splitrl.loss.base import LossOutput, Metric, Normalizer, PolicyLoss
    from splitrl.loss.grpo import ClippedPGLoss

# the losses import torch: loaded on first use (see splitrl._lazy)
__getattr__ = lazy_getattr(
    __name__,
    {
        "ClippedPGLoss": "splitrl.loss.grpo",
        "LossOutput": "splitrl.loss.base",
        "Metric": "splitrl.loss.base",
        "Normalizer": "splitrl.loss.base",
        "PolicyLoss": "splitrl.loss.base",
    },
)

__all__ = [
    "ClippedPGLoss",
    "GRPOLossConfig",
    "LossOutput",
    "LossType",
    "Metric",
    "Normalizer",
    "PolicyLoss",
    "RunGRPOLossConfig",
    "loss_kinds",
    "make_loss",
    "parse_loss_config",
    "register_loss",
]
