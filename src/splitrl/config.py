"""The run configuration: one typed object made of the components' own configs.

A run is a YAML file (or nothing: the embedded CPU demo) plus ``key.path=value`` overrides. It is
validated on load — unknown keys, impossible combinations and missing files raise a
``ValueError`` that names the key, before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitrl._lazy import deferred_import_checks, import_checks_deferred
from splitrl.config_help import explain_validation_error
from splitrl.controller.advantages import AdvantageConfig
from splitrl.controller.buffer import ReplayBufferConfig
from splitrl.dataplane import DataPlaneConfig
from splitrl.eval_config import EvalConfig
from splitrl.logging import LoggingConfig
from splitrl.loss import GRPOLossConfig, LossType
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

    The size FINDINGS.md measured learning a compact reasoning-gym task by RL alone on 2 cores.
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


class RunConfig(BaseModel):
    """Everything a ``splitrl train`` run needs.

    Attributes (run level; the rest are the components' configs):
        seed: seed of the run (model init, per-sample sampling seeds).
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
        eval: held-out evaluation during training (:class:`~splitrl.eval_config.EvalConfig`).
    """

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    output_dir: str = "runs/demo"
    num_steps: int = Field(300, ge=1)
    groups_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    min_groups_per_chunk: int = Field(4, ge=1)
    generation_groups_per_call: int = Field(4, ge=1)
    num_generation_workers: int = Field(1, ge=1)
    num_train_workers: int = Field(1, ge=1)
    backend: Literal["auto", "ray", "local"] = "auto"
    checkpoint_every: int = Field(50, ge=0)
    resume: bool = True
    on_chunk_failure: Literal["retry", "stop"] = "stop"
    max_step_retries: int = Field(1, ge=0)
    watchdog_timeout_s: float = Field(600.0, gt=0)
    reward_timeout_s: float = Field(5.0, gt=0)
    mask_truncated: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    rollout_dtype: Literal["fp32", "bf16"] = "fp32"
    torch_threads: int | None = Field(1, ge=1)

    # defaults: the CPU demo (FINDINGS.md: an entropy bonus and no std division keep the tiny
    # policy from collapsing to one answer)
    model: ModelConfig = Field(default_factory=demo_model_config)
    tokenizer: TokenizerConfig = Field(default_factory=lambda: TokenizerConfig(charset=DEMO_CHARSET))
    task: TaskConfig = Field(default_factory=demo_task_config)
    rollout: GenerationConfig = Field(default_factory=lambda: GenerationConfig(max_new_tokens=8, batch_size=256))
    loss: GRPOLossConfig = Field(default_factory=lambda: GRPOLossConfig(entropy_coef=0.02))
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

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        mtp = self.model.mtp
        if (
            self.loss.loss_type == LossType.SEQUENCE_LEVEL
            and mtp.mtp_num_layers > 0
            and not mtp.mtp_detach_heads
            and mtp.mtp_loss_scaling_factor > 0
        ):
            raise ValueError(
                "loss.loss_type=sequence_level with model.mtp.mtp_detach_heads=false and "
                f"model.mtp.mtp_loss_scaling_factor={mtp.mtp_loss_scaling_factor} > 0 cannot be trained exactly "
                "(two denominators inside the backbone gradient). Set model.mtp.mtp_detach_heads=true, or "
                "loss.loss_type=token_level (or mtp_loss_scaling_factor=0 for metrics-only heads)."
            )
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
        if self.backend == "local" and self.num_train_workers > 1:
            raise ValueError("backend=local runs one train worker; use backend=ray for num_train_workers > 1")
        if self.backend == "local" and self.dataplane.kind == "transferqueue":
            raise ValueError("dataplane.kind=transferqueue needs backend=ray (TransferQueue runs on Ray); use dataplane.kind=inprocess")
        if self.model.pretrained_path is not None and not (Path(self.model.pretrained_path) / "config.json").is_file():
            raise ValueError(f"model.pretrained_path={self.model.pretrained_path!r} has no config.json; check the path")
        out = Path(self.output_dir)
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
            raise ValueError(f"task.path={task_path!r} does not exist; point it at a JSONL / parquet file or a datasets directory")
        if self.train.optim.schedule == "cosine" and self.train.optim.total_steps is None:
            self.train.optim.total_steps = self.num_steps
        return self


def _parse_overrides(overrides: list[str]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        keys = key.strip().split(".")
        node = nested
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {k!r} was set to a value above, not a section")
            node = child
        node[keys[-1]] = yaml.safe_load(raw)
    return nested


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge overrides into the file's data. A section the file does not set starts from
    its default (so ``task.scoring=partial_chars`` keeps the default task's other keys), unless
    the override changes the section's ``kind`` (``task.kind=math_file``): then it starts empty."""
    default = None
    for section, value in overrides.items():
        if isinstance(value, dict) and section not in data:
            default = default or RunConfig().model_dump(mode="json")
            base = default.get(section)
            if isinstance(base, dict) and ("kind" not in value or value["kind"] == base.get("kind")):
                data[section] = base
    return _merge(data, overrides)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load and validate a run config.

    Args:
        path: a YAML file (None: the embedded default).
        overrides: ``key.path=value`` strings; values are parsed as YAML (``3``, ``true``, ``[1,2]``).

    Raises:
        ValueError: a missing file, a malformed override, or any validation error (unknown key,
            wrong type, impossible combination), naming the key.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
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

