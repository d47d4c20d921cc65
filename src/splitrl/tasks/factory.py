"""Task configs as one tagged union, the factory that builds a task, and the demo default."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from splitrl.tasks.asdiv import AsdivTask, AsdivTaskConfig
from splitrl.tasks.base import Task
from splitrl.tasks.math_file import MathFileTask, MathFileTaskConfig
from splitrl.tasks.procedural import ReverseDigitsTask, ReverseDigitsTaskConfig
from splitrl.tasks.reasoning_gym_task import ReasoningGymTask, ReasoningGymTaskConfig

TaskConfig = Annotated[
    ReasoningGymTaskConfig | ReverseDigitsTaskConfig | MathFileTaskConfig | AsdivTaskConfig,
    Field(discriminator="kind"),
]
"""Any task config; the ``kind`` field (``"reasoning_gym"``, ``"reverse_digits"``,
``"math_file"``, ``"asdiv"``) says which. Use it as a field type in a larger config, or load a mapping with
:func:`parse_task_config`."""

_TASK_CONFIG_ADAPTER: TypeAdapter = TypeAdapter(TaskConfig)

_TASK_CLASSES: dict[type, type[Task]] = {
    ReasoningGymTaskConfig: ReasoningGymTask,
    ReverseDigitsTaskConfig: ReverseDigitsTask,
    MathFileTaskConfig: MathFileTask,
    AsdivTaskConfig: AsdivTask,
}


def parse_task_config(data: Mapping[str, Any]) -> TaskConfig:
    """Validate a mapping (e.g. from YAML) into the task config its ``kind`` names.

    Raises:
        pydantic.ValidationError (a ``ValueError``): unknown ``kind``, unknown or invalid fields.
    """
    return _TASK_CONFIG_ADAPTER.validate_python(dict(data))


def make_task(config: TaskConfig | Mapping[str, Any]) -> Task:
    """Build the task a config describes (a mapping is validated first).

    Raises:
        ValueError: if the config is invalid or the task cannot be built from it (missing file
            or column, a generator that rejects its settings, ...).
    """
    if isinstance(config, Mapping):
        config = parse_task_config(config)
    task_class = _TASK_CLASSES.get(type(config))
    if task_class is None:
        raise ValueError(
            f"make_task got a {type(config).__name__}; pass one of "
            f"{[c.__name__ for c in _TASK_CLASSES]} or a mapping with a `kind`"
        )
    return task_class(config)


def default_task_config() -> ReasoningGymTaskConfig:
    """The task of the CPU demo: sort 3 numbers 0-9, compact prompts, strict scoring.

    Prompts look like ``"desc 5,2,7="`` (at most 11 characters) with answer ``"7,5,2"``. A
    335 k-parameter model learns it from scratch by RL alone in about 3 minutes on 2 CPU cores
    (reward 0.008 → 0.95 from the first to the last 10 steps). Strict scoring, because the generator's own scorer
    accepts every number within ±1.
    """
    return ReasoningGymTaskConfig(
        dataset="number_sorting",
        dataset_config={
            "min_numbers": 3,
            "max_numbers": 3,
            "min_value": 0,
            "max_value": 9,
            "min_decimals": 0,
            "max_decimals": 0,
        },
        seed=0,
        compact_prompts=True,
        scoring="strict",
    )
