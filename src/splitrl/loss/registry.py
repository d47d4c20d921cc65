"""The losses a run can train, by ``kind``: kind -> (options class, loss class), and the factory.

A run's ``loss:`` section is a tagged union of the registered losses' options, selected by
``kind`` (``grpo`` when the section names none, so configs written before there was a choice
keep their meaning). :func:`make_loss` builds the loss a config describes; the train workers,
the tests and the benchmarks all build theirs through it.

Adding a loss touches its own module and one line of ``_LOSSES`` below:

- the options: a pydantic model with ``kind: Literal["<kind>"]`` and a ``temperature`` field (the
  sampler's T; a run sets it from ``rollout.temperature``), in a module that does not import
  torch (a run config validates before torch loads);
- the loss: ``Loss(config)``, a :class:`~splitrl.loss.base.PolicyLoss` (named as
  ``"module:Class"``, imported on first use);
- optionally the run's form of the options, when the run derives more than the temperature (see
  :class:`~splitrl.loss.config.RunGRPOLossConfig`); otherwise one is made from the options.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, Field, create_model

from splitrl.loss.config import GRPOLossConfig, RunGRPOLossConfig, RunLossOptions

if TYPE_CHECKING:
    from splitrl.loss.base import PolicyLoss

DEFAULT_KIND = "grpo"


@dataclass(frozen=True)
class LossEntry:
    """One registered loss.

    Attributes:
        config: the trainer's options (every value fixed), ``kind`` and ``temperature`` fields.
        loss: ``"module:Class"`` (or the class) of the loss; ``loss(config)`` builds it.
        run_config: the run's ``loss:`` section class (a :class:`RunLossOptions`).
    """

    config: type[BaseModel]
    loss: str | type
    run_config: type[BaseModel]

    def loss_class(self) -> type:
        if not isinstance(self.loss, str):
            return self.loss
        module, _, name = self.loss.partition(":")
        return getattr(importlib.import_module(module), name)


def _entry(kind: str, config: type[BaseModel], loss: str | type, run_config: type[BaseModel] | None = None) -> LossEntry:
    for name in ("kind", "temperature"):
        if name not in config.model_fields:
            raise ValueError(f"loss {kind!r}: {config.__name__} has no `{name}` field; every loss's options need one")
    if config.model_fields["kind"].default != kind:
        raise ValueError(f"loss {kind!r}: {config.__name__}.kind defaults to {config.model_fields['kind'].default!r}")
    return LossEntry(config, loss, run_config or _run_form(config))


def _run_form(config: type[BaseModel]) -> type[BaseModel]:
    """The run's section class of a loss registered without one: ``temperature`` open."""
    return create_model(
        f"Run{config.__name__}",
        __base__=(config, RunLossOptions),
        __doc__=config.__doc__,
        __module__=config.__module__,
        temperature=(float | None, Field(None, gt=0.0)),
    )


_LOSSES: dict[str, LossEntry] = {
    "grpo": _entry("grpo", GRPOLossConfig, "splitrl.loss.grpo:ClippedPGLoss", RunGRPOLossConfig),
}


def register_loss(
    kind: str, config: type[BaseModel], loss: str | type, run_config: type[BaseModel] | None = None
) -> None:
    """Add a loss at run time (a plugin, a test). A run config sees the losses registered before
    ``splitrl.config`` is imported (its ``loss`` field type is made then, as a tagged union).

    Raises:
        ValueError: ``kind`` is taken, or ``config`` lacks ``kind`` / ``temperature``.
    """
    if kind in _LOSSES:
        raise ValueError(f"loss kind {kind!r} is registered already")
    _LOSSES[kind] = _entry(kind, config, loss, run_config)


def loss_kinds() -> list[str]:
    """The registered kinds, in registration order."""
    return list(_LOSSES)


def loss_entry(kind: str) -> LossEntry:
    """The entry of ``kind``.

    Raises:
        ValueError: an unknown kind; the message lists the known ones.
    """
    entry = _LOSSES.get(kind)
    if entry is None:
        known = ", ".join(repr(k) for k in _LOSSES)
        raise ValueError(
            f"kind {kind!r} is not a known loss; known kinds: {known} (a loss is added in splitrl/loss/registry.py)"
        )
    return entry


def _kind_of(data: Any) -> Any:
    """A raw section with its kind filled in (``grpo`` when absent), checked against the registry."""
    if not isinstance(data, Mapping):
        return data  # a built config object (or garbage, which validation reports)
    data = dict(data)
    loss_entry(data.setdefault("kind", DEFAULT_KIND))
    return data


def run_loss_config_type() -> Any:
    """The type of a run's ``loss`` field: the registered losses' run sections as a union tagged
    by ``kind`` (just the one class while one loss is registered: its errors then read
    ``loss.<key>``, as a plain section's)."""
    forms = tuple(e.run_config for e in _LOSSES.values())
    if len(forms) == 1:
        return Annotated[forms[0], BeforeValidator(_kind_of)]
    return Annotated[Union[forms], Field(discriminator="kind"), BeforeValidator(_kind_of)]


def parse_loss_config(data: Mapping[str, Any]) -> BaseModel:
    """Validate a mapping into the trainer options its ``kind`` names (``grpo`` when absent).

    Raises:
        ValueError: an unknown kind (listing the known ones); pydantic's ``ValidationError`` (a
            ``ValueError``) for unknown or invalid fields.
    """
    data = _kind_of(data)
    return loss_entry(data["kind"]).config.model_validate(data)


def trainer_loss_config(section: BaseModel, *, temperature: float, max_staleness: int) -> BaseModel:
    """The trainer options of a run's ``loss`` section, with what the run derives filled in."""
    entry = loss_entry(section.kind)
    return entry.config(**section.trainer_options(temperature=temperature, max_staleness=max_staleness))


def make_loss(config: BaseModel | Mapping[str, Any]) -> PolicyLoss:
    """Build the loss a config describes (a mapping is validated first, see :func:`parse_loss_config`).

    Raises:
        ValueError: an unknown kind, or a run's ``loss`` section (resolve it first:
            ``RunConfig.trainer_loss_config()``), or an object that is no registered loss's options.
    """
    if isinstance(config, Mapping):
        config = parse_loss_config(config)
    if isinstance(config, RunLossOptions):
        raise ValueError(
            f"make_loss got a run's loss section ({type(config).__name__}); pass RunConfig.trainer_loss_config(), "
            "which fills in the temperature and what else the run derives"
        )
    kind = getattr(config, "kind", None)
    if not isinstance(config, BaseModel) or not isinstance(kind, str):
        raise ValueError(
            f"make_loss got a {type(config).__name__}; pass a loss's options (e.g. GRPOLossConfig) or a mapping"
        )
    entry = loss_entry(kind)
    if not isinstance(config, entry.config):
        raise ValueError(f"make_loss got a {type(config).__name__} of kind {config.kind!r}; pass a {entry.config.__name__}")
    return entry.loss_class()(config)
