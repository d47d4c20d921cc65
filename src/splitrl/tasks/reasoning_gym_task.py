"""Tasks from reasoning-gym's procedural generators, with optional compact prompts.

reasoning-gym's questions are long instructions; a tiny model trained from scratch only learns
from short ones. With ``compact_prompts`` a prompt is rebuilt from the item's
``metadata`` in a few characters, and its answer in a matching compact form:

| generator | compact prompt | compact answer | partial-credit units |
| --- | --- | --- | --- |
| ``number_sorting`` | ``"desc 5,2,7="`` | ``"7,5,2"`` | comma-separated numbers |
| ``spell_backward`` | ``"cat>"`` | ``"tac"`` | characters |
| ``basic_arithmetic`` | ``"4+1="`` (the expression without spaces) | ``"5"`` | characters |

Numbers drop a trailing ``.0`` (``"5.0"`` → ``"5"``) in prompt and answer alike.

Scoring (after the answer is taken from the response, see ``answer_format``, and stripped):
- ``strict``: 1.0 when the response equals the reference answer exactly, else 0.0. Use it where
  the generator's own scorer is lax (``number_sorting``'s accepts each number within ±1).
- ``partial``: units equal at the same position ÷ max(#units of response, #units of answer)
  (:func:`splitrl.tasks.matching.position_match_fraction`); without compact prompts the units
  are the characters of the generator's answer string.
- ``partial_chars``: characters equal at the same position ÷ max(len(response), len(answer)),
  whatever the generator: the densest signal, for a policy that starts from random weights
  (a random 22-symbol policy scores ~0.03 on ``number_sorting``, against ~0.002 with
  ``partial``'s whole-number units).
- ``own``: the generator's ``score_answer``; a compact response is first converted back to the
  generator's answer format (``"2,5,7"`` → ``"['2', '5', '7']"`` for ``number_sorting``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from splitrl._lazy import import_checks_deferred
from splitrl.tasks.base import Task, TaskOptions, TaskPrompt
from splitrl.tasks.matching import extract_tagged_answer, position_match_fraction


def _compact_number(text: str) -> str:
    return text[:-2] if text.endswith(".0") else text


def _characters(text: str) -> list[str]:
    return list(text)


def _comma_items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",")]


@dataclass(frozen=True)
class _CompactFormat:
    prompt: Callable[[dict[str, Any]], str]  # item -> compact prompt
    answer: Callable[[dict[str, Any]], str]  # item -> compact reference answer
    to_source_answer: Callable[[str], str]  # compact response -> generator's answer format
    units: Callable[[str], list[str]]  # answer -> partial-credit units


def _sorting_prompt(item: dict[str, Any]) -> str:
    meta = item["metadata"]
    direction = "asc" if meta["direction"] == "ascending" else "desc"
    return f"{direction} {','.join(_compact_number(n) for n in meta['original_numbers'])}="


_COMPACT_FORMATS: dict[str, _CompactFormat] = {
    "number_sorting": _CompactFormat(
        prompt=_sorting_prompt,
        answer=lambda item: ",".join(
            _compact_number(n) for n in item["metadata"]["sorted_numbers"]
        ),
        to_source_answer=lambda response: str(_comma_items(response)),
        units=_comma_items,
    ),
    "spell_backward": _CompactFormat(
        prompt=lambda item: f"{item['metadata']['word']}>",
        answer=lambda item: item["answer"],
        to_source_answer=lambda response: response,
        units=_characters,
    ),
    "basic_arithmetic": _CompactFormat(
        prompt=lambda item: item["metadata"]["expression"].replace(" ", "") + "=",
        answer=lambda item: item["answer"],
        to_source_answer=lambda response: response,
        units=_characters,
    ),
}

_SOURCE_FORMAT = _CompactFormat(
    prompt=lambda item: item["question"],
    answer=lambda item: item["answer"],
    to_source_answer=lambda response: response,
    units=_characters,
)


class ReasoningGymTaskConfig(TaskOptions):
    """A reasoning-gym generator by name, with its own config.

    Attributes:
        dataset: generator name, e.g. ``"number_sorting"``, ``"spell_backward"``.
        dataset_config: keyword arguments of the generator's config dataclass (e.g.
            ``{"min_numbers": 3, "max_numbers": 3}``); ``seed`` and ``size`` are set below.
        seed: the generator's seed. reasoning-gym draws item ``i`` from ``Random(seed + i)``, so
            seeds ``s`` and ``s + k`` give the same prompts shifted by ``k`` indices: keep
            train and eval seeds further apart than the number of prompts either uses.
        size: number of prompts; None leaves the generator's own virtual size in place and
            accepts any index (right for generators whose item ``i`` depends on ``seed + i``
            only, which includes the three with compact prompts).
        compact_prompts: rebuild short prompts and answers from each item (module docstring).
        scoring: ``"strict"``, ``"partial"``, ``"partial_chars"`` or ``"own"`` (module docstring).
        answer_format: ``"plain"`` scores the whole response; ``"answer_tag"`` scores the text
            inside the last ``<answer>...</answer>`` (no tag → reward 0), for models that reason
            before answering.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str
    dataset_config: dict[str, Any] = Field(default_factory=dict)
    seed: int = Field(0, ge=0)
    size: int | None = Field(None, ge=1)
    compact_prompts: bool = False
    scoring: Literal["strict", "partial", "partial_chars", "own"] = "strict"
    answer_format: Literal["plain", "answer_tag"] = "plain"

    @model_validator(mode="after")
    def _check(self) -> ReasoningGymTaskConfig:
        if not import_checks_deferred():  # importing reasoning-gym takes seconds
            try:
                import reasoning_gym
            except ImportError as e:
                raise ValueError(
                    f"task.kind=reasoning_gym needs the reasoning-gym package, which does not import here ({e}); "
                    "install splitrl with its dependencies (pip install -e .) or pip install reasoning-gym==0.1.25, "
                    "or pick a built-in task such as task={kind: reverse_digits}"
                ) from e

            known = sorted(reasoning_gym.factory.DATASETS)
            if self.dataset not in known:
                close = difflib.get_close_matches(self.dataset, known, n=3)
                hint = f"did you mean {close}?" if close else f"known generators: {known}"
                raise ValueError(f"reasoning-gym has no generator {self.dataset!r}; {hint}")
        reserved = {"seed", "size"} & set(self.dataset_config)
        if reserved:
            raise ValueError(
                f"dataset_config must not set {sorted(reserved)}: use the task's own "
                "`seed` and `size` fields instead"
            )
        if self.compact_prompts and self.dataset not in _COMPACT_FORMATS:
            # a misspelt name of a compact generator: the spelling first, not "not available"
            close = difflib.get_close_matches(self.dataset, sorted(_COMPACT_FORMATS), n=1, cutoff=0.8)
            if close:
                raise ValueError(
                    f"task.dataset={self.dataset!r} is no generator with compact prompts; did you mean {close[0]!r}?"
                )
            raise ValueError(
                f"compact_prompts is not available for {self.dataset!r}; it is for "
                f"{sorted(_COMPACT_FORMATS)}. Set compact_prompts: false to use the "
                "generator's own prompts"
                + (
                    f" (whether reasoning-gym has a generator {self.dataset!r} at all is checked when the run "
                    "starts; a misspelt name is reported then)"
                    if import_checks_deferred()
                    else ""
                )
            )
        return self


def _unknown_fields_hint(config: ReasoningGymTaskConfig) -> str:
    """What to write instead when ``dataset_config`` has keys the generator's config lacks: most
    often the demo's ``number_sorting`` keys, kept by a ``task.dataset=...`` override."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    entry = DATASETS.get(config.dataset)
    if entry is None or not dataclasses.is_dataclass(entry[1]):
        return ""
    fields = [f.name for f in dataclasses.fields(entry[1]) if f.name not in ("seed", "size")]
    unknown = sorted(set(config.dataset_config) - set(fields))
    if not unknown:
        return ""
    return (
        f". {unknown} are not settings of {config.dataset!r} (its settings: {fields}); a task.dataset=... override "
        "keeps the config's dataset_config, so set task.dataset_config too (e.g. task.dataset_config={} for the "
        "generator's defaults)"
    )


class ReasoningGymTask(Task):
    """Prompts and scoring from one reasoning-gym generator.

    Raises:
        ValueError: at construction, when the generator rejects ``dataset_config`` (unknown
            field or a value its own validation refuses).
    """

    def __init__(self, config: ReasoningGymTaskConfig):
        self._generator = _create_generator(config)  # here: a rejected dataset_config fails now
        self.config = config

    def __reduce__(self):
        # A scoring process gets the config and builds the generator only when it needs it
        # (scoring: source): importing reasoning-gym (matplotlib, sympy and every generator's
        # module with it) cost ~1 s of CPU at every scoring worker's start, and a strict or
        # partial score never reads the generator. The config was checked where it was built.
        return (_unbuilt, (type(self), self.config))

    @property
    def _format(self):
        """The prompt and answer format: the generator's compact one, or the source's."""
        config = self.config
        return _COMPACT_FORMATS[config.dataset] if config.compact_prompts else _SOURCE_FORMAT

    @property
    def generator(self) -> Any:
        """The reasoning-gym dataset (built on first use in a process that unpickled the task)."""
        if self._generator is None:
            self._generator = _create_generator(self.config)
        return self._generator

    @property
    def num_prompts(self) -> int | None:
        return self.config.size

    def _make_prompt(self, index: int) -> TaskPrompt:
        item = self.generator[index]
        return TaskPrompt(
            index=index,
            text=self._format.prompt(item),
            answer=self._format.answer(item),
            metadata={"source_answer": item["answer"], "source_metadata": item["metadata"]},
        )

    def score(self, prompt: TaskPrompt, response_text: str) -> float:
        if self.config.answer_format == "answer_tag":
            extracted = extract_tagged_answer(response_text)
            if extracted is None:
                return 0.0
            response_text = extracted
        response = response_text.strip()
        if self.config.scoring == "strict":
            return float(response == prompt.answer)
        if self.config.scoring == "partial_chars":
            return position_match_fraction(list(response), list(prompt.answer))
        if self.config.scoring == "partial":
            return position_match_fraction(
                self._format.units(response), self._format.units(prompt.answer)
            )
        entry = {
            "question": prompt.text,
            "answer": prompt.metadata["source_answer"],
            "metadata": prompt.metadata["source_metadata"],
        }
        return float(self.generator.score_answer(self._format.to_source_answer(response), entry))


def _create_generator(config: ReasoningGymTaskConfig) -> Any:
    """reasoning-gym's dataset for ``config``.

    Raises:
        ValueError: when the generator rejects ``dataset_config`` (unknown field or a value its own
            validation refuses).
    """
    import reasoning_gym

    kwargs = dict(config.dataset_config, seed=config.seed)
    if config.size is not None:
        kwargs["size"] = config.size
    try:
        return reasoning_gym.create_dataset(config.dataset, **kwargs)
    except (TypeError, AssertionError, ValueError) as exc:
        raise ValueError(
            f"reasoning-gym generator {config.dataset!r} rejected dataset_config "
            f"{config.dataset_config}: {exc or type(exc).__name__}{_unknown_fields_hint(config)}"
        ) from exc


def _unbuilt(cls: type, config: ReasoningGymTaskConfig) -> ReasoningGymTask:
    """A task of ``config`` whose generator is built on first use (:meth:`ReasoningGymTask.__reduce__`)."""
    task = cls.__new__(cls)
    task._generator = None
    task.config = config
    return task
