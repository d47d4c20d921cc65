"""The small run both e2e test files use: 4 prompts × 4 samples a step, short responses."""

TINY_STEP = [
    "schedule.groups_per_step=4",
    "schedule.group_size=4",
    "schedule.min_groups_per_chunk=2",
    "schedule.generation_groups_per_call=2",
    "rollout.max_new_tokens=6",
    "logging.progress_bar=false",
    "reward.timeout_s=10",
]
