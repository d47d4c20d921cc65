"""Policy model with MTP heads (DESIGN.md §3)."""

from typing import TYPE_CHECKING

from splitrl._lazy import lazy_getattr
from splitrl.models.config import ModelCapabilities, ModelConfig, MTPConfig

if TYPE_CHECKING:
    from splitrl.models.policy import PolicyModel, PolicyOutput

# the policy imports torch and transformers: loaded on first use (see splitrl._lazy)
__getattr__ = lazy_getattr(__name__, {"PolicyModel": "splitrl.models.policy", "PolicyOutput": "splitrl.models.policy"})

__all__ = ["ModelCapabilities", "ModelConfig", "MTPConfig", "PolicyModel", "PolicyOutput"]
