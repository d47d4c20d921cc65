"""The preflight (DESIGN §4): every check that needs more than the config's own fields, run
before any worker starts.

The config validates its own fields and their combinations on load (:mod:`splitrl.config_checks`);
what needs the model's config, the tokenizer, the task, the output directory or a checkpoint on
disk is checked here. Each check raises a ``ValueError`` that names the config key to change, so
that a run with a bad model, tokenizer, prompt set, output directory or resume stops in seconds
with one message instead of inside a worker's traceback after the cluster has started.
:func:`preflight` runs them in order, and warns about the valid settings that together do nothing
(:func:`splitrl.config_checks.settings_without_effect`).

Light on import (no torch): the CLI imports :func:`model_hf_config` from here.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from splitrl.config import RunConfig, upgrade_layout
from splitrl.config_checks import settings_without_effect
from splitrl.controller.run_checkpoint import (
    KEPT_CHECKPOINTS,
    RUN_CONFIG,
    checkpoint_root,
    checkpoint_step,
    complete_checkpoints,
    format_bytes,
    latest_intact_checkpoint,
    unusable_checkpoints,
)
from splitrl.logging.wandb_logger import check_credentials as check_wandb_credentials

log = logging.getLogger(__name__)
# the run's progress is told by the controller's logger (users and tests follow it)
progress = logging.getLogger("splitrl.controller.controller")

# a procedural task has no end: this many of its first prompts are checked
PROCEDURAL_PROMPTS_CHECKED = 64
# a watchdog_timeout_s below this is warned about: no step of any model is that quick for sure
WATCHDOG_WARN_BELOW_S = 10.0


def check_output_dir(output_dir: str) -> None:
    """Create ``output_dir`` (and its parents), write a probe file there, and check that the
    run's own entries in it, where they exist, are of their kind (``checkpoints/`` and
    ``tensorboard/`` directories; ``metrics.jsonl``, ``metrics.png``, ``config.yaml`` files).

    Raises:
        ValueError: ``output_dir=...: cannot create / write ... (<OS reason>)``, or names the entry
            of the wrong kind (a file named ``checkpoints`` failed only at the first checkpoint,
            after the steps before it had trained).
    """
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"output_dir={output_dir!r}: cannot create it ({e.strerror or e}); choose a directory you can write to"
        ) from None
    try:
        with tempfile.TemporaryFile(dir=out) as f:
            f.write(b"splitrl")
            f.flush()
    except OSError as e:
        raise ValueError(
            f"output_dir={output_dir!r}: cannot write there ({e.strerror or e}); choose a directory you can write to"
        ) from None
    from splitrl.logging.logger import CONFIG_FILE, METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR

    for path, is_dir in [
        (checkpoint_root(out), True),
        (out / TENSORBOARD_DIR, True),
        (out / METRICS_FILE, False),
        (out / PLOT_FILE, False),
        (out / CONFIG_FILE, False),
    ]:
        if path.exists() and path.is_dir() != is_dir:
            raise ValueError(
                f"output_dir={output_dir!r}: {path} is a {'directory' if path.is_dir() else 'file'}, but the run writes "
                f"its {path.name} there as a {'directory' if is_dir else 'file'}; move it away, or choose another output_dir"
            )


def model_hf_config(config: RunConfig) -> Any:
    """The transformers config of the run's policy, after checking what a worker would only find
    when it builds the model.

    From ``model.backbone``: every key must be one the family's config knows (transformers keeps a
    misspelt one silently), every size a positive integer, and transformers must accept the values
    (:func:`splitrl.models.backbone_checks.backbone_hf_config`, as ``PolicyModel.from_config``
    checks them); a backbone that lacks size keys must not come out large by transformers' defaults
    (see :func:`splitrl.models.policy.check_defaulted_size`). From ``model.pretrained_path``: the
    weight files must be whole and fit the config and ``model.mtp`` (see
    :func:`splitrl.models.checkpoint.verify_pretrained`), and the family must be supported. Both:
    the shape must be one a model can have (:func:`splitrl.models.backbone_checks.check_backbone_shape`:
    sizes >= 1, attention head counts that divide, ``rms_norm_eps`` > 0, experts per token within
    the experts).

    Raises:
        ValueError: naming ``model.backbone`` / ``model.pretrained_path``.
    """
    from splitrl.models.backbone_checks import backbone_hf_config, check_backbone_shape

    m = config.model
    if m.pretrained_path is not None:
        from transformers import AutoConfig

        from splitrl.models.checkpoint import verify_pretrained
        from splitrl.models.families import SUPPORTED_FAMILIES
        from splitrl.models.gguf import resolve_model_path

        path = resolve_model_path(m.pretrained_path)  # a .gguf file: its converted directory
        verify_pretrained(path, mtp=m.mtp)
        hf_cfg = AutoConfig.from_pretrained(path)
        key = f"model.pretrained_path={m.pretrained_path!r} (config.json)"
        if hf_cfg.model_type not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"{key}: model_type {hf_cfg.model_type!r} is not supported; use a {' or '.join(SUPPORTED_FAMILIES)} "
                "model (their decoder layers and RMSNorm are reused by the MTP heads)"
            )
        check_backbone_shape(hf_cfg, key)
    else:
        from splitrl.models.policy import check_defaulted_size

        key = "model.backbone"
        hf_cfg = backbone_hf_config(m)  # the keys, sizes and shape, as PolicyModel.from_config checks them

        missing = check_defaulted_size(m, hf_cfg)
        if missing:  # allowed (the model stays near the size given), but not what the file says
            log.warning(
                "%s lacks %s: transformers' %s defaults are used (%s); give them to silence this",
                key,
                ", ".join(missing),
                m.family,
                ", ".join(f"{k}={getattr(hf_cfg, k)}" for k in missing),
            )
    return hf_cfg


def check_memory(config: RunConfig, hf_cfg: Any) -> None:
    """The trainer's parameters, gradients and optimizer state, and one microbatch's activations,
    must fit the memory they train in — checked from the shapes before any worker starts.

    The count and bytes are the memory planner's (:mod:`splitrl.train.memory_plan`): parameters
    from the config's shapes by arithmetic (no model is built, nothing is allocated), bytes a
    parameter from the precision and ``train.optim.offload``, activations of the smallest
    microbatch the run can cut (the configured token budget, ``auto``: 1024 tokens, by sample
    count: ``micro_batch_size`` × ``rollout.max_new_tokens``), with activation checkpointing
    unless it is forced off. The memory is, on CUDA, the free memory of the first GPU (NVML
    when the workers run in other processes, so that this process makes no CUDA context there;
    no check without NVML), and on CPU the host's available memory, which every train worker of
    the run shares. The worker's own plan (at start-up) then chooses its settings within it.

    Raises:
        ValueError: one line: the parameter count, the bytes needed, the memory available, and
            what to change; also for ``train.optim.offload=cpu`` with several train workers.
    """
    from splitrl.train.memory_plan import (
        GiB,
        ModelShape,
        cuda_free_memory,
        estimate_peak,
        format_count,
        host_available_memory,
        state_layout,
    )

    m, t = config.model, config.train
    key = "model.pretrained_path" if m.pretrained_path is not None else "model.backbone"
    device = config.cluster.device if config.cluster.device != "auto" else t.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = config.cluster.num_train_workers
    try:
        layout = state_layout(
            t.precision, offload=t.optim.offload, compute_weight_copy=t.speed.compute_weight_copy, world_size=ranks
        )
    except ValueError as e:
        raise ValueError(f"{e} (cluster.num_train_workers={ranks})") from None
    shape = ModelShape.from_hf_config(hf_cfg, m.mtp)
    budget = t.microbatch.max_tokens_per_microbatch
    if budget == "auto":
        tokens = 1024
    elif budget is None:
        tokens = t.microbatch.micro_batch_size * config.rollout.max_new_tokens
    else:
        tokens = budget
    est = estimate_peak(
        shape,
        tokens,
        layout,
        checkpointing=t.speed.activation_checkpointing is not False,
        fused_head=t.speed.fused_head_kernels and device == "cuda",
        device_type=device,
    )
    if device == "cuda":
        available, source = cuda_free_memory(0, create_context=config.cluster.backend == "local")
        need, where = est.peak, "the GPU (one train worker's share)"
    else:
        available, source = host_available_memory()
        # the ranks share the host: the sharded state once, every rank's gathered copies and activations
        need = est.peak * ranks
        where = "this machine" + (f" ({ranks} train workers)" if ranks > 1 else "")
    if available is None or need <= available:
        return
    p = shape.parameter_count()
    sizes = ", ".join(
        f"{k}={getattr(hf_cfg, k)}" for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    )
    fixes = [f"make the model smaller ({key}: {sizes})"]
    if p.mtp > p.backbone:
        H = shape.hidden_size
        fixes.append(
            f"fewer MTP depths (model.mtp.mtp_num_layers={m.mtp.mtp_num_layers}; each depth's fc alone is "
            f"2·hidden_size² = {format_count(2 * H * H)} parameters)"
        )
    if device == "cuda" and t.optim.offload == "none" and ranks == 1:
        fixes.append(f"set train.optim.offload=cpu ({state_layout(t.precision, offload='cpu').device_trainable:g} bytes a parameter on the GPU)")
    if device == "cuda":
        fixes.append("use more train workers (FSDP2 shards the state)")
    if t.precision == "fp32" and device == "cuda":
        fixes.append("train.precision=bf16")
    raise ValueError(
        f"{key}: the policy has {format_count(p.total)} parameters (backbone {format_count(p.backbone)}, MTP "
        f"{format_count(p.mtp)}) and training it needs {need / GiB:.1f} GiB ({layout.device_trainable:g} bytes a "
        f"parameter: {layout.parts}; + {est.activations / GiB:.2f} GiB of activations for a microbatch of {tokens} "
        f"tokens), but {where} has {available / GiB:.1f} GiB {source}: " + "; or ".join(fixes)
    )


# files one of which a Hugging Face tokenizer directory holds (transformers builds an empty
# tokenizer, without an error, from a directory that has none)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_checked_tokenizer(config: RunConfig) -> Any:
    """The run's tokenizer, loaded as the workers load it.

    Raises:
        ValueError: naming ``tokenizer.path`` / ``model.pretrained_path``: the directory has no
            tokenizer files, or transformers cannot load it.
    """
    from splitrl.workers.generation import load_tokenizer

    tc = config.tokenizer
    where = tc.path or config.model.pretrained_path
    key = "tokenizer.path" if tc.path else "model.pretrained_path (tokenizer.path unset)"
    if tc.kind == "pretrained" and where is None:
        raise ValueError(
            "tokenizer.kind=pretrained needs a tokenizer directory, and neither tokenizer.path nor "
            "model.pretrained_path is set: set tokenizer.path (or model.pretrained_path, whose tokenizer is used), "
            "or use tokenizer.kind=char"
        )
    if tc.kind == "pretrained" and where is not None and Path(where).is_dir():
        if not any((Path(where) / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(
                f"tokenizer.kind=pretrained: {key}={where!r} has no tokenizer files (one of {list(_TOKENIZER_FILES)}); "
                "set tokenizer.path to the model's tokenizer directory"
            )
    try:
        return load_tokenizer(tc, config.model.pretrained_path)
    except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise several kinds for a bad directory
        raise ValueError(f"tokenizer.kind={tc.kind}: cannot load a tokenizer from {key}={where!r} ({e})") from None


def check_vocab(config: RunConfig, tokenizer: Any, hf_cfg: Any) -> None:
    """The model's embedding must have a row for every id the tokenizer can produce, every
    ``rollout.stop_token_ids`` entry must be an id the model can sample, and
    ``rollout.draft_vocab_size`` can be at most the model's vocabulary.

    Raises:
        ValueError: naming ``rollout.stop_token_ids``, ``rollout.draft_vocab_size``,
            ``model.backbone.vocab_size`` (random init) or the tokenizer/model paths.
    """
    vocab = getattr(hf_cfg, "vocab_size", None)
    if vocab is None:
        return
    size = config.rollout.draft_vocab_size
    if size is not None and size > vocab:
        model = "model.backbone.vocab_size" if config.model.pretrained_path is None else "the model's vocab_size"
        raise ValueError(
            f"rollout.draft_vocab_size={size} exceeds {model}={vocab}; set rollout.draft_vocab_size <= {vocab}, "
            "or rollout.draft_vocab_size=null to draft from the whole vocabulary"
        )
    beyond = [t for t in config.rollout.stop_token_ids if t >= vocab]
    if beyond:
        raise ValueError(
            f"rollout.stop_token_ids {beyond} are not below the model's vocab_size={vocab}: they can never be "
            "sampled, so they would never stop a response; use ids the model has"
        )
    n = len(tokenizer)
    if n <= vocab:
        return
    if config.model.pretrained_path is None:
        raise ValueError(
            f"model.backbone.vocab_size={vocab} is smaller than the tokenizer's {n} tokens "
            f"(tokenizer.kind={config.tokenizer.kind}); set model.backbone.vocab_size >= {n}"
        )
    raise ValueError(
        f"the tokenizer has {n} tokens but model.pretrained_path={config.model.pretrained_path!r} has "
        f"vocab_size={vocab}; use the model's own tokenizer (tokenizer.kind=pretrained, tokenizer.path unset "
        "or pointing at the model's tokenizer)"
    )


def fit_prompts_to_context(config: RunConfig, task: Any, tokenizer: Any, hf_cfg: Any) -> Any:
    """Prompt tokens + ``rollout.max_new_tokens`` must fit the model's ``max_position_embeddings``.

    A data file (``task.kind=math_file``): every row is checked; rows that do not fit are left
    out (added to ``task.skip_rows``), counted and named in one warning. A generated task: its
    first :data:`PROCEDURAL_PROMPTS_CHECKED` prompts are checked and one that does not fit is an
    error (its settings make such prompts; there is no row to leave out).

    Returns:
        The task config to run with (``config.task`` itself when nothing was dropped).

    Raises:
        ValueError: ``rollout.max_new_tokens`` alone does not fit, a generated prompt does not fit,
            or no row of a data file fits.
    """
    from splitrl.tasks import MathFileTask, render_prompt

    max_pos = getattr(hf_cfg, "max_position_embeddings", None)
    if max_pos is None:
        return config.task
    new = config.rollout.max_new_tokens
    context = (
        f"the model's max_position_embeddings={max_pos} "
        f"({'config.json of model.pretrained_path' if config.model.pretrained_path else 'model.backbone'})"
    )
    limits = f"prompt tokens + rollout.max_new_tokens={new} exceed {context}"
    if new >= max_pos:
        raise ValueError(f"no prompt fits: rollout.max_new_tokens={new} leaves no room in {context}; lower it")
    n = task.num_prompts
    count = n if isinstance(task, MathFileTask) else min(PROCEDURAL_PROMPTS_CHECKED, n or PROCEDURAL_PROMPTS_CHECKED)
    prompts = [task.get_prompt(i) for i in range(count)]
    has_template = bool(getattr(tokenizer, "chat_template", None))
    option = getattr(task.config, "chat_template", None)  # the task's chat_template (None: auto)
    templated = has_template if option is None else option
    # tokenized as encode_prompt does (special tokens once), in one batch call
    encoded = tokenizer(
        [render_prompt(p, tokenizer) if templated else p.text for p in prompts], add_special_tokens=not templated
    )
    lengths = [len(ids) for ids in encoded["input_ids"]]
    empty = [p for p, k in zip(prompts, lengths) if k == 0]
    if empty:
        raise ValueError(
            f"prompt {empty[0].index} of the task ({empty[0].text[:60]!r}) encodes to no tokens; check the tokenizer "
            f"(tokenizer.kind={config.tokenizer.kind}) and the task's prompt column"
        )
    too_long = [(p, k) for p, k in zip(prompts, lengths) if k + new > max_pos]
    if not too_long:
        return config.task
    if not isinstance(task, MathFileTask):
        p, k = too_long[0]
        raise ValueError(
            f"prompt {p.index} of the task ({k} tokens: {p.text[:60]!r}): {limits}; lower "
            "rollout.max_new_tokens, make the task's prompts shorter, or raise the model's context"
        )
    if len(too_long) == len(prompts):
        raise ValueError(
            f"no row of task.path={config.task.path!r} fits: {limits} for every row (shortest prompt "
            f"{min(lengths)} tokens); lower rollout.max_new_tokens"
        )
    rows = sorted(p.metadata["row"] for p, _ in too_long)
    shown = ", ".join(f"{task.row_label(p.metadata['row'])} ({k} tokens)" for p, k in too_long[:10])
    log.warning(
        "task.path=%r: %d of %d rows left out (%s): %s%s",
        config.task.path,
        len(rows),
        len(prompts) + len(config.task.skip_rows),
        limits,
        shown,
        "" if len(rows) <= 10 else f" and {len(rows) - 10} more",
    )
    return config.task.model_copy(update={"skip_rows": sorted(set(config.task.skip_rows) | set(rows))})


def prompt_reuse(config: RunConfig, num_prompts: int | None) -> list[str]:
    """Warnings when the run draws a prompt of a finite task more than once (prompt index ``i``
    is the task's prompt ``i mod num_prompts``): within one step (its groups then repeat the same
    prompts, e.g. ``task.size=3`` with 16 groups a step), or over the whole run (``schedule.num_steps x
    groups_per_step`` groups: more than one epoch, often meant; the softer of the two). Each
    gives the numbers: prompts in the task, groups per step, steps, draws per prompt.

    Args:
        num_prompts: the task's prompts (rows left out not counted); None: an unbounded task.
    """
    if not num_prompts:
        return []
    n, per_step, steps = num_prompts, config.schedule.groups_per_step, config.schedule.num_steps
    total = steps * per_step
    size_key = "task.size" if "size" in type(config.task).model_fields else "the task's prompts (rows)"

    def times(draws: int) -> str:  # how often each prompt is drawn in ``draws`` consecutive indices
        low, high = draws // n, -(-draws // n)
        return f"{low} times" if low == high else f"{low} or {high} times"

    if per_step > n:
        return [
            f"the task has {n} prompts and schedule.groups_per_step={per_step}: every step draws each prompt {times(per_step)} "
            f"(prompt index mod {n}), so its {per_step} groups repeat the same {n} prompts, and over schedule.num_steps={steps} "
            f"each prompt is drawn {times(total)}; use a task with at least {per_step} prompts ({size_key}), or "
            f"schedule.groups_per_step <= {n}"
        ]
    if total > n:
        return [
            f"the task has {n} prompts and this run draws schedule.num_steps={steps} x groups_per_step={per_step} = {total} "
            f"groups: each prompt is trained {times(total)} ({total / n:.1f} epochs); fine if meant, else give the task "
            f"more prompts ({size_key}) or lower schedule.num_steps to {n // per_step} for one epoch"
        ]
    return []


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest intact checkpoint directory of a run, or None (a damaged newer one is skipped
    with a warning; see :mod:`splitrl.controller.run_checkpoint`)."""
    return latest_intact_checkpoint(output_dir)


def preflight(config: RunConfig) -> int:
    """Checks that need more than the config's own fields, run before any worker starts.

    Checks that ``output_dir`` can be written; verifies the model's config (head counts) and a
    ``pretrained_path``'s weight files, and that the trainer's state fits the memory
    (:func:`check_memory`); builds the task (a data file that is missing, lacks its
    columns or is not UTF-8 fails here) and the tokenizer, which must fit the model's vocabulary;
    checks that a character tokenizer covers the task's prompts and that prompts fit the context
    (rows of a data file that do not are left out: ``config.task`` is updated and a warning names
    them); warns when the run draws a prompt more than once (:func:`prompt_reuse`) or has a
    watchdog shorter than ``WATCHDOG_WARN_BELOW_S``; when resuming, checks that the checkpoint was
    written by the same model, tokenizer and ``schedule.groups_per_step`` (other changed settings are
    logged) and that ``metrics.jsonl`` is a record the run can extend; and compares the size of
    the run's checkpoints with the free space of ``output_dir`` (:func:`check_checkpoint_space`).
    An ``output_dir`` that the write check created is removed again (if still empty), with the
    parents it created, when a check fails. Returns the step to resume from (0: a fresh run).

    Raises:
        ValueError: naming what to fix.
    """
    out = Path(config.output_dir).absolute()
    created = [d for d in (out, *out.parents) if not d.exists()]  # deepest first
    try:
        step = _preflight(config)
        if config.checkpoint.resume and config.logging.jsonl:
            # the logger reads it too, but only once the workers are up (a foreign file there was
            # reported ~20 s after the start: a new user's trial)
            from splitrl.logging.logger import check_metrics_record

            check_metrics_record(config.output_dir, step + 1)
    except BaseException:
        # the write check created output_dir (and its missing parents): a refused run leaves no
        # empty directory behind
        for d in created:
            try:
                d.rmdir()
            except OSError:  # not empty (a file appeared meanwhile) or gone: keep it and those above
                break
        raise
    return step


def _preflight(config: RunConfig) -> int:
    from splitrl.models.gguf import resolve_model_files
    from splitrl.tasks import encode_prompt, make_task

    resolve_model_files(config)  # a .gguf pretrained_path becomes its converted directory, once
    check_output_dir(config.output_dir)
    check_wandb_credentials(config.logging.wandb)
    for warning in settings_without_effect(config):
        log.warning(warning)
    if config.faults.watchdog_timeout_s < WATCHDOG_WARN_BELOW_S:
        log.warning(
            "faults.watchdog_timeout_s=%g s: the run stops with a watchdog report as soon as generation, a train call or a "
            "weight sync takes longer, and the first step alone takes seconds even for the tiny demo; raise "
            "faults.watchdog_timeout_s (default 600)",
            config.faults.watchdog_timeout_s,
        )
    hf_cfg = model_hf_config(config)
    task = make_task(config.task)
    tok = load_checked_tokenizer(config)
    check_vocab(config, tok, hf_cfg)
    encode_prompt(task.get_prompt(0), tok, task.config.chat_template)  # task.chat_template=true needs a template
    if config.tokenizer.kind == "char":
        check_charset_covers_prompts(task, tok)
    task_config = fit_prompts_to_context(config, task, tok, hf_cfg)
    # from the shapes, before anything is built; after the context check, whose message names the
    # cause when rollout.max_new_tokens alone makes a microbatch absurd
    check_memory(config, hf_cfg)
    num_prompts = task.num_prompts
    if task_config is not config.task:
        if num_prompts is not None:  # less the rows just left out
            skipped = set(getattr(task_config, "skip_rows", ())) - set(getattr(config.task, "skip_rows", ()))
            num_prompts -= len(skipped)
        config.task = task_config  # the workers build the task from this: same prompts everywhere
    for warning in prompt_reuse(config, num_prompts):
        log.warning(warning)
    ckpt = resume_checkpoint(config) if config.checkpoint.resume else None
    if ckpt is not None:
        check_resume_config(config, ckpt)
    start = 0 if ckpt is None else checkpoint_step(ckpt)
    check_checkpoint_space(config, hf_cfg, start)
    return start


# bytes a checkpoint holds per parameter: its fp32 weight (the train workers keep fp32 weights at
# every precision) and, for a parameter the optimizer trains, AdamW's two fp32 moments
WEIGHT_BYTES = 4
MOMENT_BYTES = 8


def checkpoint_size(config: RunConfig, hf_cfg: Any) -> tuple[int, int, int]:
    """The size of one checkpoint of this run, from the model's shapes (built on the meta device:
    no memory, tens of milliseconds even for billions of parameters).

    Returns:
        (parameters, bytes of the trainer's shards: fp32 weights + AdamW's two fp32 moments of
        every trained parameter, bytes of a ``policy/`` export: fp32 weights). Not counted: the
        controller's state (the replay buffer's token ids and logprobs) and file headers, small
        next to these; ``output_dir``'s other files.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from splitrl.models.policy import PolicyModel

    with torch.device("meta"):
        model = PolicyModel(AutoModelForCausalLM.from_config(hf_cfg), config.model.mtp)
    params = list(model.parameters())  # a tied embedding and head once, as they are saved
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)  # λ = 0 heads have no moments
    return total, WEIGHT_BYTES * total + MOMENT_BYTES * trained, WEIGHT_BYTES * total


def checkpoints_to_write(config: RunConfig, start_step: int) -> int:
    """How many checkpoints a run from ``start_step`` writes without a stop: one every
    ``checkpoint.every`` steps and one at the end."""
    every, end = config.checkpoint.every, config.schedule.num_steps
    if end <= start_step:
        return 0
    if not every:
        return 1
    return end // every - start_step // every + (0 if end % every == 0 else 1)


def check_checkpoint_space(config: RunConfig, hf_cfg: Any, start_step: int) -> None:
    """Compare the size of this run's checkpoints (:func:`checkpoint_size`) with the free space
    on ``output_dir``'s disk, before anything is trained: a full disk used to be found at the
    first checkpoint, after the steps before it.

    The run keeps the ``KEPT_CHECKPOINTS`` newest checkpoints and writes the next one before it
    removes the oldest, so up to ``KEPT_CHECKPOINTS + 1`` are on disk at once (fewer when the run
    writes fewer; on a resume the checkpoints already there count towards them); its last
    checkpoint also holds the ``policy/`` export (every ``checkpoint.export_every`` steps too). Fewer than
    that fit: a warning naming the sizes.

    Raises:
        ValueError: not even one checkpoint with its export (the run's last one) fits in the
            free space.
    """
    writes = checkpoints_to_write(config, start_step)
    if writes == 0:
        return
    try:
        free = shutil.disk_usage(config.output_dir).free
    except OSError:  # nothing to compare with (the write check passed)
        return
    params, shards, export = checkpoint_size(config, hf_cfg)
    last = shards + export
    what = (
        f"{params / 1e6:,.1f} M parameters: fp32 weights and AdamW moments {format_bytes(shards)}, the policy/ export "
        f"of the last checkpoint {format_bytes(export)}"
    )
    if free < last:
        raise ValueError(
            f"output_dir={config.output_dir!r}: {format_bytes(free)} are free on its disk, but one checkpoint of this "
            f"run takes about {format_bytes(last)} ({what}); free space there, or choose an output_dir on a disk with room"
        )
    # checkpoint.resume=false sets earlier checkpoints aside on the same disk: they stay, and no new one replaces them
    there = min(len(complete_checkpoints(config.output_dir)), KEPT_CHECKPOINTS) if config.checkpoint.resume else 0
    at_once = min(writes, max(1, KEPT_CHECKPOINTS + 1 - there))
    each = shards + (export if config.checkpoint.export_every else 0)
    need = (at_once - 1) * each + last
    if free < need:
        log.warning(
            "output_dir=%r: %s are free on its disk, and this run holds up to %d new checkpoints at once (it keeps the "
            "%d newest and writes the next before it removes the oldest) of about %s each (%s): %s in all, so a later "
            "checkpoint will not fit; free space there, or choose an output_dir on a disk with room",
            config.output_dir, format_bytes(free), at_once, KEPT_CHECKPOINTS, format_bytes(each), what,
            format_bytes(need),
        )  # fmt: skip


def check_charset_covers_prompts(task: Any, tok: Any) -> None:
    """A character tokenizer must spell the task's first prompts and answers (64 at most).

    Raises:
        ValueError: naming the prompt and the characters that tokenizer.charset lacks.
    """
    from splitrl.tasks import encode_prompt

    unk = tok.unk_token_id
    n = task.num_prompts or 64
    for i in range(min(64, n)):
        p = task.get_prompt(i)
        if (
            unk in encode_prompt(p, tok, task.config.chat_template)
            or unk in tok(p.answer, add_special_tokens=False)["input_ids"]
        ):
            missing = sorted(set(p.text + p.answer) - set(tok.convert_ids_to_tokens(range(len(tok)))))
            raise ValueError(
                f"the character tokenizer cannot spell prompt {i} of the task ({p.text!r}): characters "
                f"{missing} are not in tokenizer.charset; widen tokenizer.charset (null = all printable "
                "ASCII, then model.backbone.vocab_size >= 100) or use tokenizer.kind=pretrained"
            )


def resume_checkpoint(config: RunConfig) -> Path | None:
    """The checkpoint a resumed run starts from (None: there is none, a fresh start); warns about
    newer checkpoints that cannot be used.

    Raises:
        ValueError: the output_dir holds checkpoints but none can be resumed from.
    """
    ckpt = latest_checkpoint(config.output_dir)
    bad = unusable_checkpoints(config.output_dir)
    if ckpt is None and bad:
        # starting over would replace this run's metrics and checkpoints: the user decides
        listed = "; ".join(f"{name} ({why})" for name, why in bad[-3:])
        raise ValueError(
            f"{config.output_dir} holds checkpoints but none can be resumed from: {listed}. "
            "checkpoint.resume=false starts over in this output_dir (the earlier metrics and checkpoints are moved to "
            "earlier_runs/), or use a new output_dir"
        )
    newer = [name for name, _ in bad if ckpt is not None and name > ckpt.name]
    if newer:
        log.warning(
            "resuming from %s; newer checkpoint(s) %s cannot be used (%s)",
            ckpt.name,
            ", ".join(newer),
            "; ".join(why for name, why in bad if name in newer),
        )
    return ckpt


def nothing_to_do(config: RunConfig, done_before: int) -> bool:
    """Whether ``output_dir`` already holds ``schedule.num_steps`` steps or more (``done_before``, from
    :func:`preflight`); says so: as a warning when it holds more than the run asks for, which
    would otherwise read as a success."""
    if done_before > config.schedule.num_steps:
        progress.warning(
            "%s already holds a run of %d steps, more than schedule.num_steps=%d; nothing to do (raise "
            "schedule.num_steps to continue it, or set checkpoint.resume=false to start over: the earlier run is set "
            "aside, not deleted)",
            Path(config.output_dir), done_before, config.schedule.num_steps,
        )  # fmt: skip
        return True
    if done_before == config.schedule.num_steps:
        progress.info(
            "%s already holds a finished run (%d steps); nothing to do (raise schedule.num_steps to train it further, "
            "or set checkpoint.resume=false to start over: the earlier run is set aside, not deleted)",
            Path(config.output_dir), done_before,
        )  # fmt: skip
        return True
    return False


def check_resume_config(config: RunConfig, ckpt: Path) -> None:
    """The checkpoint must be of the same model, tokenizer and ``schedule.groups_per_step`` as this
    run; other changed settings are logged (a checkpoint without ``run_config.json`` is not
    checked; one of the old flat layout is read in the new one).

    Raises:
        ValueError: naming the setting that differs, or that ``run_config.json`` cannot be read.
    """
    saved_path = ckpt / RUN_CONFIG
    if not saved_path.exists():
        return
    try:
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{saved_path} cannot be read ({e}); checkpoint.resume=false starts over in this output_dir"
        ) from None
    if isinstance(saved, dict):  # written by an earlier release: its flat keys, in their sections
        saved = upgrade_layout(saved, str(saved_path), warn=False)
    now = config.model_dump(mode="json")
    model = saved.get("model")
    if isinstance(model, dict) and model.get("pretrained_path") is None and isinstance(model.get("backbone"), dict):
        # written before a ModelConfig held its family's backbone keys (qwen3_moe's experts): read as it is now
        from splitrl.models.config import fill_family_defaults

        fill_family_defaults(model["backbone"], model.get("family"))
    if isinstance(saved.get("loss"), dict):
        saved["loss"].setdefault("kind", "grpo")  # written before loss.kind existed: GRPO, the only loss then
    if saved.get("model") != now["model"]:
        shown = _shown_differences(saved.get("model") or {}, now["model"], "model")
        raise ValueError(
            f"{ckpt} was written by a different model config than this run's ({shown}); resume needs the "
            "same model. Use a new output_dir, or checkpoint.resume=false to start over in this one"
        )
    # the same vocabulary size can map ids to other characters: the weights would be read with
    # another meaning for every id. The path may move (a copied model directory): not compared
    tok_was = {k: v for k, v in (saved.get("tokenizer") or {}).items() if k != "path"}
    tok_now = {k: v for k, v in now["tokenizer"].items() if k != "path"}
    if tok_was and tok_was != tok_now:
        shown = _shown_differences(tok_was, tok_now, "tokenizer")
        raise ValueError(
            f"{ckpt} was written with another tokenizer config than this run's ({shown}); resume needs the same "
            "tokenizer. Set it as the checkpoint has it, use a new output_dir, or checkpoint.resume=false to start over "
            "in this one"
        )
    was = (saved.get("schedule") or {}).get("groups_per_step")
    if was is not None and was != config.schedule.groups_per_step:
        # step k trains prompt indices k*G .. (k+1)*G-1 and the checkpoint records which indices
        # are done: another G maps the next step onto done prompts and the run waits forever
        raise ValueError(
            f"{ckpt} was written by a run with schedule.groups_per_step={was}, this run has "
            f"schedule.groups_per_step={config.schedule.groups_per_step}; a resumed run keeps the prompts of each "
            f"step, so set schedule.groups_per_step={was} (or use a new output_dir, or checkpoint.resume=false to "
            "start over in this one)"
        )
    _warn_if_training_reaches_the_earlier_heldout(saved, config, ckpt)
    # other settings may change on resume (a longer run, a new learning rate), but not silently: a
    # user's resume with group_size=4 over a group_size=8 run, or a new temperature, said nothing
    changed = [(k.lstrip("."), a, b) for k, a, b in _differences(saved, now, "")]
    changed = [(k, a, b) for k, a, b in changed if not any(k == p or k.startswith(p + ".") for p in _RESUME_MAY_CHANGE)]
    if changed:
        log.warning(
            "resuming from %s with settings that differ from the run that wrote it (this run's settings apply "
            "from step %d on): %s", ckpt, checkpoint_step(ckpt) + 1,
            "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8])
            + (f" (and {len(changed) - 8} more)" if len(changed) > 8 else ""),
        )  # fmt: skip


def _warn_if_training_reaches_the_earlier_heldout(saved: dict, config: RunConfig, ckpt: Path) -> None:
    """A longer run (schedule.num_steps raised on resume) draws the prompt indices right after the
    earlier run's last: where the earlier run evaluated on the training task from its default start
    (indices from its num_steps x groups_per_step on), those prompts are trained on now, so its
    eval/ figures (and `splitrl eval` of its checkpoints) were held out from a range this run uses."""
    steps_was = (saved.get("schedule") or {}).get("num_steps")
    ev = saved.get("eval") or {}
    evaluated = ev.get("eval_every", 0) > 0 or ev.get("at_end", False)
    if not (isinstance(steps_was, int) and steps_was < config.schedule.num_steps and evaluated):
        return
    if ev.get("task") is not None or ev.get("start_index") is not None:
        return  # a separate test set, or a start of the user's own (checked against this run's draw)
    per_step = config.schedule.groups_per_step
    first, last = steps_was * per_step, config.schedule.num_steps * per_step - 1
    log.warning(
        "schedule.num_steps %d -> %d: training now draws prompt indices %d..%d, which the run that wrote %s "
        "held out for its evaluation (its default start, index %d); eval/ figures of its steps, and `splitrl "
        "eval` of its checkpoints, scored prompts this run trains on. The evaluation of this run starts at "
        "index %d. A separate eval.task keeps one test set across extensions",
        steps_was, config.schedule.num_steps, first, last, ckpt.name, first, last + 1,
    )  # fmt: skip


# run-config keys (and sections: a dotted prefix) a resumed run is expected to change: how long,
# where, how it logs and runs, and speed settings retuned on another machine
_RESUME_MAY_CHANGE = frozenset({
    "schedule.num_steps", "output_dir", "checkpoint", "logging", "eval", "faults", "reward.timeout_s",
    "cluster.backend", "cluster.placement", "cluster.ray_address", "cluster.num_generation_workers",
    "cluster.num_train_workers", "cluster.device", "cluster.torch_threads", "dataplane",
    "tokenizer.path", "rollout.batch_size", "train.microbatch", "train.speed", "train.fsdp_reshard_after_forward",
    "train.memory", "train.optim.offload", "train.optim.offload_bucket_mb",
})  # fmt: skip


def _shown_differences(saved: dict, now: dict, prefix: str, most: int = 5) -> str:
    """The first ``most`` leaves where a checkpoint's config section and this run's differ, for
    an error message (``model.x: checkpoint 1, this run 2; ... (and 3 more)``)."""
    diffs = _differences(saved, now, prefix)
    shown = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, a, b in diffs[:most])
    return shown + (f" (and {len(diffs) - most} more)" if len(diffs) > most else "")


def _differences(a, b, prefix: str) -> list[tuple[str, object, object]]:
    """(dotted key, value in a, value in b) of every leaf where two nested dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(a.keys() | b.keys(), key=str):
            out += _differences(a.get(k), b.get(k), f"{prefix}.{k}")
        return out
    return [] if a == b else [(prefix, a, b)]
