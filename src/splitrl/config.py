"""The run configuration: one typed object made of the components' own configs.

A run is a YAML file (or a named preset, :mod:`splitrl.presets`) plus ``key.path=value``
overrides. It is validated on load — unknown keys, impossible combinations
(:mod:`splitrl.config_checks`) and missing files raise a ``ValueError`` that names the key, before
anything starts.

Layout: ``seed`` and ``output_dir`` at the top; the controller's sections ``schedule``,
``cluster``, ``checkpoint``, ``faults``, ``reward`` (:mod:`splitrl.controller.config`); the
components' sections (``model``, ``tokenizer``, ``task``, ``rollout``, ``loss``, ``train``,
``advantage``, ``buffer``, ``dataplane``, ``logging``, ``eval``). The flat keys of earlier
releases (``num_steps``, ``backend`` ...: :data:`MOVED_KEYS`) are still read, with a warning that
names the new key.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitrl._lazy import deferred_import_checks
from splitrl.config_checks import check_run_config
from splitrl.config_help import explain_validation_error
from splitrl.config_types import UserPath, path_problem  # noqa: F401 - path_problem re-exported
from splitrl.controller.buffer import ReplayBufferConfig
from splitrl.controller.config import CheckpointConfig, ClusterConfig, FaultsConfig, RewardConfig, ScheduleConfig
from splitrl.dataplane import DataPlaneConfig
from splitrl.eval_config import EvalConfig
from splitrl.logging import LoggingConfig
from splitrl.loss.advantages import AdvantageConfig
from splitrl.loss.config import DEFAULT_TIS_CAP, RunGRPOLossConfig  # noqa: F401 - DEFAULT_TIS_CAP re-exported
from splitrl.loss.registry import run_loss_config_type, trainer_loss_config
from splitrl.models import ModelConfig
from splitrl.presets import preset_path
from splitrl.rollout import GenerationConfig
from splitrl.tasks import TaskConfig, default_task_config
from splitrl.tasks.tokenizer import TokenizerConfig
from splitrl.train import TrainConfig

log = logging.getLogger(__name__)

RunLossConfig = run_loss_config_type()
"""The run's ``loss`` section: the options of the loss its ``kind`` names (``grpo`` when absent),
in the run's form (:class:`~splitrl.loss.config.RunGRPOLossConfig`: the temperature and the
truncated-IS cap derived from the run unless given). :meth:`RunConfig.trainer_loss_config`
resolves them; the registry of kinds is :mod:`splitrl.loss.registry`."""


# The flat top-level keys of earlier releases -> their key now. Still read (in a file, a saved run
# config and as overrides) with a warning; giving one together with its new key is an error.
# ``schedule`` is both: a plain value there is the old key (async / sync), a mapping the section.
MOVED_KEYS: dict[str, str] = {
    "schedule": "schedule.mode",
    "num_steps": "schedule.num_steps",
    "groups_per_step": "schedule.groups_per_step",
    "group_size": "schedule.group_size",
    "min_groups_per_chunk": "schedule.min_groups_per_chunk",
    "generation_groups_per_call": "schedule.generation_groups_per_call",
    "chunk_order": "schedule.chunk_order",
    "backend": "cluster.backend",
    "placement": "cluster.placement",
    "num_generation_workers": "cluster.num_generation_workers",
    "num_train_workers": "cluster.num_train_workers",
    "device": "cluster.device",
    "ray_address": "cluster.ray_address",
    "torch_threads": "cluster.torch_threads",
    "rollout_dtype": "cluster.rollout_dtype",
    "checkpoint_every": "checkpoint.every",
    "export_every": "checkpoint.export_every",
    "resume": "checkpoint.resume",
    "on_chunk_failure": "faults.on_chunk_failure",
    "max_step_retries": "faults.max_step_retries",
    "watchdog_timeout_s": "faults.watchdog_timeout_s",
    "reward_timeout_s": "reward.timeout_s",
    "mask_truncated": "reward.mask_truncated",
}


class RunConfig(BaseModel):
    """Everything a ``splitrl train`` run needs.

    The defaults are those of a run on a real model (``model.pretrained_path`` and its
    tokenizer); the CPU demo's values are the preset ``cpu_demo`` (:mod:`splitrl.presets`).

    Attributes (run level; the rest are the controller's and the components' configs):
        seed: seed of the run's sampling (each sample's seed derives from it, the prompt index and
            the sample index). The random init of the model has its own ``model.seed``.
        output_dir: metrics, TensorBoard, checkpoints, the resolved config and the plot.
        schedule: steps, what a step is made of, sync or async (this and the four below:
            :mod:`splitrl.controller.config`).
        cluster: backend, placement, worker counts, device.
        checkpoint: how often to checkpoint and export, resume.
        faults: retries of a failed step, the stall watchdog.
        reward: the answer check's time limit, masking of truncated samples.
        tokenizer: the run's default is the model's own (``kind: pretrained``).
        buffer: the run's default holds 64 groups, samples up to 1 policy version old.
        eval: held-out evaluation during training (:class:`~splitrl.eval_config.EvalConfig`).
    """

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    output_dir: UserPath = "runs/splitrl"
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)

    model: ModelConfig = Field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = Field(default_factory=lambda: TokenizerConfig(kind="pretrained"))
    task: TaskConfig = Field(default_factory=default_task_config)
    rollout: GenerationConfig = Field(default_factory=GenerationConfig)
    loss: RunLossConfig = Field(default_factory=RunGRPOLossConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    buffer: ReplayBufferConfig = Field(default_factory=lambda: ReplayBufferConfig(capacity_groups=64, max_staleness=1))
    dataplane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="before")
    @classmethod
    def _run_level_defaults(cls, data: Any) -> Any:
        """Read the old flat keys (:data:`MOVED_KEYS`), then fill the component fields whose
        default is a run-level value *before* the components validate: a component's own check
        cannot see the run (``OptimConfig`` refuses cosine without ``total_steps``), so filling
        them afterwards comes too late.

        - ``train.optim.total_steps`` (cosine schedule) defaults to ``schedule.num_steps``;
        - ``dataplane.kind`` defaults to ``inprocess`` with ``cluster.backend=local`` (the only
          one it runs);
        - ``buffer.max_staleness`` defaults to 0 with ``schedule.mode=sync`` (the only value it runs).
        """
        if not isinstance(data, dict):
            return data
        data = upgrade_layout(dict(data), "RunConfig")  # a copy: the caller's data stays as it was
        _refuse_boolean_counts(cls, data)
        _refuse_empty_output_dir(data)
        optim = _section(data, ("train", "optim"))
        if optim is not None and optim.get("schedule") == "cosine" and optim.get("total_steps") is None:
            optim["total_steps"] = _given(data, "schedule", "num_steps", ScheduleConfig().num_steps)
        if _given(data, "cluster", "backend") == "local":
            _set_unless_given(data, "dataplane", "kind", "inprocess")
        if _given(data, "schedule", "mode") == "sync":
            _set_unless_given(data, "buffer", "max_staleness", 0)
        return data

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        check_run_config(self)
        return self

    def tis_cap(self) -> float | None:
        """The truncated-IS cap the trainer uses (None: no correction, or a loss without one)."""
        return getattr(self.trainer_loss_config(), "tis_cap", None)

    def trainer_loss_config(self):
        """The loss options every train worker runs (:func:`splitrl.loss.make_loss` builds the
        loss): the ``loss`` section with ``temperature`` taken from ``rollout.temperature`` and
        ``tis_cap`` (GRPO) resolved."""
        return trainer_loss_config(
            self.loss, temperature=self.rollout.temperature, max_staleness=self.buffer.max_staleness
        )

    def off_policy_summary(self) -> tuple[int, str]:
        """What the run does about stale samples, for the console at start: (logging level, text).

        A warning when ``max_staleness > 0`` and the correction was turned off."""
        stale = self.buffer.max_staleness
        if "tis_cap" not in type(self.loss).model_fields:
            return (logging.WARNING if stale else logging.INFO), (
                f"off-policy correction: loss.kind={self.loss.kind} has none (buffer.max_staleness={stale})"
            )
        cap = self.tis_cap()
        if stale > 0 and cap is None:
            return logging.WARNING, (
                f"off-policy correction OFF (loss.tis_cap=null) with buffer.max_staleness={stale}: samples up "
                f"to {stale} policy version(s) old are trained as if on-policy (the recomputed PPO ratio is 1 "
                "and no importance weight corrects them); remove loss.tis_cap (auto) to turn it on"
            )
        if cap is None:
            return (
                logging.INFO,
                "off-policy correction: none needed (buffer.max_staleness=0: every sample is on-policy)",
            )
        return logging.INFO, (
            f"off-policy correction ON: truncated importance weights min(exp(prev - gen), {cap:g}) per token "
            f"(buffer.max_staleness={stale}; loss.tis_cap sets the cap, null turns it off)"
        )


def _given(data: dict[str, Any], section: str, key: str, default: Any = None) -> Any:
    """The value of ``section.key`` in raw config data (a mapping or a built config object),
    or ``default`` where it is not given."""
    node = data.get(section)
    if isinstance(node, BaseModel):
        return getattr(node, key, default)
    if isinstance(node, dict) and node.get(key) is not None:
        return node[key]
    return default


def _is_old_key(key: str, value: Any) -> bool:
    """Whether top-level ``key: value`` is a flat key of earlier releases (:data:`MOVED_KEYS`);
    ``schedule`` is the old key only with a text value (``schedule: async``, as it was); a
    mapping, nothing or any other value is the section of that name (a list is then reported as
    not a mapping, not as a bad ``schedule.mode``)."""
    return key in MOVED_KEYS and not (key == "schedule" and not isinstance(value, str))


def _warn_moved(source: str, moved: list[str]) -> None:
    """One warning for the old keys of one source, each with its new key."""
    if not moved:
        return
    if len(moved) <= 3:
        what = "; ".join(f"{k} is deprecated: use {MOVED_KEYS[k]}" for k in moved)
    else:  # a whole config of the old layout (a saved run config): one line, not 23 sentences
        what = "deprecated flat keys, read as their new keys: " + ", ".join(f"{k} -> {MOVED_KEYS[k]}" for k in moved)
    log.warning("%s: %s (the old keys are still read in this release)", source, what)


def upgrade_layout(data: dict[str, Any], source: str, warn: bool = True) -> dict[str, Any]:
    """``data`` (a run config's top level) with the flat keys of earlier releases moved to their
    sections (:data:`MOVED_KEYS`; ``num_steps: 10`` -> ``schedule: {num_steps: 10}``), and a
    warning naming each one and its new key. ``data`` itself is not changed.

    Args:
        source: what ``data`` came from, for the messages (``config file 'run.yaml'``).
        warn: log the warning (False: a saved run config, which the run itself wrote).

    Raises:
        ValueError: an old key and its new key are both given.
    """
    moved = [k for k, v in data.items() if _is_old_key(k, v)]
    if not moved:
        return data
    out = {k: v for k, v in data.items() if k not in moved}
    for old in moved:
        section, key = MOVED_KEYS[old].split(".")
        node = out.get(section)
        if isinstance(node, BaseModel):  # a built section: what was set in it, as data
            node = node.model_dump(exclude_unset=True)
        elif not isinstance(node, dict):
            node = {}
        if key in node:
            raise ValueError(
                f"{source}: {old} and {section}.{key} are both given; {old} is the old name of {section}.{key} "
                f"(deprecated): keep {section}.{key} only"
            )
        out[section] = {**node, key: data[old]}
    if warn:
        _warn_moved(source, moved)
    return out


def _merge_onto(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` (a config file) over ``base`` (a preset), key by key: a mapping merges into the
    preset's mapping, except one whose ``kind`` differs (another config class: it replaces the
    preset's); anything else replaces; an empty section line (None) keeps the preset's."""
    out = dict(base)
    for k, v in top.items():
        b = out.get(k)
        if isinstance(b, dict) and v is None:
            continue
        if isinstance(b, dict) and isinstance(v, dict) and v.get("kind", b.get("kind")) == b.get("kind"):
            out[k] = _merge_onto(b, v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _config_classes(annotation: Any, kind: Any) -> list[type[BaseModel]]:
    """The config classes a field's annotation admits (``X``, ``X | None``, a union of task
    configs); of a union, those whose ``kind`` accepts ``kind`` (the section's discriminator)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = [c for arg in get_args(annotation) for c in _config_classes(arg, kind)]
    if len(found) > 1:
        found = [c for c in found if "kind" in c.model_fields and kind in get_args(c.model_fields["kind"].annotation)]
    return found


def _refuse_boolean_counts(cls: type[BaseModel], data: dict[str, Any], prefix: str = "") -> None:
    """Refuse a YAML ``true`` / ``false`` given for an integer key, in any section: pydantic's lax
    int takes them as 1 / 0 (``checkpoint_every: true`` ran as 1, ``buffer.max_staleness: true``
    as 1).

    Raises:
        ValueError: names the key and the boolean.
    """
    for name, value in data.items():
        field = cls.model_fields.get(name)
        if field is None:
            continue  # unknown keys are reported by validation, with "did you mean"
        if isinstance(value, bool) and field.annotation in (int, int | None):
            raise ValueError(f"{prefix}{name} must be an integer, got {str(value).lower()} (a YAML boolean)")
        if isinstance(value, dict):
            for section in _config_classes(field.annotation, value.get("kind")):
                _refuse_boolean_counts(section, value, f"{prefix}{name}.")


def _refuse_empty_output_dir(data: dict[str, Any]) -> None:
    """Refuse an empty ``output_dir``: ``output_dir=`` on the command line (YAML null) read "Input
    should be a valid string", and ``output_dir=''`` wrote the run into the working directory.

    Raises:
        ValueError: ``output_dir`` is given as null, an empty or a blank string.
    """
    value = data.get("output_dir", "runs")
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError("output_dir is empty; give the directory the run writes to (e.g. output_dir=runs/my_run)")


def _section(data: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    """The raw mapping at ``path`` in ``data``, copied on the way down so the caller's input is
    not changed; None where the path is absent (the component's default applies) or holds a
    built config object (already validated)."""
    node = data
    for k in path:
        child = node.get(k)
        if not isinstance(child, dict):
            return None
        node[k] = child = dict(child)
        node = child
    return node


def _default_section(section: str) -> dict[str, Any] | None:
    """The run's default for a top-level section as raw data (``tokenizer`` of kind
    ``pretrained``, not a bare ``TokenizerConfig``), holding only the keys that default sets: a
    key left to the component's own default stays absent, so a run-level default can still fill it."""
    field = RunConfig.model_fields.get(section)
    value = None if field is None else field.get_default(call_default_factory=True)
    if not isinstance(value, BaseModel):
        return None
    out = value.model_dump(mode="json", exclude_unset=True)
    if section in _tagged_sections():
        out.setdefault("kind", value.kind)  # the tag says which config class the rest belongs to
    return out


def _set_unless_given(data: dict[str, Any], section: str, key: str, value: Any) -> None:
    """Set ``data[section][key] = value`` unless the user set that key; an absent section starts
    from the run's default for it."""
    node = data.get(section)
    if node is None:
        node = _default_section(section) or {}
    elif not isinstance(node, dict) or node.get(key) is not None:
        return
    data[section] = {**node, key: value}


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (PyYAML keeps the last one
    silently, so the first value a user wrote would be ignored without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (first at line {first.line + 1})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


# PyYAML reads YAML 1.1, where a float needs a dot: ``1e-06`` (what json.dumps writes into
# run_config.json) and ``lr: 1e-5`` would be strings, and a string reaches model.backbone as is.
# Floats of YAML 1.2's core schema resolve as floats here.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def _load_yaml(text: str, source: str, column_offset: int = 0) -> Any:
    """``yaml.safe_load`` whose syntax errors name ``source`` (a file or an override) and the line.

    ``column_offset`` is added to columns on the first line (an override's value starts after
    ``key=``, and the column should point into what the user typed).

    Raises:
        ValueError: ``<source> line L, column C: <what the parser expected>``.
    """
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)

        def at(m) -> str:
            return f"line {m.line + 1}, column {m.column + 1 + (column_offset if m.line == 0 else 0)}"

        where = f" {at(mark)}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e)
        context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and start is not None and start is not mark:
            what += f"; {context} at {at(start)}"
        kind = "JSON" if ".json'" in source or source.endswith(".json") else "YAML"  # JSON files are read as YAML
        raise ValueError(f"{source}{where}: not valid {kind} ({what})") from None


# A run config read from a pipe (``--config <(cat run.yaml)``) is read up to this size: a pipe that
# never ends (``<(yes)``) must not fill the memory.
MAX_PIPED_CONFIG_BYTES = 16 * 1024 * 1024


# how long a named pipe may wait for a process to write to it (a FIFO nobody writes to hung forever)
PIPE_WRITER_WAIT_S = 60.0


def _read_pipe(p: Path, what: str) -> bytes:
    """Up to ``MAX_PIPED_CONFIG_BYTES + 1`` bytes of the pipe ``p``, read to its end. Opened without
    blocking (a plain open waits for a writer forever), then waits up to ``PIPE_WRITER_WAIT_S`` for
    the first data; raises ``ValueError`` when none comes."""
    import select

    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(PIPE_WRITER_WAIT_S * 1000):
            raise ValueError(
                f"{what} is a named pipe that no process wrote to within {PIPE_WRITER_WAIT_S:g} s; write the "
                "config into it from another process, or give a YAML run config file"
            )
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= MAX_PIPED_CONFIG_BYTES and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_config_file(p: Path) -> str:
    """The text of a run config file, or of a pipe (process substitution, a named FIFO).

    Raises:
        ValueError: naming the path and what it is: a directory, absent, a link that loops or
            points nowhere, a device or socket (not read: ``/dev/zero`` never ends), a pipe that
            gave nothing (the command feeding it failed?) or too much, undecodable bytes.
    """
    what = f"config file {str(p)!r}"
    if p.is_dir():
        raise ValueError(f"{what} is a directory; give a YAML run config file (e.g. examples/cpu_demo.yaml)")
    if p.is_file():
        return read_utf8(p, what)
    kind = path_problem(p)
    if kind is None:
        raise ValueError(f"{what} does not exist")
    if "symbolic link" in kind:
        raise ValueError(f"{what} is {kind}; point the link at a YAML run config file, or give the file itself")
    if kind != "a pipe (FIFO)":
        raise ValueError(f"{what} is {kind}, not a file; give a YAML run config file (e.g. examples/cpu_demo.yaml)")
    try:  # a pipe: read what its writer sends (process substitution always has one)
        raw = _read_pipe(p, what)
    except OSError as e:
        raise ValueError(f"{what} (a pipe): cannot read it ({e.strerror or e})") from None
    if not raw:
        raise ValueError(
            f"{what} is a pipe that gave no data (did the command feeding it fail?); give a YAML run config file"
        )
    if len(raw) > MAX_PIPED_CONFIG_BYTES:
        raise ValueError(
            f"{what} is a pipe that gave more than {MAX_PIPED_CONFIG_BYTES // 2**20} MiB, too much for a run "
            "config; give a YAML run config file"
        )
    return _decode_utf8(raw, what)


def read_utf8(path: Path, what: str) -> str:
    """The text of ``path``; an undecodable byte or an unreadable file raises a ``ValueError``
    naming ``what`` (e.g. ``config file 'run.yaml'``) and the line of the byte."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read it ({e.strerror or e})") from None
    return _decode_utf8(raw, what)


def _decode_utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{what} line {line}: byte 0x{raw[e.start]:02x} is not UTF-8; save the file as UTF-8"
        ) from None


# An override is (key path, value, the text the user wrote).
_Override = tuple[list[str], Any, str]


def _parse_overrides(overrides: list[str]) -> list[_Override]:
    """Parse ``key.path=value`` overrides; an old flat key (``num_steps=10``) is read as its new
    one (``schedule.num_steps``), with a warning.

    Raises:
        ValueError: a malformed override, or an old key and its new key both given.
    """
    out = []
    moved: list[str] = []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        keys = [k.strip() for k in key.strip().split(".")]
        if not all(keys):
            raise ValueError(f"override {item!r}: empty key in {key!r}; write key.path=value")
        value = _load_yaml(raw, f"override {item!r}", column_offset=len(key) + 1)
        if len(keys) == 1 and _is_old_key(keys[0], value):
            moved.append(keys[0])
            keys = MOVED_KEYS[keys[0]].split(".")
        out.append((keys, value, item))
    for old in dict.fromkeys(moved):
        section, key = MOVED_KEYS[old].split(".")
        both = [
            item
            for keys, value, item in out
            if item.split("=", 1)[0].strip() != old
            and (keys == [section, key] or (keys == [section] and isinstance(value, dict) and key in value))
        ]
        if both:
            raise ValueError(
                f"overrides: {old} and {section}.{key} are both given ({both[0]!r}); {old} is the old name of "
                f"{section}.{key} (deprecated): keep {section}.{key} only"
            )
    _warn_moved("overrides", list(dict.fromkeys(moved)))
    return out


def _tagged_sections() -> set[str]:
    """Top-level sections whose ``kind`` selects the config class (a tagged union): another kind
    has other fields, so the old kind's keys do not carry over."""
    return {name for name, f in RunConfig.model_fields.items() if getattr(f, "discriminator", None) == "kind"}


def _apply_overrides(data: dict[str, Any], overrides: list[_Override]) -> dict[str, Any]:
    """Apply overrides in order onto the file's data (a deep copy is returned).

    - ``a.b=value`` sets one key and keeps the section's other keys. A section the file does not
      set starts from the run's default (``task.scoring=partial_chars`` keeps the default task's
      other keys).
    - ``a={...}`` (a whole mapping as the value) replaces the section: nothing of the file's or
      the default's section is kept (``task={kind: reverse_digits, num_digits: 8}``).
    - ``task.kind=other`` changes a tagged section's kind: the section keeps only the keys that
      overrides set, since the old kind's fields belong to another config class.

    Raises:
        ValueError: an override goes through a key that holds a value, not a section.
    """
    data = copy.deepcopy(data)
    tagged = _tagged_sections()
    set_by_override: set[tuple[str, ...]] = set()
    for keys, value, item in overrides:
        if len(keys) > 1 and data.get(keys[0]) is None:  # absent, or an empty `section:` line
            default = _default_section(keys[0])
            if default is not None:
                data[keys[0]] = default
        node = data
        for depth, k in enumerate(keys[:-1]):
            if node.get(k) is None:
                node[k] = {}
            child = node[k]
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {'.'.join(keys[: depth + 1])} holds a value, not a section")
            node = child
        last = keys[-1]
        if len(keys) == 2 and last == "kind" and keys[0] in tagged and node.get("kind") != value:
            whole = (keys[0],) in set_by_override
            kept = {k: v for k, v in node.items() if whole or (keys[0], k) in set_by_override}
            node.clear()
            node.update(kept)
        node[last] = copy.deepcopy(value)
        path = tuple(keys)
        # a replaced section forgets what earlier overrides set inside it
        set_by_override = {p for p in set_by_override if p[: len(path)] != path} | {path}
    return data


_NOT_GIVEN: Any = object()


def _take_preset(data: dict[str, Any], overrides: list[_Override], default: str | None) -> str | None:
    """The preset a run starts from: a ``preset=NAME`` override (the last one), else the file's
    ``preset:``, else ``default``; ``null`` means none. The ``preset`` entries are removed from
    ``data`` and ``overrides`` (a loading instruction, not a key of the run config)."""
    name = data.pop("preset", _NOT_GIVEN)
    for keys, value, item in list(overrides):
        if keys[0] != "preset":
            continue
        if len(keys) > 1:
            raise ValueError(f"override {item!r}: preset takes a name, e.g. preset=cpu_demo")
        name = value
        overrides.remove((keys, value, item))
    return default if name is _NOT_GIVEN else name


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, preset: str | None = None
) -> RunConfig:
    """Load and validate a run config.

    Layers, each over the one before: a preset (:mod:`splitrl.presets`, named by ``preset: NAME``
    in the file, a ``preset=NAME`` override, or the ``preset`` argument), then the file, whose
    mappings merge into the preset's key by key (see :func:`_merge_onto`), then the overrides.
    Without a preset, a section the file gives replaces the run's default section (its keys left
    out take their class defaults). Old flat keys are read with a warning (:data:`MOVED_KEYS`).

    Args:
        path: a YAML file (None: no file).
        overrides: ``key.path=value`` strings, applied in order; values are parsed as YAML
            (``3``, ``true``, ``[1,2]``); a mapping value replaces the whole section (see
            :func:`_apply_overrides`).
        preset: the preset to start from when neither the file nor the overrides name one
            (``splitrl train`` without ``--config`` passes ``cpu_demo``); None: the run's defaults.

    Raises:
        ValueError: a missing or unreadable file, YAML or UTF-8 errors (naming the file or the
            override and the line), a malformed override, an unknown preset, or any validation
            error (unknown key, wrong type, impossible combination), naming the key.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        what = f"config file {str(p)!r}"
        loaded = _load_yaml(_read_config_file(p), what)
        if loaded is None:  # an empty file (or only comments): a mistake, not "all defaults"
            raise ValueError(
                f"config file {str(p)!r} is empty (no keys): give it the run's keys (examples/*.yaml), or "
                "'preset: cpu_demo' for the CPU demo; `splitrl train` without --config runs that demo"
            )
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(p)!r} must hold a mapping at the top level")
        data = upgrade_layout(loaded, what)
    parsed = _parse_overrides(overrides or [])
    data = dict(data)
    name = _take_preset(data, parsed, preset)
    if name is not None:
        file = preset_path(name)
        base = _load_yaml(read_utf8(file, f"preset {name!r}"), f"preset {name!r} ({file})")
        data = _merge_onto(base, data)
    # keys, types and combinations first, without importing task libraries or torch: a typo is
    # reported in a fraction of a second; the second pass adds the checks that import them
    with deferred_import_checks():
        data = _apply_overrides(data, parsed)
        _validate(data)
    return _validate(data)


def _validate(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(explain_validation_error(e, RunConfig)) from None
