"""The task interface: deterministic prompts by index, and a scorer with rewards in [0, 1].

A task is built from its config (see :mod:`splitrl.tasks.factory`). The controller asks it for
prompts by position in the run's prompt order; a generation worker builds the same task from the
same config and scores responses next to generation (DESIGN.md §5), through
:mod:`splitrl.tasks.scoring`, which puts a time limit on every check.

Both sides must agree on prompts without talking to each other, so ``get_prompt(index)`` depends
on ``index`` and the task config (its ``seed`` included) only: never on call order or global RNG
state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict


class TaskOptions(BaseModel):
    """Options every task config has (each task's config class derives from this one).

    Attributes:
        chat_template: ``true``: prompts go through the tokenizer's chat template (one user turn,
            generation prompt appended; an error when the tokenizer has none); ``false``: plain
            text; ``null`` (default): the template when the tokenizer has one.
    """

    model_config = ConfigDict(extra="forbid")

    chat_template: bool | None = None


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt of a task with its reference answer.

    Attributes:
        index: position of the prompt in the task (the argument of ``Task.get_prompt``).
        text: the prompt text as the user would type it (no chat template applied).
        answer: the reference answer, in the form the task's scorer compares against.
        metadata: small, picklable extras the scorer may need (e.g. the generator's own answer).
    """

    index: int
    text: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as a one-turn chat, for tokenizers with a chat template."""
        return [{"role": "user", "content": self.text}]


class Task(ABC):
    """A source of prompts and a scorer for responses to them.

    Subclasses are built from a pydantic config (``self.config``) and pickle as that config, so
    handing a task to a scoring process sends a few bytes and rebuilds it there.
    """

    config: BaseModel

    @property
    @abstractmethod
    def num_prompts(self) -> int | None:
        """Number of distinct prompts, or None when every index ``>= 0`` is a valid prompt."""

    @abstractmethod
    def _make_prompt(self, index: int) -> TaskPrompt:
        """Build prompt ``index`` (already range-checked); deterministic in index and config."""

    @abstractmethod
    def score(self, prompt: TaskPrompt, response_text: str) -> float:
        """Reward of ``response_text`` for ``prompt``, a float in [0, 1].

        This call has no time limit of its own; use :func:`splitrl.tasks.compute_rewards` or
        :class:`splitrl.tasks.RewardScorer` wherever a check could hang.
        """

    def source_of(self, index: int) -> tuple | None:
        """Where prompt ``index`` comes from, as a key equal for two prompts made from the same
        source row whatever their template or split (e.g. (file, "line 12")); None where prompts have no
        such source (generated tasks). Held-out evaluation compares these to refuse an
        ``eval.task`` that serves training rows (:func:`splitrl.eval_config.plan_eval`)."""
        return None

    def get_prompt(self, index: int) -> TaskPrompt:
        """Prompt number ``index``; the same index and config always give the same prompt.

        Raises:
            IndexError: if ``index < 0`` or ``index >= num_prompts`` (when finite).
        """
        n = self.num_prompts
        if index < 0 or (n is not None and index >= n):
            bound = "any index >= 0" if n is None else f"indices 0..{n - 1}"
            raise IndexError(f"prompt index {index} is out of range: this task has {bound}")
        return self._make_prompt(index)

    def __reduce__(self):
        # Rebuild from the config in the receiving process instead of pickling loaded data
        # (word lists, a whole dataset file), which can be large.
        return (type(self), (self.config,))


def render_prompt(prompt: TaskPrompt, tokenizer: Any) -> str:
    """The prompt string to tokenize for generation.

    With a chat template on the tokenizer (``tokenizer.chat_template`` set), the prompt's
    ``messages`` go through it with the generation prompt appended; otherwise the plain ``text``
    is returned. A templated string already holds the template's special tokens, so tokenize it
    with ``add_special_tokens=False`` (:func:`encode_prompt` does this).
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            prompt.messages, tokenize=False, add_generation_prompt=True
        )
    return prompt.text


def encode_prompt(prompt: TaskPrompt, tokenizer: Any, chat_template: bool | None = None) -> list[int]:
    """Token ids of the prompt, special tokens added only once.

    ``chat_template`` (a task's ``chat_template`` option): True renders through the tokenizer's
    chat template (:func:`render_prompt`), False uses the plain text, None the template when the
    tokenizer has one.

    Raises:
        ValueError: ``chat_template=True`` and the tokenizer has no chat template.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise ValueError(
            "task.chat_template=true but the tokenizer has no chat template; use a tokenizer with one "
            "(tokenizer.kind=pretrained) or set task.chat_template=false"
        )
    use = has_template if chat_template is None else chat_template
    text = render_prompt(prompt, tokenizer) if use else prompt.text
    return list(tokenizer(text, add_special_tokens=not use)["input_ids"])
