"""The CPU demo's run config for tests (one helper, so that no test depends on the defaults).

Most tests run a small variant of the CPU demo: ``demo_config([overrides])`` is
``load_config(path, overrides)`` started from the preset ``cpu_demo`` (what ``splitrl train``
without ``--config`` runs), where the run's own defaults are those of a real model.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from splitrl.config import RunConfig, load_config
from splitrl.presets import DEMO_PRESET, preset_path

# the demo's character tokenizer (its model's vocab_size is 4 + len(DEMO_CHARSET))
DEMO_CHARSET: str = yaml.safe_load(preset_path(DEMO_PRESET).read_text())["tokenizer"]["charset"]


def demo_config(overrides: list[str] | None = None, path: str | Path | None = None) -> RunConfig:
    """The CPU demo's config with ``overrides`` (``key.path=value``) applied, as the CLI loads it."""
    return load_config(path, list(overrides or []), preset=DEMO_PRESET)


def demo_model_config():
    """The demo's policy: a 2-layer Qwen3 (hidden 128) with one MTP depth."""
    return demo_config().model
