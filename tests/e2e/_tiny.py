"""The small run both e2e test files use: 4 prompts × 4 samples a step, short responses."""

TINY_STEP = [
    "groups_per_step=4",
    "group_size=4",
    "min_groups_per_chunk=2",
    "generation_groups_per_call=2",
    "rollout.max_new_tokens=6",
    "logging.progress_bar=false",
    "reward_timeout_s=10",
]
