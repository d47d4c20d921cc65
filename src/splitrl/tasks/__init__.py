"""Tasks (prompts by index, scorers) and rewards with a time limit per check (DESIGN.md §5).

``make_task(config)`` builds a :class:`Task` from a :data:`TaskConfig`; ``RewardScorer`` /
``compute_rewards`` score responses next to generation; ``render_prompt`` applies the tokenizer's
chat template when it has one; ``build_char_tokenizer`` makes the CPU demo's tokenizer.
"""

from splitrl.tasks.base import Task, TaskPrompt, encode_prompt, render_prompt
from splitrl.tasks.factory import TaskConfig, default_task_config, make_task, parse_task_config
from splitrl.tasks.math_file import MathFileTask, MathFileTaskConfig
from splitrl.tasks.procedural import ReverseDigitsTask, ReverseDigitsTaskConfig
from splitrl.tasks.reasoning_gym_task import ReasoningGymTask, ReasoningGymTaskConfig
from splitrl.tasks.scoring import RewardResult, RewardScorer, compute_rewards
from splitrl.tasks.tokenizer import build_char_tokenizer

__all__ = [
    "MathFileTask",
    "MathFileTaskConfig",
    "ReasoningGymTask",
    "ReasoningGymTaskConfig",
    "ReverseDigitsTask",
    "ReverseDigitsTaskConfig",
    "RewardResult",
    "RewardScorer",
    "Task",
    "TaskConfig",
    "TaskPrompt",
    "build_char_tokenizer",
    "compute_rewards",
    "default_task_config",
    "encode_prompt",
    "make_task",
    "parse_task_config",
    "render_prompt",
]
