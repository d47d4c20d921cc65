"""The single controller (DESIGN.md §4): rollout pump, replay buffer, advantage stage, train pump."""
