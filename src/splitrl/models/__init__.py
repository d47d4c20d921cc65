"""Policy model with MTP heads (DESIGN.md §3)."""

from splitrl.models.config import ModelCapabilities, ModelConfig, MTPConfig
from splitrl.models.policy import PolicyModel, PolicyOutput

__all__ = ["ModelCapabilities", "ModelConfig", "MTPConfig", "PolicyModel", "PolicyOutput"]
