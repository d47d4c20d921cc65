"""Weights & Biases as an optional sink of :class:`~splitrl.logging.MetricsLogger`.

Configured by ``logging.wandb: {project, name, mode}`` (``mode: offline`` writes the run under
``out_dir/wandb/`` for a later ``wandb sync``; ``disabled`` makes every call a no-op). The
resolved run config becomes the W&B run config; each step's metrics are logged at that step.

A resumed run continues the same W&B run: the run id is kept in ``out_dir/wandb_run_id`` and
passed back to ``wandb.init(id=..., resume="allow")``.

wandb is an optional dependency (``pip install -e ".[wandb]"``); configuring it without the
package installed is a config error, reported when the config is loaded.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RUN_ID_FILE = "wandb_run_id"


class WandbConfig(BaseModel):
    """A Weights & Biases run.

    Attributes:
        project: the W&B project the run is logged to.
        name: display name of the run (default: W&B picks one).
        mode: ``online``, ``offline`` (written under ``output_dir/wandb``; upload later with
            ``wandb sync``) or ``disabled``.
        entity: user or team owning the project (default: your default entity).
        group: groups related runs in the W&B UI.
        tags: tags of the run.
    """

    model_config = ConfigDict(extra="forbid")

    project: str = Field(min_length=1)
    name: str | None = None
    mode: Literal["online", "offline", "disabled"] = "online"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _installed(self) -> "WandbConfig":
        if self.mode != "disabled" and "wandb" not in sys.modules and importlib.util.find_spec("wandb") is None:
            raise ValueError(
                "logging.wandb is set but the wandb package is not installed: pip install 'splitrl[wandb]' "
                "(or pip install wandb), or remove logging.wandb"
            )
        return self


def check_credentials(config: WandbConfig | None, wandb_module: Any = None, interactive: bool | None = None) -> None:
    """Refuse an ``online`` W&B run that has no API key and no terminal to ask for one, before any
    worker starts (``wandb.init`` raised its UsageError only after the model had loaded).

    Args:
        config: ``logging.wandb`` (None: W&B off).
        wandb_module: the ``wandb`` module (tests pass a stand-in); default: ``import wandb``.
        interactive: whether W&B may prompt for a key (default: stdin is a terminal).

    Raises:
        ValueError: ``mode: online``, no key configured (``WANDB_API_KEY``, ``wandb login``) and
            no terminal.
    """
    if config is None or config.mode != "online":
        return
    if interactive is None:
        interactive = sys.stdin is not None and sys.stdin.isatty()
    if interactive:  # wandb.init asks for the key itself
        return
    if wandb_module is None:
        import wandb as wandb_module
    try:
        configured = wandb_module.login(prompt=False, verify=False)  # no network: is a key there at all
    except TypeError:  # a wandb without login(prompt=...): wandb.init reports it
        return
    if not configured:
        raise ValueError(
            "logging.wandb.mode=online but no W&B API key is configured and there is no terminal to ask for one; "
            "set WANDB_API_KEY or run `wandb login` first, or use logging.wandb.mode=offline (then `wandb sync`)"
        )


class WandbSink:
    """One W&B run: ``log(step, metrics)``, ``set_config(config)``, ``close()``.

    Args:
        config: the run's :class:`WandbConfig`.
        out_dir: the run's output directory (W&B files and the run id go there).
        resume: continue the W&B run whose id is stored in ``out_dir`` (if any).
        wandb_module: the ``wandb`` module (tests pass a stand-in); default: ``import wandb``.
    """

    def __init__(self, config: WandbConfig, out_dir: str | Path, *, resume: bool = False, wandb_module: Any = None):
        if wandb_module is None:
            import wandb as wandb_module
        self._wandb = wandb_module
        out = Path(out_dir)
        id_file = out / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        self.run = wandb_module.init(
            project=config.project,
            name=config.name,
            mode=config.mode,
            entity=config.entity,
            group=config.group,
            tags=list(config.tags) or None,
            dir=str(out),
            id=run_id,
            resume="allow" if run_id else None,
        )
        new_id = getattr(self.run, "id", None)
        if new_id and config.mode != "disabled":
            id_file.write_text(str(new_id))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one step's scalars at ``step``."""
        self.run.log(dict(metrics), step=step)

    def set_config(self, config: Mapping[str, Any]) -> None:
        """Make ``config`` (the resolved run config, JSON-able) the run's config."""
        self.run.config.update(dict(config), allow_val_change=True)

    def close(self) -> None:
        """Finish the run. Offline, the W&B service may still be writing the run's file when this
        returns (a CI run once read it without its history); it is complete after
        ``wandb.teardown()``, which wandb also calls when the process exits."""
        self.run.finish()
