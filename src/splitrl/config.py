"""The run configuration: one typed object made of the components' own configs.

A run is a YAML file (or nothing: the embedded CPU demo) plus ``key.path=value`` overrides. It is
validated on load — unknown keys, impossible combinations and missing files raise a
``ValueError`` that names the key, before anything starts.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import stat
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitrl._lazy import deferred_import_checks, import_checks_deferred
from splitrl.config_help import explain_validation_error
from splitrl.config_types import UserPath
from splitrl.controller.buffer import ReplayBufferConfig
from splitrl.dataplane import DataPlaneConfig
from splitrl.eval_config import EvalConfig
from splitrl.logging import LoggingConfig
from splitrl.loss.advantages import AdvantageConfig
from splitrl.loss.config import DEFAULT_TIS_CAP, RunGRPOLossConfig  # noqa: F401 - DEFAULT_TIS_CAP re-exported
from splitrl.loss.registry import run_loss_config_type, trainer_loss_config
from splitrl.models import ModelConfig, MTPConfig
from splitrl.rollout import GenerationConfig
from splitrl.tasks import TaskConfig, default_task_config
from splitrl.tasks.tokenizer import TokenizerConfig
from splitrl.train import MicrobatchConfig, OptimConfig, TrainConfig

# The characters of the demo task's prompts and answers ("desc 5,2,7=" -> "7,5,2"): a random-init
# policy over 22 symbols hits a right character 1 time in 22.
DEMO_CHARSET = " ,0123456789=acdes"


def demo_task_config():
    """The CPU demo's task: reasoning-gym ``number_sorting`` (3 numbers 0-9, compact prompts) with
    per-character partial credit, which a random-init policy gets signal from from the first step
    (strict match scores ~0 for hundreds of steps)."""
    return default_task_config().model_copy(update={"scoring": "partial_chars"})


def demo_model_config() -> ModelConfig:
    """The CPU demo's policy: a 2-layer Qwen3 (hidden 128) with one MTP depth, random init.

    A size that learns a compact reasoning-gym task by RL alone, from scratch, on 2 CPU cores.
    """
    return ModelConfig(
        family="qwen3",
        backbone={
            "vocab_size": 4 + len(DEMO_CHARSET),  # the demo's character tokenizer
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
        },
        mtp=MTPConfig(mtp_num_layers=1, mtp_loss_scaling_factor=0.3),
    )


RunLossConfig = run_loss_config_type()
"""The run's ``loss`` section: the options of the loss its ``kind`` names (``grpo`` when absent),
in the run's form (:class:`~splitrl.loss.config.RunGRPOLossConfig`: the temperature and the
truncated-IS cap derived from the run unless given). :meth:`RunConfig.trainer_loss_config`
resolves them; the registry of kinds is :mod:`splitrl.loss.registry`."""


class RunConfig(BaseModel):
    """Everything a ``splitrl train`` run needs.

    Attributes (run level; the rest are the components' configs):
        seed: seed of the run's sampling (each sample's seed derives from it, the prompt index and
            the sample index). The random init of the model has its own ``model.seed``.
        output_dir: metrics, TensorBoard, checkpoints, the resolved config and the plot.
        num_steps: optimizer steps of the run.
        groups_per_step / group_size: a step is ``groups_per_step`` prompts × ``group_size``
            samples (DESIGN §5).
        min_groups_per_chunk: the train pump streams chunks of at least this many complete groups.
        generation_groups_per_call: prompts per generation request.
        num_generation_workers / num_train_workers: actors (train workers are data-parallel ranks).
        backend: ``ray`` (actors on a Ray cluster, local one by default), ``local`` (objects in
            this process, threads), or ``auto`` (ray when importable).
        checkpoint_every: steps between checkpoints (0: only at the end).
        export_every: steps between Hugging Face exports (``policy/`` in the checkpoint, usable
            by ``splitrl eval`` / ``generate`` and plain transformers); 0 (default): only in the
            last checkpoint of the run (the end, or a stop). A multiple of ``checkpoint_every``:
            exports ride on checkpoints. A checkpoint without one holds the sharded trainer state
            only, which keeps it fast (the export gathers the full model on one rank and blocks).
        resume: continue from the latest checkpoint in ``output_dir`` when there is one.
        on_chunk_failure: ``retry`` the step (up to ``max_step_retries`` times) or ``stop``.
        max_step_retries: retries of a failed step with ``on_chunk_failure: retry``.
        watchdog_timeout_s: report a stall (and stop) when no step finishes for this long.
        reward_timeout_s: time limit of one answer check.
        mask_truncated: samples cut at the length limit get ``sample_mask = 0``.
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda``.
        rollout_dtype: dtype of the generation copy of the model.
        torch_threads: intra-op threads per actor (None: torch's default); on a 2-core machine 1
            lets generation and training use a core each.
        placement: where the workers run (:mod:`splitrl.controller.placement`). ``colocated``:
            each GPU hosts one train rank and one generation engine in one process
            (``num_generation_workers == num_train_workers``); weights are handed over on the
            device (a staging copy the engine takes at its next call). ``split``: every train rank and every generation worker has a GPU of its own
            (G + T GPUs); weights go from train rank 0 to the engines over NCCL in buckets,
            received beside generation into a staging copy (one more copy of the weights per
            engine) and switched in between two generation calls.
            ``auto`` (default): ``colocated`` with ``backend=ray`` on CUDA when the two counts
            are equal, otherwise ``split``; ``backend=local`` runs everything in this process
            (colocated). With ``backend=ray`` the GPUs Ray sees are checked before any worker
            starts. On CPU the placement only decides which workers share a process (the CPU
            ``split`` sync uses gloo).
        ray_address: join this existing Ray cluster (``auto``, ``host:port``, ``ray://...``;
            ``RAY_ADDRESS`` works too). None starts a local cluster that listens on 127.0.0.1 only.
        schedule: ``async`` (default): generation and training overlap — rollouts of a step are
            streamed into training in chunks as they finish, and with ``buffer.max_staleness > 0``
            generation runs ahead on older weights. ``sync``: a plain GRPO loop — generate the
            whole step with the current weights, then train it, then sync the weights; nothing is
            generated while training. ``buffer.max_staleness`` then defaults to 0, and another
            value is refused. It trains on the same samples with the same math as ``async`` at
            ``max_staleness: 0`` (the baseline that ``bench/bench_e2e.py`` measures the
            asynchronous speed-up against).
        chunk_order: at ``buffer.max_staleness: 0``, the order a step's chunks take its groups in:
            ``prompt`` (default; bitwise reproducible) or ``arrival`` (as they finish; more
            overlap, equal to ``prompt`` up to float rounding). With ``prompt`` a chunk waits for
            the group of its lowest untrained prompt index, and a resumed run reproduces the
            uninterrupted one. With ``arrival`` training starts as soon as any
            ``min_groups_per_chunk`` of the step's own groups are done (more overlap with
            generation when response lengths vary): the same groups, samples and math (the split
            step equals the synchronous step for any chunking, DESIGN §1) summed in another
            order, so not bitwise reproducible run to run. No effect with ``max_staleness > 0``
            (chunks then are by arrival anyway) or ``schedule: sync`` (the whole step is there
            before it trains).
        eval: held-out evaluation during training (:class:`~splitrl.eval_config.EvalConfig`).
    """

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    output_dir: UserPath = "runs/demo"
    num_steps: int = Field(300, ge=1)
    groups_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    min_groups_per_chunk: int = Field(4, ge=1)
    generation_groups_per_call: int = Field(4, ge=1)
    num_generation_workers: int = Field(1, ge=1)
    num_train_workers: int = Field(1, ge=1)
    backend: Literal["auto", "ray", "local"] = "auto"
    checkpoint_every: int = Field(50, ge=0)
    export_every: int = Field(0, ge=0)
    resume: bool = True
    on_chunk_failure: Literal["retry", "stop"] = "stop"
    max_step_retries: int = Field(1, ge=0)
    watchdog_timeout_s: float = Field(600.0, gt=0)
    reward_timeout_s: float = Field(5.0, gt=0)
    mask_truncated: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    rollout_dtype: Literal["fp32", "bf16"] = "fp32"
    torch_threads: int | None = Field(1, ge=1)
    ray_address: str | None = None
    schedule: Literal["async", "sync"] = "async"
    chunk_order: Literal["prompt", "arrival"] = "prompt"
    placement: Literal["auto", "colocated", "split"] = "auto"

    # defaults: the CPU demo (without an entropy bonus, or with std division at a high learning
    # rate, the tiny policy collapsed to one constant output)
    model: ModelConfig = Field(default_factory=demo_model_config)
    tokenizer: TokenizerConfig = Field(default_factory=lambda: TokenizerConfig(charset=DEMO_CHARSET))
    task: TaskConfig = Field(default_factory=demo_task_config)
    rollout: GenerationConfig = Field(default_factory=lambda: GenerationConfig(max_new_tokens=8, batch_size=256))
    loss: RunLossConfig = Field(default_factory=lambda: RunGRPOLossConfig(entropy_coef=0.02))
    train: TrainConfig = Field(
        default_factory=lambda: TrainConfig(
            # short samples: padded rows beat one long packed row (attention is quadratic in it)
            microbatch=MicrobatchConfig(micro_batch_size=128),
            optim=OptimConfig(lr=5e-4, max_grad_norm=1.0),
        )
    )
    advantage: AdvantageConfig = Field(default_factory=lambda: AdvantageConfig(normalize_std=False))
    buffer: ReplayBufferConfig = Field(default_factory=lambda: ReplayBufferConfig(capacity_groups=64, max_staleness=1))
    dataplane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="before")
    @classmethod
    def _run_level_defaults(cls, data: Any) -> Any:
        """Fill the component fields whose default is a run-level value *before* the components
        validate: a component's own check cannot see the run (``OptimConfig`` refuses cosine
        without ``total_steps``), so filling them afterwards comes too late.

        - ``train.optim.total_steps`` (cosine schedule) defaults to ``num_steps``;
        - ``dataplane.kind`` defaults to ``inprocess`` with ``backend=local`` (the only one it runs);
        - ``buffer.max_staleness`` defaults to 0 with ``schedule=sync`` (the only value it runs).
        """
        if not isinstance(data, dict):
            return data
        data = dict(data)
        _refuse_boolean_counts(cls, data)
        optim = _section(data, ("train", "optim"))
        if optim is not None and optim.get("schedule") == "cosine" and optim.get("total_steps") is None:
            optim["total_steps"] = data.get("num_steps", cls.model_fields["num_steps"].default)
        if data.get("backend") == "local":
            _set_unless_given(data, "dataplane", "kind", "inprocess")
        if data.get("schedule") == "sync":
            _set_unless_given(data, "buffer", "max_staleness", 0)
        return data

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        mtp = self.model.mtp
        if self.min_groups_per_chunk > self.groups_per_step:
            raise ValueError(
                f"min_groups_per_chunk={self.min_groups_per_chunk} > groups_per_step={self.groups_per_step}; "
                "a chunk cannot be larger than its step"
            )
        if self.buffer.capacity_groups < self.min_groups_per_chunk:
            raise ValueError(
                f"buffer.capacity_groups={self.buffer.capacity_groups} < min_groups_per_chunk="
                f"{self.min_groups_per_chunk}: the train pump would wait forever; raise the capacity"
            )
        if self.train.mtp_warmup_steps and (mtp.mtp_num_layers == 0 or mtp.mtp_loss_scaling_factor == 0):
            raise ValueError(
                f"train.mtp_warmup_steps={self.train.mtp_warmup_steps} trains only the MTP heads: set "
                "model.mtp.mtp_num_layers >= 1 and model.mtp.mtp_loss_scaling_factor > 0, or train.mtp_warmup_steps=0"
            )
        if self.rollout.speculative and mtp.mtp_num_layers == 0:
            raise ValueError("rollout.speculative=true needs MTP heads: set model.mtp.mtp_num_layers >= 1")
        if self.schedule == "sync" and self.buffer.max_staleness != 0:
            raise ValueError(
                f"schedule=sync generates every step with the weights it trains (staleness 0), but "
                f"buffer.max_staleness={self.buffer.max_staleness}; set buffer.max_staleness=0, or "
                "schedule=async to let generation run ahead"
            )
        if self.export_every and not self.checkpoint_every:
            raise ValueError(
                f"export_every={self.export_every} needs intermediate checkpoints, but checkpoint_every=0 writes "
                "only the last one (which always has the export); set checkpoint_every (export_every must be a "
                "multiple of it), or export_every=0"
            )
        if self.ray_address and self.backend == "local":
            raise ValueError(
                f"ray_address={self.ray_address!r} joins a Ray cluster, but backend=local runs without Ray; "
                "set backend=ray (or auto), or drop ray_address"
            )
        if self.export_every and self.export_every % self.checkpoint_every:
            raise ValueError(
                f"export_every={self.export_every} is not a multiple of checkpoint_every={self.checkpoint_every}: "
                "the Hugging Face export is written into a checkpoint, so it can only happen at checkpoint steps; "
                "set export_every to a multiple of checkpoint_every, or export_every=0 (only at the end)"
            )
        if self.backend == "local" and self.num_train_workers > 1:
            raise ValueError("backend=local runs one train worker; use backend=ray for num_train_workers > 1")
        if self.backend == "local" and self.dataplane.kind == "transferqueue":
            raise ValueError(
                "dataplane.kind=transferqueue needs backend=ray (TransferQueue runs on Ray); use dataplane.kind=inprocess"
            )
        if self.placement == "colocated" and self.num_generation_workers != self.num_train_workers:
            raise ValueError(
                f"placement=colocated puts one generation engine next to each train rank, but "
                f"num_generation_workers={self.num_generation_workers} != num_train_workers={self.num_train_workers}; "
                "make them equal, or use placement=split (a GPU per worker)"
            )
        if self.placement == "split" and self.backend == "local":
            raise ValueError(
                "placement=split gives every worker a process (and a GPU) of its own, but backend=local runs "
                "them all in this process; use backend=ray, or placement=auto"
            )
        gguf_file = str(self.model.pretrained_path or "").lower().endswith(".gguf")
        if gguf_file and not Path(self.model.pretrained_path).is_file():
            raise ValueError(f"model.pretrained_path={self.model.pretrained_path!r}: no such GGUF file; check the path")
        if (
            self.model.pretrained_path is not None
            and not gguf_file
            and not (Path(self.model.pretrained_path) / "config.json").is_file()
        ):
            odd = path_problem(self.model.pretrained_path)  # a link that loops or points nowhere, a device
            missing = not Path(self.model.pretrained_path).exists()
            raise ValueError(
                f"model.pretrained_path={self.model.pretrained_path!r} "
                + (
                    f"is {odd}"
                    if odd
                    else "does not exist"
                    if missing
                    else "has no config.json (not a Hugging Face model directory, nor a .gguf file)"
                )
                + "; check the path"
            )
        out = Path(self.output_dir)
        kind = path_problem(out)
        if kind is not None:  # mkdir said "File exists" for a link that loops or points nowhere
            raise ValueError(
                f"output_dir={self.output_dir!r} is {kind}; give a directory (it is created if needed)"
                + (", or remove the link" if "symbolic link" in kind else "")
            )
        if out.exists() and not out.is_dir():
            raise ValueError(f"output_dir={self.output_dir!r} is a file; give a directory (it is created if needed)")
        if any(p.exists() and not p.is_dir() for p in out.parents):
            raise ValueError(f"output_dir={self.output_dir!r} lies under a file; give a directory path")
        if (self.device == "cuda" or self.train.device == "cuda") and not import_checks_deferred():
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device=cuda but no CUDA GPU is visible here; set device=auto or device=cpu")
        task_path = getattr(self.task, "path", None)
        if task_path is not None and not Path(task_path).exists():
            odd = path_problem(task_path)  # a link that loops or points nowhere
            raise ValueError(
                f"task.path={task_path!r} {f'is {odd}' if odd else 'does not exist'}; "
                "point it at a JSONL / parquet file or a datasets directory"
            )
        return self

    @model_validator(mode="after")
    def _check_semantics(self) -> "RunConfig":
        """Settings that would train on something other than what the user meant, or on nothing."""
        if self.loss.temperature is not None and self.loss.temperature != self.rollout.temperature:
            raise ValueError(
                f"loss.temperature={self.loss.temperature} differs from rollout.temperature="
                f"{self.rollout.temperature}: the trainer would score the tokens at another temperature "
                "than they were sampled at. The temperature is set once, by rollout.temperature; remove "
                "loss.temperature (the trainer takes the rollout's)"
            )
        need = self.advantage.min_group_size()
        if self.group_size < need:
            raise ValueError(
                f"group_size={self.group_size}: advantage.estimator={self.advantage.estimator} takes each "
                f"sample's baseline from its group, so a group needs at least {need} samples (with 1 every "
                f"advantage is 0 and nothing is learned); set group_size >= {need}"
            )
        D = self.model.mtp.mtp_num_layers
        n_draft = self.rollout.num_draft_tokens
        if n_draft is not None and not self.rollout.speculative:
            raise ValueError(
                f"rollout.num_draft_tokens={n_draft} is set but rollout.speculative=false: only speculative "
                "decoding drafts tokens, so it would have no effect; set rollout.speculative=true, or remove "
                "rollout.num_draft_tokens"
            )
        if self.rollout.speculative and n_draft is not None and n_draft > D:
            raise ValueError(
                f"rollout.num_draft_tokens={n_draft} > model.mtp.mtp_num_layers={D}: depth k drafts the "
                f"k-th token, so at most {D} can be drafted; set rollout.num_draft_tokens <= {D} (or null: all)"
            )
        if self.train.device != "auto" and self.train.device != self.device:
            raise ValueError(
                f"train.device={self.train.device} differs from device={self.device}: a run places every "
                "worker on its device, so train.device would be ignored; set device instead and remove train.device"
            )
        if self.rollout.top_k == 1:
            raise ValueError(
                "rollout.top_k=1 samples the same response for every sample of a group: every group has "
                "zero reward variance, every advantage is 0 and nothing is learned; use top_k=0 (off) or >= 2 "
                "(for greedy samples from `splitrl generate` / `splitrl eval`, pass --greedy)"
            )
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
    """The run's default for a top-level section as raw data (the demo model, not a bare
    ``ModelConfig``), holding only the keys that default sets: a key left to the component's
    own default stays absent, so a run-level default can still fill it."""
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
        raise ValueError(f"{source}{where}: not valid YAML ({what})") from None


def path_problem(path: str | Path) -> str | None:
    """What ``path`` is when it is neither a regular file, a directory nor simply absent, for
    messages: a symbolic link that loops or points nowhere (for the link itself or a folder on the
    way to it), a pipe (FIFO), a character or block device, a socket. None otherwise."""
    p = Path(path)
    for part in [*reversed(p.parents), p]:
        try:
            os.stat(part)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"{'' if part == p else f'under {str(part)!r}, '}a symbolic link that loops (it leads back to itself)"
            if e.errno == errno.ENOENT and part.is_symlink():
                where = "" if part == p else f"under {str(part)!r}, "
                return f"{where}a symbolic link to {os.readlink(part)!r}, which does not exist"
            return None
    mode = os.stat(p).st_mode
    for test, kind in (
        (stat.S_ISFIFO, "a pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return None


# A run config read from a pipe (``--config <(cat run.yaml)``) is read up to this size: a pipe that
# never ends (``<(yes)``) must not fill the memory.
MAX_PIPED_CONFIG_BYTES = 16 * 1024 * 1024


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
        with p.open("rb") as f:
            raw = f.read(MAX_PIPED_CONFIG_BYTES + 1)
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
    out = []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        keys = [k.strip() for k in key.strip().split(".")]
        if not all(keys):
            raise ValueError(f"override {item!r}: empty key in {key!r}; write key.path=value")
        out.append((keys, _load_yaml(raw, f"override {item!r}", column_offset=len(key) + 1), item))
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


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load and validate a run config.

    Args:
        path: a YAML file (None: the embedded default).
        overrides: ``key.path=value`` strings, applied in order; values are parsed as YAML
            (``3``, ``true``, ``[1,2]``); a mapping value replaces the whole section (see
            :func:`_apply_overrides`).

    Raises:
        ValueError: a missing or unreadable file, YAML or UTF-8 errors (naming the file or the
            override and the line), a malformed override, or any validation error (unknown key,
            wrong type, impossible combination), naming the key.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        what = f"config file {str(p)!r}"
        loaded = _load_yaml(_read_config_file(p), what) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(p)!r} must hold a mapping at the top level")
        data = loaded
    # keys, types and combinations first, without importing task libraries or torch: a typo is
    # reported in a fraction of a second; the second pass adds the checks that import them
    with deferred_import_checks():
        data = _apply_overrides(data, _parse_overrides(overrides or []))
        _validate(data)
    return _validate(data)


def _validate(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(explain_validation_error(e, RunConfig)) from None
