"""Rollouts: batched sampling with a KV cache, self-speculative with the MTP heads (DESIGN.md §4)."""

from typing import TYPE_CHECKING

from splitrl._lazy import lazy_getattr
from splitrl.rollout.config import GenerationConfig

if TYPE_CHECKING:
    from splitrl.rollout.engine import RolloutEngine
    from splitrl.rollout.results import GenerationResult, RolloutStats

# the engine imports torch and transformers: loaded on first use (see splitrl._lazy)
__getattr__ = lazy_getattr(
    __name__,
    {
        "GenerationResult": "splitrl.rollout.results",
        "RolloutEngine": "splitrl.rollout.engine",
        "RolloutStats": "splitrl.rollout.results",
    },
)

__all__ = ["GenerationConfig", "GenerationResult", "RolloutEngine", "RolloutStats"]
