"""Rollouts: batched sampling with a KV cache, self-speculative with the MTP heads (DESIGN.md §4)."""

from splitrl.rollout.config import GenerationConfig
from splitrl.rollout.engine import GenerationResult, RolloutEngine, RolloutStats

__all__ = ["GenerationConfig", "GenerationResult", "RolloutEngine", "RolloutStats"]
