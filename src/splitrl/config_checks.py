"""Every check of a run config's own values, in one place: :class:`~splitrl.config.RunConfig`
runs :func:`check_run_config` on load, so an impossible combination or a path that is not there
is refused before anything starts.

- :func:`check_combinations`: settings of several sections that cannot run together, or would
  train on something other than what the user meant (or on nothing);
- :func:`check_paths`: the files and the device the config names exist (a model directory or
  ``.gguf`` file, a data file, ``output_dir`` not a file, a CUDA GPU for ``cluster.device=cuda``);
- :func:`settings_without_effect`: valid settings that together leave part of the run doing
  nothing (warned about by the preflight, not refused);
- :func:`mtp_warmup_problem`: also guards a :class:`~splitrl.train.TrainWorker` built directly.

What needs the model's config, the tokenizer, the task's data, the output directory's contents
or a checkpoint is checked by the preflight (:mod:`splitrl.controller.preflight`). Each message
names the key(s) to change, by their paths in the run config.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from splitrl._lazy import import_checks_deferred
from splitrl.rollout.config import DETERMINISTIC_DRAFT_VOCAB

if TYPE_CHECKING:
    from splitrl.config import RunConfig
    from splitrl.models import MTPConfig


def check_run_config(config: RunConfig) -> None:
    """All load-time checks of ``config``: combinations, then paths.

    Raises:
        ValueError: the first problem found, naming the keys.
    """
    check_combinations(config)
    check_paths(config)


def mtp_warmup_problem(warmup_steps: int, mtp: MTPConfig, prefix: str = "") -> str | None:
    """Why ``mtp_warmup_steps`` cannot run with these MTP heads (None: it can): the warm-up
    trains only the heads, so there must be heads that train.

    Args:
        prefix: the key paths' prefixes in the message (``train.`` / ``model.`` in a run config).
    """
    if not warmup_steps or (mtp.mtp_num_layers > 0 and mtp.mtp_loss_scaling_factor > 0):
        return None
    return (
        f"{prefix}mtp_warmup_steps={warmup_steps} trains only the MTP heads, but this model has none that train: "
        f"set model.mtp.mtp_num_layers >= 1 and model.mtp.mtp_loss_scaling_factor > 0, or {prefix}mtp_warmup_steps=0"
    )


def check_combinations(config: RunConfig) -> None:
    """Settings of several sections that cannot run together.

    Raises:
        ValueError: naming the keys and the ways out.
    """
    s, c, ck = config.schedule, config.cluster, config.checkpoint
    mtp = config.model.mtp
    if s.min_groups_per_chunk > s.groups_per_step:
        raise ValueError(
            f"schedule.min_groups_per_chunk={s.min_groups_per_chunk} > schedule.groups_per_step={s.groups_per_step}; "
            "a chunk cannot be larger than its step"
        )
    if config.buffer.capacity_groups < s.min_groups_per_chunk:
        raise ValueError(
            f"buffer.capacity_groups={config.buffer.capacity_groups} < schedule.min_groups_per_chunk="
            f"{s.min_groups_per_chunk}: the train pump would wait forever; raise the capacity"
        )
    problem = mtp_warmup_problem(config.train.mtp_warmup_steps, mtp, prefix="train.")
    if problem:
        raise ValueError(problem)
    if config.rollout.speculative and mtp.mtp_num_layers == 0:
        raise ValueError("rollout.speculative=true needs MTP heads: set model.mtp.mtp_num_layers >= 1")
    if s.mode == "sync" and config.buffer.max_staleness != 0:
        raise ValueError(
            f"schedule.mode=sync generates every step with the weights it trains (staleness 0), but "
            f"buffer.max_staleness={config.buffer.max_staleness}; set buffer.max_staleness=0, or "
            "schedule.mode=async to let generation run ahead"
        )
    if ck.export_every and not ck.every:
        raise ValueError(
            f"checkpoint.export_every={ck.export_every} needs intermediate checkpoints, but checkpoint.every=0 "
            "writes only the last one (which always has the export); set checkpoint.every (export_every must be a "
            "multiple of it), or checkpoint.export_every=0"
        )
    if ck.export_every and ck.export_every % ck.every:
        raise ValueError(
            f"checkpoint.export_every={ck.export_every} is not a multiple of checkpoint.every={ck.every}: the "
            "Hugging Face export is written into a checkpoint, so it can only happen at checkpoint steps; set "
            "checkpoint.export_every to a multiple of checkpoint.every, or checkpoint.export_every=0 (only at the end)"
        )
    if c.ray_address and c.backend == "local":
        raise ValueError(
            f"cluster.ray_address={c.ray_address!r} joins a Ray cluster, but cluster.backend=local runs without "
            "Ray; set cluster.backend=ray (or auto), or drop cluster.ray_address"
        )
    if c.backend == "local" and c.num_train_workers > 1:
        raise ValueError(
            "cluster.backend=local runs one train worker; use cluster.backend=ray for cluster.num_train_workers > 1"
        )
    if config.train.optim.offload == "cpu" and c.num_train_workers > 1:
        raise ValueError(
            f"train.optim.offload=cpu steps the optimizer of one process on the CPU, but cluster.num_train_workers="
            f"{c.num_train_workers} shards the model over several (FSDP2); set cluster.num_train_workers=1, or "
            "train.optim.offload=none"
        )
    if c.backend == "local" and config.dataplane.kind == "transferqueue":
        raise ValueError(
            "dataplane.kind=transferqueue needs cluster.backend=ray (TransferQueue runs on Ray); use "
            "dataplane.kind=inprocess"
        )
    if c.placement == "colocated" and c.num_generation_workers != c.num_train_workers:
        raise ValueError(
            f"cluster.placement=colocated puts one generation engine next to each train rank, but "
            f"cluster.num_generation_workers={c.num_generation_workers} != "
            f"cluster.num_train_workers={c.num_train_workers}; make them equal, or use cluster.placement=split "
            "(a GPU per worker)"
        )
    if c.placement == "split" and c.backend == "local":
        raise ValueError(
            "cluster.placement=split gives every worker a process (and a GPU) of its own, but cluster.backend=local "
            "runs them all in this process; use cluster.backend=ray, or cluster.placement=auto"
        )
    if config.train.device != "auto" and config.train.device != c.device:
        raise ValueError(
            f"train.device={config.train.device} differs from cluster.device={c.device}: a run places every "
            "worker on its device, so train.device would be ignored; set cluster.device instead and remove "
            "train.device"
        )
    _check_training_signal(config)


def _check_training_signal(config: RunConfig) -> None:
    """Settings that would train on something other than what the user meant, or on nothing."""
    if config.loss.temperature is not None and config.loss.temperature != config.rollout.temperature:
        raise ValueError(
            f"loss.temperature={config.loss.temperature} differs from rollout.temperature="
            f"{config.rollout.temperature}: the trainer would score the tokens at another temperature "
            "than they were sampled at. The temperature is set once, by rollout.temperature; remove "
            "loss.temperature (the trainer takes the rollout's)"
        )
    group_size = config.schedule.group_size
    need = config.advantage.min_group_size()
    if group_size < need:
        raise ValueError(
            f"schedule.group_size={group_size}: advantage.estimator={config.advantage.estimator} takes each "
            f"sample's baseline from its group, so a group needs at least {need} samples (with 1 every "
            f"advantage is 0 and nothing is learned); set schedule.group_size >= {need}"
        )
    D = config.model.mtp.mtp_num_layers
    n_draft = config.rollout.num_draft_tokens
    size = config.rollout.draft_vocab_size
    for key, value in (("num_draft_tokens", n_draft), ("draft_vocab_size", size)):
        if value is not None and not config.rollout.speculative:
            raise ValueError(
                f"rollout.{key}={value} is set but rollout.speculative=false: only speculative decoding "
                f"drafts tokens, so it would have no effect; set rollout.speculative=true, or remove rollout.{key} "
                f"(on the command line: rollout.{key}=null)"
            )
    if size is not None and config.rollout.deterministic:
        raise ValueError(DETERMINISTIC_DRAFT_VOCAB.format(size="rollout.draft_vocab_size", det="rollout.deterministic"))
    if config.rollout.speculative and n_draft is not None and n_draft > D:
        raise ValueError(
            f"rollout.num_draft_tokens={n_draft} > model.mtp.mtp_num_layers={D}: depth k drafts the "
            f"k-th token, so at most {D} can be drafted; set rollout.num_draft_tokens <= {D} (or null: all)"
        )
    if config.rollout.top_k == 1:
        raise ValueError(
            "rollout.top_k=1 samples the same response for every sample of a group: every group has "
            "zero reward variance, every advantage is 0 and nothing is learned; use top_k=0 (off) or >= 2 "
            "(for greedy samples from `splitrl generate` / `splitrl eval`, pass --greedy)"
        )


def check_paths(config: RunConfig) -> None:
    """The model path, the task's data file and ``output_dir`` are what the config says they are,
    and ``cluster.device=cuda`` has a GPU (skipped inside :func:`splitrl._lazy.deferred_import_checks`).

    Raises:
        ValueError: naming the key and what is at its path.
    """
    from splitrl.config_types import path_problem

    pretrained = config.model.pretrained_path
    gguf_file = str(pretrained or "").lower().endswith(".gguf")
    expected = "give a .gguf file or a Hugging Face model directory (one with config.json)"
    if gguf_file and not Path(pretrained).is_file():
        odd = path_problem(pretrained)  # a link that loops or points nowhere, a device
        if odd:
            raise ValueError(f"model.pretrained_path={pretrained!r} is {odd}; check the path")
        if Path(pretrained).is_dir():
            raise ValueError(f"model.pretrained_path={pretrained!r} is a directory, not a .gguf file; {expected}")
        raise ValueError(f"model.pretrained_path={pretrained!r}: no such GGUF file; check the path")
    if pretrained is not None and not gguf_file and not (Path(pretrained) / "config.json").is_file():
        odd = path_problem(pretrained)
        missing = not Path(pretrained).exists()
        if Path(pretrained).is_file():
            raise ValueError(f"model.pretrained_path={pretrained!r} is a file but not a .gguf file; {expected}")
        raise ValueError(
            f"model.pretrained_path={pretrained!r} "
            + (
                f"is {odd}"
                if odd
                else "does not exist"
                if missing
                else "has no config.json (not a Hugging Face model directory, nor a .gguf file)"
            )
            + "; check the path"
        )
    out = Path(config.output_dir)
    kind = path_problem(out)
    if kind is not None:  # mkdir said "File exists" for a link that loops or points nowhere
        raise ValueError(
            f"output_dir={config.output_dir!r} is {kind}; give a directory (it is created if needed)"
            + (", or remove the link" if "symbolic link" in kind else "")
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir={config.output_dir!r} is a file; give a directory (it is created if needed)")
    if any(p.exists() and not p.is_dir() for p in out.parents):
        raise ValueError(f"output_dir={config.output_dir!r} lies under a file; give a directory path")
    if (config.cluster.device == "cuda" or config.train.device == "cuda") and not import_checks_deferred():
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "cluster.device=cuda but no CUDA GPU is visible here; set cluster.device=auto or cluster.device=cpu"
            )
    task_path = getattr(config.task, "path", None)
    if task_path is not None and not Path(task_path).exists():
        odd = path_problem(task_path)  # a link that loops or points nowhere
        raise ValueError(
            f"task.path={task_path!r} {f'is {odd}' if odd else 'does not exist'}; "
            "point it at a JSONL / parquet file or a datasets directory"
        )


def settings_without_effect(config: RunConfig) -> list[str]:
    """Valid settings that, together, leave part of the run doing nothing (warned about by the
    preflight, not refused: each can be meant, e.g. training only the MTP heads)."""
    out = []
    s = config.schedule
    warm = config.train.mtp_warmup_steps
    if warm and warm >= s.num_steps:
        out.append(
            f"train.mtp_warmup_steps={warm} >= schedule.num_steps={s.num_steps}: only the MTP heads train in this "
            "run, the policy itself is never updated (lower mtp_warmup_steps to train the policy after the warm-up)"
        )
    ev = config.eval
    if ev.eval_every > s.num_steps and not ev.at_end:
        out.append(
            f"eval.eval_every={ev.eval_every} > schedule.num_steps={s.num_steps} and eval.at_end=false: this run "
            "never evaluates (lower eval.eval_every or set eval.at_end=true)"
        )
    if s.chunk_order == "arrival" and (config.buffer.max_staleness > 0 or s.mode == "sync"):
        why = (
            "schedule.mode=sync generates the whole step before it trains"
            if s.mode == "sync"
            else f"buffer.max_staleness={config.buffer.max_staleness} already takes groups as they arrive"
        )
        out.append(
            f"schedule.chunk_order=arrival has no effect: {why} (leave schedule.chunk_order at its default, prompt)"
        )
    return out
