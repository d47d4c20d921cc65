"""The single controller (DESIGN.md §4): rollout and train pumps, replay buffer, advantages."""
