"""``splitrl generate`` and ``splitrl eval``: sample from / score a checkpoint or any HF directory.

PATH may be a run's output directory (its newest checkpoint with a Hugging Face export is used),
a checkpoint directory (``checkpoints/step_*`` holding ``policy/``, which is written at the end of
a run, at a stop and every ``checkpoint.export_every`` steps, and ``run_config.json``), a ``policy/`` directory,
any local Hugging Face model directory, or a ``.gguf`` file (converted once into a cached
directory, :mod:`splitrl.models.gguf`). The run config next to a checkpoint supplies the task,
the sampling rules and the tokenizer; ``--config FILE`` replaces it, and ``key.path=value``
overrides change it (``task.path=test.jsonl``, ``rollout.temperature=0.6``, ...). Without a run
config (a plain HF directory) the tokenizer and ``generation_config.json`` of the directory are
used.

Held-out prompts. ``splitrl eval`` scores prompt indices the training run never drew: a run of
``schedule.num_steps`` × ``schedule.groups_per_step`` prompts drew indices 0 … N−1, so evaluation
starts at N (or at ``--start-index``). A task with fewer than N prompts (a data file) was drawn in full: evaluate a
separate file (``task.path=...`` or ``task.split=test``), which then starts at 0. Disjoint indices
are disjoint draws; a generator with a small space of problems can still repeat one. What the run
drew is read from its own ``run_config.json`` beside the checkpoint, whatever ``--config`` says
(a ``--config`` with another ``schedule.num_steps`` labelled training prompts held out); ``--config`` stands
in for it only for a directory without one.

Greedy. ``--greedy`` alone scores one greedy response (top_k=1) per prompt and nothing else,
under ``eval/greedy/*``. With ``--num-samples``, ``--k``, ``--temperature``, ``--top-k`` or
``--top-p`` the sampled responses (default 8 per prompt) are scored as well, ``eval/*``.
At most 1,000,000 samples in all per call.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from splitrl.controller.run_checkpoint import (  # stdlib only: no torch at start
    COMPLETE,
    RUN_CONFIG,
    complete_checkpoints,
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resolve_policy_dir(path: str | Path) -> tuple[Path, Path | None]:
    """(the HF model directory, the run config written beside it or None) for a PATH argument.

    Raises:
        ValueError: PATH holds no model (no ``config.json`` at any of the places above), or is a
            ``.gguf`` file that cannot be converted (:mod:`splitrl.models.gguf`).
    """
    p = Path(path)
    if p.suffix.lower() == ".gguf":  # converted once into a cached Hugging Face directory
        from splitrl.models.gguf import gguf_model_dir

        return gguf_model_dir(p), None
    if (p / "checkpoints").is_dir():  # a run's output directory: its newest complete checkpoint with an export
        done = complete_checkpoints(p)
        if not done:
            raise ValueError(f"{p} holds no complete checkpoint under checkpoints/")
        exported = [c for c in done if (c / "policy" / "config.json").is_file()]
        if not exported:
            raise ValueError(
                f"no checkpoint in {p / 'checkpoints'} holds a Hugging Face export (policy/) yet: a run exports at "
                "its end, at a stop (Ctrl-C) and every checkpoint.export_every steps; wait for one, or set "
                "checkpoint.export_every"
            )
        p = _newest_intact_export(exported)
    if (p / "policy" / "config.json").is_file():
        run_cfg = p / RUN_CONFIG
        if run_cfg.is_file() and not (p / COMPLETE).is_file():
            # a checkpoint of a run (its run config beside policy/) whose writing never finished
            raise ValueError(
                f"checkpoint {p} is incomplete (no {COMPLETE} marker: its run stopped while writing it); give "
                "the run's output directory (its newest complete checkpoint is taken) or another checkpoint"
            )
        return p / "policy", run_cfg if run_cfg.is_file() else None
    if (p / COMPLETE).is_file() and (p / RUN_CONFIG).is_file():
        others = sorted(c.name for c in p.parent.glob("step_*") if (c / "policy" / "config.json").is_file())
        raise ValueError(
            f"checkpoint {p} holds the trainer state only, no Hugging Face export (policy/): exports are written "
            "at the end of a run, at a stop and every checkpoint.export_every steps. "
            + (f"Checkpoints with one: {', '.join(others)}" if others else "No checkpoint of this run has one yet")
        )
    if (p / "config.json").is_file():
        run_cfg = p.parent / RUN_CONFIG
        return p, run_cfg if run_cfg.is_file() else None
    if not p.exists():
        raise ValueError(
            f"{p} does not exist; give a run output dir, a checkpoint (step_*/), a model directory or a .gguf file"
        )
    raise ValueError(
        f"{p} is not a model directory: expected a run output dir, a checkpoint (step_*/policy/), a policy/ "
        "directory or a Hugging Face directory with config.json"
    )


def _newest_intact_export(exported: list[Path]) -> Path:
    """The newest of ``exported`` (checkpoints with ``policy/``, oldest first) whose export files
    match the sizes and checksums of its ``COMPLETE`` record; a damaged newer one is passed over
    with a warning naming what is wrong. Only the export's files are read.

    Raises:
        ValueError: every export is damaged (each named, with why).
    """
    from splitrl.controller.run_checkpoint import damage

    why = {}
    for c in reversed(exported):
        why[c.name] = damage(c, under="policy/")
        if why[c.name] is None:
            if len(why) > 1:
                print(
                    f"splitrl: using {c.name}: the newer export(s) are damaged ("
                    + "; ".join(f"{n}: {w}" for n, w in why.items() if w)
                    + ")",
                    file=sys.stderr,
                )
            return c
    raise ValueError(
        "every Hugging Face export of this run is damaged: " + "; ".join(f"{n}: {w}" for n, w in why.items())
    )


def _hf_generation_overrides(policy_dir: Path) -> list[str]:
    """A ``rollout={...}`` override from the directory's ``generation_config.json`` (if any)."""
    f = policy_dir / "generation_config.json"
    if not f.is_file():
        return []
    g = json.loads(f.read_text())
    rollout: dict[str, Any] = {}
    for key in ("temperature", "top_k", "top_p", "max_new_tokens", "stop_strings"):
        if g.get(key) is not None:
            rollout[key] = g[key]
    eos = g.get("eos_token_id")
    if eos is not None:
        rollout["stop_token_ids"] = eos if isinstance(eos, list) else [eos]
    return [f"rollout={json.dumps(rollout)}"] if rollout else []


def _saved_mtp_overrides(policy_dir: Path) -> list[str]:
    """``model.mtp.mtp_num_layers=N`` for a directory of ours saved without its run config: the
    model loads its N MTP depths, so ``rollout.speculative=true`` is valid for it (the default
    config has none and refused it). Nothing for other directories."""
    try:
        saved = json.loads((policy_dir / "config.json").read_text()).get("splitrl") or {}
        n = int(saved["mtp"]["mtp_num_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return [f"model.mtp.mtp_num_layers={n}"] if n > 0 else []


# the run config a run writes at the top of its output_dir (splitrl.logging.logger.CONFIG_FILE)
_OUTPUT_DIR_CONFIG = "config.yaml"


def check_config_file(path: str) -> None:
    """``--config`` names a run config file, not a directory.

    Raises:
        ValueError: ``path`` is a directory: naming the run config file in it (a run's
            ``config.yaml``, a checkpoint's ``run_config.json``), or saying it holds none.
    """
    p = Path(path)
    if not p.is_dir():
        return  # a file, a pipe, or a missing path: load_config says what is wrong with it
    inside = [p / name for name in (_OUTPUT_DIR_CONFIG, RUN_CONFIG) if (p / name).is_file()]
    if inside:
        raise ValueError(f"--config {path} is a directory; give the run config file in it: --config {inside[0]}")
    raise ValueError(
        f"--config {path} is a directory with no run config in it (no {_OUTPUT_DIR_CONFIG} of a run's output_dir, "
        f"no {RUN_CONFIG} of a checkpoint); give a YAML run config file (e.g. examples/cpu_demo.yaml), or leave "
        "--config out to use the run config beside the checkpoint"
    )


def load_policy_and_config(args: argparse.Namespace):
    """The validated run config (fast: before torch), then the model and the tokenizer.

    Returns ``(config, trained, policy_dir, model, tokenizer)`` where ``trained`` is the run
    config the model was trained with: the ``run_config.json`` beside it, else ``--config``, else
    None (unknown).
    """
    from splitrl.config import load_config

    if args.config is not None:
        check_config_file(args.config)
    policy_dir, run_cfg = resolve_policy_dir(args.path)
    source = args.config or run_cfg
    extra = [] if source is not None else _hf_generation_overrides(policy_dir) + _saved_mtp_overrides(policy_dir)
    device = getattr(args, "device", "auto")
    if not any(o.startswith(("cluster.device=", "device=")) for o in args.overrides):
        # --device (default auto: a GPU if any) wins over the run config's: a GPU run read on a CPU
        if device == "cuda":
            _device(device)  # no GPU: the flag's own message, not the config key's it is passed as
        extra.append(f"cluster.device={device}")
    try:
        config = load_config(source, extra + list(args.overrides))
    except ValueError as e:
        if source is run_cfg and run_cfg is not None and "not valid" in str(e):
            raise ValueError(
                f"{e}; the checkpoint's {RUN_CONFIG} is damaged: pass --config with the run's config file"
            ) from None
        raise
    trained = None
    for known in (run_cfg, args.config):  # what the run drew: its own record first
        if known is not None:
            try:
                trained = load_config(known)
                break
            except ValueError:  # e.g. a GPU run's cluster.device=cuda read on a CPU machine
                continue
    has_tokenizer = any((policy_dir / f).is_file() for f in _TOKENIZER_FILES)
    if not has_tokenizer and source is None and not any(o.startswith("tokenizer") for o in args.overrides):
        raise ValueError(
            f"{policy_dir} has no tokenizer files and no run config beside it; pass --config with the run's "
            "config or tokenizer.* overrides"
        )

    from splitrl.models.checkpoint import verify_pretrained

    verify_pretrained(policy_dir, key="PATH")  # a damaged config.json or weight file: one line, before loading

    import torch

    from splitrl.models import PolicyModel

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if has_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    else:  # a checkpoint written before policy/ held its tokenizer
        from splitrl.workers.generation import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer, config.model.pretrained_path)
    model = PolicyModel.from_pretrained(str(policy_dir))
    if args.dtype == "bf16" or (args.dtype is None and config.cluster.rollout_dtype == "bf16"):
        model = model.to(torch.bfloat16)
    return config, trained, policy_dir, model, tokenizer


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA GPU is visible; use --device cpu or auto")
    return name


def heldout_start(num_task_prompts: int | None, config, trained, start_index: int | None) -> tuple[int, str]:
    """First prompt index to evaluate and a sentence saying why (see the module docstring).

    Args:
        num_task_prompts: prompts of the evaluated task (None: unbounded).
        config: the evaluation's run config (its ``task`` is evaluated).
        trained: the run config the model was trained with (None: unknown); what it drew is
            ``trained.schedule.num_steps * trained.schedule.groups_per_step`` prompts of ``trained.task``.
        start_index: ``--start-index`` (None: from what the run drew).
    """
    trained_task = trained.task if trained is not None else None
    drawn = trained.schedule.num_steps * trained.schedule.groups_per_step if trained is not None else 0
    if start_index is not None:
        if trained_task is not None and config.task == trained_task and start_index < drawn:
            # training's own eval refuses this overlap; here it may be meant (a score on seen prompts)
            return start_index, (
                f"WARNING: prompts from index {start_index} (--start-index) include prompts the run "
                f"trained on (0..{drawn - 1}); use --start-index >= {drawn} for held-out scores"
            )
        return start_index, f"prompts from index {start_index} (--start-index)"
    if trained_task is None:
        return 0, (
            "no run config: prompts from index 0, which may include training prompts "
            "(set --start-index, or pass the run's --config)"
        )
    if config.task != trained_task:
        return 0, "a task config the run did not train on: prompts from index 0"
    if num_task_prompts is None or drawn < num_task_prompts:
        return drawn, f"held out: prompt indices from {drawn} (the run drew 0..{drawn - 1})"
    return 0, (
        f"WARNING: the run drew all {num_task_prompts} prompts of this task, so these scores are on "
        "training prompts; evaluate a separate file (task.path=... or task.split=test)"
    )


# the sampling flags of eval / generate, as GenerationConfig fields
_SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "max_new_tokens")

# what each flag accepts, said in its message (GenerationConfig decides what is valid)
_FLAG_RANGES = {
    "top_k": "must be an integer >= 0 (0 = off: every token is kept; k keeps the k most likely)",
    "top_p": "must be in (0, 1] (1.0 = off)",
    "max_new_tokens": "must be an integer >= 1",
}


def _flag_problem(name: str, value: Any, err: dict[str, Any]) -> str:
    """One clause of a refused sampling flag: the flag and the value given, what it accepts and,
    for ``--temperature``, the fix eval / generate accept (``--greedy``; ``rollout.top_k=1``
    is refused there like in training)."""
    flag = f"--{name.replace('_', '-')}"
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    if name == "temperature":
        if value == math.inf:
            return (
                f"--temperature {shown}: the temperature must be finite (softmax(logits / inf) is uniform over "
                "the vocabulary: the model plays no part); give a finite T > 0 such as 1.0"
            )
        return (
            f"--temperature {shown}: the temperature must be > 0 (tokens are drawn from softmax(logits / T)), "
            "such as 1.0; for greedy decoding drop --temperature and pass --greedy"
        )
    if name in _FLAG_RANGES:
        return f"{flag} {shown}: {_FLAG_RANGES[name]}"
    from splitrl.config_help import validator_words

    return f"{flag} {shown}: {validator_words(err)}"  # a rule added later


def check_sampling_flags(args: argparse.Namespace) -> None:
    """Refuse an invalid ``--temperature``, ``--top-k``, ``--top-p`` or ``--max-new-tokens`` at
    once, from the flags alone: before the model directory is resolved (a ``.gguf`` is converted
    there), stdin is read or any weights load. ``splitrl eval --temperature 0`` used to be refused
    only after the weights had loaded (seconds to minutes), with pydantic's "Value error, " in front.

    Raises:
        ValueError: one line naming each bad flag, its valid range and (``--temperature 0``) the fix.
    """
    from pydantic import ValidationError

    from splitrl.rollout.config import GenerationConfig  # torch-free

    given = {n: getattr(args, n) for n in _SAMPLING_FLAGS if getattr(args, n, None) is not None}
    try:
        GenerationConfig.model_validate(given)  # the fields not given keep their (valid) defaults
    except ValidationError as e:
        problems = {}
        for err in e.errors():
            name = str(err["loc"][0])
            problems.setdefault(name, _flag_problem(name, given.get(name), err))
        raise ValueError("; ".join(problems.values())) from None


def _sampling(config, args: argparse.Namespace, policy_dir: Path):
    from splitrl.models.hf_files import model_eos_token_ids

    check_sampling_flags(args)  # run_eval / run_generate checked them before loading; cheap
    gen = config.rollout
    # the directory's own stop tokens (end-of-turn of a chat model, those a run saved)
    update: dict[str, Any] = {
        "stop_token_ids": list(dict.fromkeys(gen.stop_token_ids + model_eos_token_ids(policy_dir)))
    }
    for name in _SAMPLING_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            update[name] = value
    # validated like the run config (model_copy would not); the flags alone are valid (above)
    from pydantic import ValidationError

    try:
        return type(gen).model_validate({**gen.model_dump(), **update})
    except ValidationError as e:
        from splitrl.config_help import validator_words

        problems = []
        for err in e.errors():
            name = str(err["loc"][0])
            given = name in _SAMPLING_FLAGS and getattr(args, name, None) is not None
            problems.append(
                _flag_problem(name, update[name], err) if given else f"rollout.{name}: {validator_words(err)}"
            )
        raise ValueError("; ".join(problems)) from None


# eval's samples per prompt when --num-samples is not given (and sampling is asked for)
EVAL_NUM_SAMPLES = 8


def _eval_passes(args: argparse.Namespace) -> tuple[int, bool]:
    """(sampled responses per prompt, whether a greedy pass runs) for ``splitrl eval``.

    ``--greedy`` alone scores one greedy response per prompt and nothing else (it used to add
    that pass beside 8 sampled ones). With ``--num-samples``, ``--k`` or a sampling flag
    (``--temperature``, ``--top-k``, ``--top-p``) sampling is asked for too: the greedy pass
    runs beside it (metrics ``eval/greedy/*``). Without ``--greedy``: ``EVAL_NUM_SAMPLES``
    sampled responses unless ``--num-samples`` says otherwise.
    """
    sampling_asked = (
        args.num_samples is not None
        or args.k is not None
        or any(getattr(args, name, None) is not None for name in ("temperature", "top_k", "top_p"))
    )
    if args.greedy and not sampling_asked:
        return 0, True
    return (args.num_samples if args.num_samples is not None else EVAL_NUM_SAMPLES), args.greedy


def _check_sample_count(num_prompts: int, num_samples: int, flag: str) -> None:
    """Refuse more than ``MAX_SAMPLES_PER_CALL`` samples (a typo such as ``-n 100000000`` ran on
    without a word while its memory grew), before the model loads."""
    from splitrl.evaluation import MAX_SAMPLES_PER_CALL

    total = num_prompts * num_samples
    if total > MAX_SAMPLES_PER_CALL:
        raise ValueError(
            f"{num_prompts:,} prompt(s) × --num-samples {num_samples:,} = {total:,} samples, more than the "
            f"{MAX_SAMPLES_PER_CALL:,} one call draws; lower {flag}, or split the work over several calls "
            "(--seed S draws other samples)"
        )


def run_eval(args: argparse.Namespace) -> int:
    # first, before torch is imported and the weights load (`--temperature 0` was refused after)
    check_sampling_flags(args)
    from splitrl.evaluation import evaluate
    from splitrl.tasks import make_task

    num_samples, greedy = _eval_passes(args)
    ks_asked = args.k if args.k is not None else [1]
    too_big = [k for k in ks_asked if k > max(num_samples, 1)]
    if too_big:  # before the model loads: pass@k needs at least k samples per prompt
        raise ValueError(
            f"--k {','.join(map(str, too_big))} exceeds --num-samples {num_samples}: pass@k needs k samples per "
            "prompt; raise --num-samples or lower --k"
        )
    if getattr(args, "top_k", None) == 1 and num_samples > 1:
        # every sample of a prompt would be its greedy response: pass@k = pass@1, silently
        raise ValueError(
            f"--top-k 1 makes all {num_samples} samples of a prompt the same (greedy) response, so pass@k would "
            "equal pass@1; pass --greedy (one greedy response a prompt) or a --top-k of 0 (off) or >= 2"
        )
    _check_sample_count(args.num_prompts, num_samples + int(greedy), "--num-samples or --num-prompts")
    out = _writable_output(args.output, args.overwrite) if args.output else None  # before minutes of sampling
    config, trained, policy_dir, model, tokenizer = load_policy_and_config(args)
    task = make_task(config.task)
    start, why = heldout_start(task.num_prompts, config, trained, args.start_index)
    stop = start + args.num_prompts
    if task.num_prompts is not None:
        stop = min(stop, task.num_prompts)
    if stop <= start:
        raise ValueError(f"no prompts to evaluate: the task has {task.num_prompts}, starting at {start}")
    indices = list(range(start, stop))
    drawn = [counted(num_samples, "sample")] * bool(num_samples) + ["1 greedy sample"] * greedy
    prompt_count = counted(len(indices), "prompt")
    print(f"splitrl eval: {policy_dir}; {prompt_count} × {' + '.join(drawn)}; {why}", file=sys.stderr)
    device = _device(args.device)
    common = dict(
        seed=args.seed,
        device=device,
        correct_threshold=args.correct_threshold,
        reward_timeout_s=config.reward.timeout_s,
        progress=True,
    )
    gen = _sampling(config, args, policy_dir)
    metrics: dict[str, float] = {}
    samples = []
    if num_samples:
        ks = sorted(set(ks_asked) | {num_samples})
        result = evaluate(model, tokenizer, task, gen, indices, num_samples=num_samples, ks=ks, **common)
        metrics.update(result.metrics)
        samples += result.samples
    if greedy:
        result = evaluate(
            model,
            tokenizer,
            task,
            gen.model_copy(update={"top_k": 1}),
            indices,
            num_samples=1,
            ks=(1,),
            prefix="eval/greedy/",
            **common,
        )
        metrics.update(result.metrics)
        samples += result.samples
    for key, value in metrics.items():
        print(f"{key:32s} {value:.4f}")
    if out is not None:
        with out.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"metrics": metrics, "policy": str(policy_dir), "first_index": start}) + "\n")
            for s in samples:
                f.write(json.dumps(s.__dict__) + "\n")
        print(f"splitrl eval: metrics and samples written to {out}", file=sys.stderr)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    if args.greedy and args.num_samples > 1:  # checked before stdin is read and the model loaded
        raise ValueError(
            f"--greedy gives one response per prompt (greedy decoding is deterministic), not "
            f"--num-samples {args.num_samples}; drop one of the two flags"
        )
    ignored = [
        f"--{n.replace('_', '-')}" for n in ("temperature", "top_k", "top_p") if getattr(args, n, None) is not None
    ]
    if args.greedy and ignored:  # greedy takes the most likely token: these would change nothing
        raise ValueError(
            f"--greedy decodes the most likely token, so {', '.join(ignored)} would have no effect; drop one"
        )
    check_sampling_flags(args)  # before torch is imported, stdin is read and the weights load
    from splitrl.evaluation import stream_samples

    _check_sample_count(1, args.num_samples, "--num-samples")  # before stdin is read
    prompts = list(args.prompt or [])
    if not prompts:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompts: give --prompt TEXT (repeatable) or prompt lines on stdin")
    empty = [i + 1 for i, p in enumerate(prompts) if p == ""]
    if empty:  # checked before the model loads; the engine would refuse a prompt of no tokens
        raise ValueError(f"--prompt number {empty[0]} is empty; give each prompt some text")
    n = 1 if args.greedy else args.num_samples
    _check_sample_count(len(prompts), n, "--num-samples or the number of prompts")
    config, _, policy_dir, model, tokenizer = load_policy_and_config(args)
    gen = _sampling(config, args, policy_dir)
    if args.greedy:
        gen = gen.model_copy(update={"top_k": 1})
    print(
        f"splitrl generate: {policy_dir}; {counted(len(prompts), 'prompt')} × "
        f"{counted(n, 'greedy ' * args.greedy + 'sample')}",
        file=sys.stderr,
    )
    # each response is written as soon as it and those before it are done (stdout is flushed), so
    # a long call shows its results as it goes and holds only the samples being generated
    responses: list[str] = []  # --json: the current prompt's, written with its last one
    chat = getattr(config.task, "chat_template", None)  # the run's rule; task.chat_template=... changes it
    for i, j, text in stream_samples(model, tokenizer, prompts, gen, num_samples=n, seed=args.seed,
                                     device=_device(args.device), progress=True, chat_template=chat):  # fmt: skip
        if args.json:
            responses.append(text)
            if j == n - 1:
                _write_out(json.dumps({"prompt": prompts[i], "responses": responses}))
                responses = []
        else:
            _write_out((f"### {prompts[i]}\n" if j == 0 else "") + f"[{j}] {text}")
    return 0


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 ("1 prompt", "4 samples"; a trial read "1 prompts")."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _write_out(line: str) -> None:
    """A result line on stdout, flushed, without tearing the progress bar on stderr."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def _common(p: argparse.ArgumentParser, num_samples_help: str, greedy_help: str) -> None:
    p.add_argument(
        "path", help="run output dir, checkpoint dir (step_*), policy/ dir, Hugging Face model dir or .gguf file"
    )
    p.add_argument("overrides", nargs="*", help="key.path=value changes to the run config, e.g. task.path=test.jsonl")
    p.add_argument(
        "--config", action=OnlyOnce, help="run config to use instead of the run_config.json beside the checkpoint"
    )
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: %(default)s (a GPU if any)"
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="default: the run's cluster.rollout_dtype")
    p.add_argument(
        "--threads",
        type=_positive,
        help="torch intra-op threads on the CPU (default: torch's, one a core); on cores other jobs "
        "share, 1 can be several times faster (bench/RESULTS.md, CPU generation)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the samples (sample j of prompt i: seed, i, j); default: %(default)s",
    )
    p.add_argument("--num-samples", "-n", type=_positive, help=num_samples_help)
    p.add_argument("--greedy", action="store_true", help=greedy_help)
    p.add_argument("--temperature", type=float, help="default: the run config's rollout.temperature")
    p.add_argument("--top-k", dest="top_k", type=int, help="default: the run config's rollout.top_k")
    p.add_argument("--top-p", dest="top_p", type=float, help="default: the run config's rollout.top_p")
    p.add_argument(
        "--max-new-tokens", dest="max_new_tokens", type=int, help="default: the run config's rollout.max_new_tokens"
    )


def add_eval_commands(sub) -> None:
    """Register ``generate`` and ``eval`` on the ``splitrl`` sub-command parser."""
    g = sub.add_parser(
        "generate", allow_abbrev=False, help="print samples of a checkpoint or HF model for given prompts"
    )
    _common(
        g,
        "samples per prompt; default: 1 (at most 1,000,000 samples in all per call)",
        "greedy decoding (top_k=1) instead of sampling: one response per prompt",
    )
    g.set_defaults(num_samples=1)
    g.add_argument("--prompt", "-p", action="append", help="prompt text (repeatable; default: lines of stdin)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(run=_guarded(run_generate))
    e = sub.add_parser(
        "eval",
        allow_abbrev=False,  # `--temperatur 0.5` is a typo, not --temperature
        help="score a checkpoint or HF model on a task's held-out prompts (reward, pass@k, length)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(
        e,
        f"sampled responses per prompt; default: {EVAL_NUM_SAMPLES}, or none with --greedy alone",
        "score greedy decoding (top_k=1): one response per prompt. Alone, that is the only pass (metrics "
        "eval/greedy/*); with --num-samples, --k, --temperature, --top-k or --top-p it runs beside the sampled "
        "responses",
    )
    e.add_argument("--num-prompts", type=_positive, default=64, help="held-out prompts to score; default: %(default)s")
    e.add_argument(
        "--k",
        type=_pass_at_ks,
        help="comma-separated k of pass@k, each <= --num-samples (n = --num-samples is always added); default: 1",
    )
    e.add_argument(
        "--start-index", type=_non_negative, help="first prompt index (default: the first the run never drew)"
    )
    e.add_argument(
        "--correct-threshold",
        type=_threshold,
        default=1.0,
        help="reward >= this counts as correct (0 < t <= 1: rewards lie in [0, 1])",
    )
    e.add_argument(
        "--output",
        help="JSONL file: a metrics line, then one line per sample (a new file; missing folders are created)",
    )
    e.add_argument("--overwrite", action="store_true", help="let --output replace an existing file")
    e.set_defaults(run=_guarded(run_eval))


def _positive(text: str) -> int:
    """A count flag (``--num-samples``, ``--num-prompts``): an int >= 1, else a usage error."""
    return _int_at_least(text, 1)


def _threshold(text: str) -> float:
    """``--correct-threshold``: a reward in (0, 1], else a usage error. Rewards lie in [0, 1], so a
    threshold <= 0 counts every sample correct and one above 1 (or nan) none: pass@k would be a
    constant 1 or 0 that looks like a result."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a reward in (0, 1] (rewards lie in [0, 1]), got {text!r}")
    return value


def _non_negative(text: str) -> int:
    """An index flag (``--start-index``): an int >= 0, else a usage error."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value


def _writable_output(path: str, overwrite: bool = False) -> Path:
    """``--output``: refuse a path the results could not be written to, before any evaluation runs.

    Raises:
        ValueError: the path is a directory, an existing file (without ``overwrite``; a new user
            replaced a run's own metrics.jsonl, and the run then could not resume), or its folder
            cannot be created or written to.
    """
    import tempfile

    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--output {path} is a directory; give a file name (e.g. {out / 'eval.jsonl'})")
    if out.exists() and not overwrite:
        raise ValueError(f"--output {path} exists; give a new file name, or pass --overwrite to replace it")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"--output {path}: {blocker} is a file, not a folder; choose a path under a folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"):
            pass
    except OSError as e:
        raise ValueError(f"--output {path}: cannot write there ({e.strerror or e}); choose a writable path") from None
    return out


def _pass_at_ks(text: str) -> list[int]:
    """``--k`` as a list of positive ints (argparse reports the ValueError as a usage error)."""
    try:  # an empty item ("1,,2", "1,") is refused too, as the bench scripts do, not skipped
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 1,4,8, got {text!r}"
        ) from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,4,8, got {text!r}")
    return ks


class OnlyOnce(argparse.Action):
    """An option that may be given once: a second ``--config`` used to replace the first silently."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(
                f"{option_string} given twice; pass one file (put the other's settings in it, or as key=value)"
            )
        setattr(namespace, self.dest, values)


def _guarded(fn):
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ValueError as e:
            print(f"splitrl: {e}", file=sys.stderr)
            return 2

    return run
