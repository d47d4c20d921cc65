"""Named starting points of a run config: ``preset: NAME`` in a config file, or ``preset=NAME``
on the command line, starts from ``presets/NAME.yaml`` (the file's keys and the overrides go on
top, see :func:`splitrl.config.load_config`).

- ``cpu_demo``: the CPU demo (``splitrl train`` without ``--config`` runs it): a tiny random-init
  Qwen3 with one MTP depth, a character tokenizer, reasoning-gym ``number_sorting`` with partial
  credit, 8 new tokens a sample.

A preset sets values as a config file does, so it leaves out the keys whose default derives from
another setting (``buffer.max_staleness``, ``dataplane.kind``, ``train.optim.total_steps``: see
``RunConfig._run_level_defaults``): set there, they would no longer follow it.
"""

from __future__ import annotations

from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parent

# the preset `splitrl train` runs when it is given no --config
DEMO_PRESET = "cpu_demo"


def preset_names() -> list[str]:
    """The names of the packaged presets."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name``.

    Raises:
        ValueError: no such preset, naming the ones there are.
    """
    path = PRESETS_DIR / f"{name}.yaml"
    if not isinstance(name, str) or "/" in name or not path.is_file():
        raise ValueError(f"preset={name!r} is not a preset; the presets are: {', '.join(preset_names())}")
    return path
