"""End-to-end training throughput: the asynchronous controller against a plain synchronous GRPO loop.

One process runs the same config once per schedule (four by default, ``--schedules``), one after
the other, with only the schedule changed:

- ``sync``: ``schedule.mode: sync`` — generate the whole step with the current weights, then train it,
  then sync the weights (what a plain GRPO loop does; nothing overlaps);
- ``async s=0``: ``schedule.mode: async``, ``buffer.max_staleness: 0`` — the same samples and math as
  ``sync`` (the runs log the same losses), but the step's groups are streamed into training in
  chunks as they finish, so generation of a step's later groups overlaps training of its first;
- ``async s=1``: ``schedule.mode: async``, ``buffer.max_staleness: 1`` — generation also runs one
  policy version ahead (stale samples, corrected by truncated importance weights when the config
  says so), so it overlaps the whole train step and the weight sync;
- ``async s=0 arrival``: ``async s=0`` with ``schedule.chunk_order: arrival`` — the step's own groups are
  trained in the order they finish, not in prompt order, so the first chunk does not wait for the
  group of the step's first prompt (same samples and math, summed in another order).

Each run gets ``schedule.num_steps = --steps``, a fresh output directory, no intermediate checkpoints and no
held-out evaluation. The first run of a process is slower even after its first step (lazily built
kernels and caches: on CPU its steps 2..N took 0.2 s longer than the same schedule's run later in
the process), so an untimed warm-up run of ``--warmup-steps`` steps goes first. ``--repeats R``
runs the schedules R times, in forward then reverse order (A B C C B A ...), so that a drift of the
machine's speed (other load) weighs on every schedule alike; steps are pooled over the repeats.
Step 1 of each run pays start-up (and, asynchronously, has nothing generated ahead), so figures
are over the steady-state steps 2..N:

    wall      = Σ_{s=2..N} timing/step_s   (the train pump's step: from waiting for the step's first
                                            chunk to its weights synced and metrics taken; only
                                            logging falls between two steps)
    samples/s = (N − 1) · groups_per_step · group_size / wall
    generated tokens/s = Σ_{s=2..N} rollout/response_length_mean · groups_per_step · group_size / wall
    trained tokens/s   = Σ_{s=2..N} (rollout/prompt_length_mean + rollout/response_length_mean)
                         · groups_per_step · group_size / wall   (tokens the train step processes)

and the ratios of each schedule's samples/s to ``sync``'s. Also printed: the mean step time, the
seconds per step the train pump waited for rollouts (``timing/exposed_wait_s``) and the seconds
per step generation and training overlapped (``timing/generation_during_train_s``, 0 under sync).

    python bench/bench_e2e.py --config examples/cpu_demo.yaml --steps 6
    python bench/bench_e2e.py --config examples/qwen3_0p6b_gpu.yaml --steps 6 --device cuda \\
        "task={kind: reverse_digits}"

Streaming at staleness 0 gains only where chunks can train before the step is complete: with
``coalesce_chunks`` a microbatch waits until it is full, so a config whose one microbatch holds the
whole step (the CPU demo's ``micro_batch_size: 128``) runs every forward and backward pass after
the last group, as ``sync`` does (only the chunks' data preparation overlaps generation).
Measured figures (CPU and H200s, each schedule's ratio to ``sync``) and what bounds each:
bench/RESULTS.md (End to end).

Ragged response lengths (``--stop-prob P``). A random-init model (the GPU example: no hub access)
almost never samples its tokenizer's EOS (1 id of 151936), so every response runs to
``rollout.max_new_tokens``, all samples of a step finish at the same moment and streaming a step's
groups at ``max_staleness: 0`` has nothing to overlap (async s=0 ≈ sync on the H200s: bench/RESULTS.md),
while real RL responses vary ~10x in length within a step. ``--stop-prob P`` gives every
run (warm-up included) ``rollout.stop_token_ids`` = the ids the config already stops on (its own
list and the tokenizer's EOS) plus the highest ids of the model's vocabulary that spell no text
of the tokenizer (no text id, no pad), as many as make ``round(P · vocab_size)`` stopping ids in
all (:func:`stop_token_ids`). A near-uniform random-init model then stops with probability ≈ P
per token: response lengths are about geometric, mean ≈ (1 − (1 − P)^L) / P ≈ 1/P for
L = ``max_new_tokens`` ≫ 1/P, capped at L. (A trained policy learns its own lengths; the option is
for random-init models.) The table prints the observed response length (``rollout/
response_length_mean`` averaged over the steady steps, the largest ``rollout/response_length_max``)
and the share of responses cut at ``max_new_tokens`` (``rollout/truncation_rate``). The CPU demo's
vocabulary (22 ids) is all text but for 4 specials, so there P <= 3/22 (EOS, <unk>, <bos>); raise
``model.backbone.vocab_size`` for more.

    python bench/bench_e2e.py --config examples/qwen3_0p6b_gpu.yaml --steps 6 --device cuda \\
        --stop-prob 0.02   # 3039 stop ids; mean response ≈ 46 of 128 tokens
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py
from shapes import check_switches  # noqa: E402

check_switches()  # a bad SPLITRL_* value: one line and exit 2, before the controller's imports read it

from splitrl.config import MOVED_KEYS, RunConfig, load_config  # noqa: E402
from splitrl.controller.cluster import resolve_backend  # noqa: E402
from splitrl.controller.controller import train  # noqa: E402
from splitrl.controller.placement import resolve_placement  # noqa: E402
from splitrl.models.hf_files import rollout_stop_token_ids  # noqa: E402
from splitrl.presets import DEMO_PRESET  # noqa: E402

SCHEDULES = {
    "sync": ["schedule.mode=sync", "buffer.max_staleness=0"],
    "async s=0": ["schedule.mode=async", "buffer.max_staleness=0"],
    "async s=1": ["schedule.mode=async", "buffer.max_staleness=1"],
    # s=0 with the step's groups trained in the order they finish (chunk_order: arrival)
    "async s=0 arrival": ["schedule.mode=async", "buffer.max_staleness=0", "schedule.chunk_order=arrival"],
}
# the same run for every schedule: no intermediate checkpoints, no evaluation, a fresh start
COMMON = [
    "checkpoint.every=0",
    "checkpoint.resume=false",
    "eval.eval_every=0",
    "eval.at_end=false",
    "logging.progress_bar=false",
]

# keys every run's config gets from the bench (after the user's overrides): what to use instead
BENCH_KEYS = {
    "schedule.num_steps": "use --steps",
    "output_dir": "use --output-dir",
    "schedule.mode": "use --schedules (sync, async s=0, async s=1, async s=0 arrival)",
    "schedule.chunk_order": "use --schedules (async s=0 arrival)",
    "buffer.max_staleness": "use --schedules (sync and async s=0 run at 0, async s=1 at 1)",
    **{o.split("=")[0]: "the runs are timed without it; remove the override" for o in COMMON},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="run config YAML (default: the CPU demo, preset cpu_demo)")
    p.add_argument("--steps", type=int, default=6, help="steps per run (>= 2; step 1 is not counted)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda", "auto"], help="default: the config's")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma list of {', '.join(SCHEDULES)}")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps of the untimed warm-up run (0: none)")
    p.add_argument("--repeats", type=int, default=1, help="runs per schedule, in alternating order")
    p.add_argument(
        "--output-dir",
        default=None,
        help="keep each run's metrics and logs here (their checkpoints are removed); default: a temporary "
        "directory, removed at the end",
    )
    p.add_argument(
        "--stop-prob",
        type=float,
        default=0.0,
        help="0 <= P < 1: stop responses with probability ~P per token (random-init models never sample EOS; "
        "see the docstring); 0: off",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help=f"key.path=value overrides applied to every run (not the keys the bench sets: {', '.join(BENCH_KEYS)})",
    )
    args = p.parse_args(argv)
    args.stop_ids, args.stop_note = None, ""
    if not 0.0 <= args.stop_prob < 1.0:
        p.error(f"--stop-prob must be in [0, 1) (a per-token stop probability), got {args.stop_prob}")
    if args.steps < 2:
        p.error("--steps must be >= 2: step 1 (start-up, compilation) is left out of the figures")
    if args.repeats < 1 or args.warmup_steps < 0:
        p.error("--repeats must be >= 1 and --warmup-steps >= 0")
    for override in args.overrides:  # a key the bench sets for every run would be silently replaced
        key = override.split("=", 1)[0].strip()
        key = MOVED_KEYS.get(key, key)  # an old flat key (num_steps) names the same setting
        if key in BENCH_KEYS:
            p.error(
                f"{override!r}: the bench sets {key} itself for every run, so this override would have no "
                f"effect; {BENCH_KEYS[key]}"
            )
    if args.output_dir and (Path(args.output_dir).is_file() or any(q.is_file() for q in Path(args.output_dir).parents)):
        p.error(
            f"--output-dir {args.output_dir}: is (or lies under) a file; give a directory (it is created if needed)"
        )
    unknown = [s for s in args.schedules.split(",") if s not in SCHEDULES]
    if unknown:
        p.error(f"--schedules: unknown {unknown}; choose from {list(SCHEDULES)}")
    check_dir = Path(tempfile.gettempdir()) / "bench_e2e_check"
    if args.stop_prob > 0:  # one id set for every run: the schedules differ in nothing the ids depend on
        first = args.schedules.split(",")[0]
        try:  # an invalid config is the config's error, not --stop-prob's
            base = _run_config(args, _overrides(args, first, args.steps, check_dir))
        except ValueError as e:
            p.error(f"{first}: {e}")
        try:
            args.stop_ids = stop_token_ids(base, args.stop_prob)
        except ValueError as e:
            p.error(f"--stop-prob {args.stop_prob}: {e}")
        own = list(base.rollout.stop_token_ids)
        args.stop_note = (
            f"--stop-prob {args.stop_prob}: rollout.stop_token_ids = the config's {_describe_ids(own)} + "
            f"{_describe_ids(args.stop_ids[len(own) :])} spelling no text (+ the tokenizer's EOS, id {_eos(base)})"
        )
    for name in args.schedules.split(","):  # every run's config, before the first run starts
        try:
            _run_config(args, _overrides(args, name, args.steps, check_dir))
        except ValueError as e:
            p.error(f"{name}: {e}")
    return args


def stop_token_ids(config: RunConfig, p: float) -> list[int]:
    """``rollout.stop_token_ids`` that stop a near-uniform model with probability ≈ ``p`` per token.

    The ids the run already stops on (``config.rollout.stop_token_ids``, the tokenizer's EOS, a
    pretrained model's ``eos_token_id``) count towards ``round(p · vocab_size)``; the rest are the
    highest ids of the model's vocabulary that the tokenizer does not use for text and that are not
    its pad id. Returns the config's own ids (order kept) then the added ones, ascending (the
    tokenizer's EOS is added by the generation worker, as for any run).

    Raises:
        ValueError: ``p`` asks for fewer than one id, or for more ids than the vocabulary has
            outside the tokenizer's text (how to fix is said); or the config's model/tokenizer
            are invalid.
    """
    from splitrl.controller.preflight import load_checked_tokenizer, model_hf_config

    vocab = model_hf_config(config).vocab_size
    tok = load_checked_tokenizer(config)
    want = round(p * vocab)
    if want < 1:
        raise ValueError(f"round(P * vocab_size) = round({p} * {vocab}) = 0 stop ids; use P > {0.5 / vocab:.2g}")
    stopping = set(rollout_stop_token_ids(config.rollout, tok, config.model.pretrained_path))
    text = set(tok.get_vocab().values()) - set(tok.all_special_ids)
    unusable = text | stopping | {tok.pad_token_id}
    free = [i for i in range(vocab - 1, -1, -1) if i not in unusable]
    need = max(0, want - len(stopping))
    if need > len(free):
        most = (len(stopping) + len(free)) / vocab
        raise ValueError(
            f"it needs {want} stop ids of the model's vocab_size={vocab}, but only {len(stopping)} stop already "
            f"and {len(free)} more spell no text of the tokenizer (tokenizer.kind={config.tokenizer.kind}, "
            f"{len(text)} text ids); use --stop-prob <= {math.floor(most * 1000) / 1000} or a larger "
            "model.backbone.vocab_size (random init)"
        )
    return list(config.rollout.stop_token_ids) + sorted(free[:need])


def _eos(config: RunConfig) -> int | None:
    from splitrl.controller.preflight import load_checked_tokenizer

    return load_checked_tokenizer(config).eos_token_id


def _describe_ids(ids: list[int]) -> str:
    """``3039 ids in 148897-151935`` rather than the ids themselves (thousands of them)."""
    return f"{len(ids)} id(s) in {min(ids)}-{max(ids)}" if ids else "none"


def _run_config(args: argparse.Namespace, overrides: list[str]) -> RunConfig:
    """A run's config: ``--config`` (default: the CPU demo preset) with ``overrides``."""
    return load_config(args.config, overrides, preset=None if args.config else DEMO_PRESET)


def _overrides(args: argparse.Namespace, name: str, steps: int, out) -> list[str]:
    """The overrides of one run of schedule ``name``: the user's, then the bench's."""
    base = list(args.overrides) + ([f"cluster.device={args.device}"] if args.device else [])
    if getattr(args, "stop_ids", None) is not None:
        base.append(f"rollout.stop_token_ids=[{','.join(map(str, args.stop_ids))}]")
    return base + COMMON + SCHEDULES[name] + [f"schedule.num_steps={steps}", f"output_dir={out}"]


def figures(config: RunConfig, runs: list[list[dict[str, float]]]) -> dict[str, float]:
    """Steady-state throughput of a schedule's runs (steps 2..N of each, pooled) by the formulas
    of the module docstring; ``runs`` holds each run's per-step metrics."""
    per_step = config.schedule.groups_per_step * config.schedule.group_size
    steady = [m for metrics in runs for m in metrics[1:]]
    wall = sum(m["timing/step_s"] for m in steady)
    gen = sum(m["rollout/response_length_mean"] * per_step for m in steady)
    trained = sum((m["rollout/prompt_length_mean"] + m["rollout/response_length_mean"]) * per_step for m in steady)
    n = len(steady)
    return {
        "step1_s": sum(metrics[0]["timing/step_s"] for metrics in runs) / len(runs),
        "step_s": wall / n,
        "samples_per_s": n * per_step / wall,
        "gen_tokens_per_s": gen / wall,
        "trained_tokens_per_s": trained / wall,
        "wait_s": sum(m["timing/exposed_wait_s"] for m in steady) / n,
        "overlap_s": sum(m["timing/generation_during_train_s"] for m in steady) / n,
        "reward": steady[-1]["train/reward"],
        # how ragged the step was: observed lengths (tokens) and the share cut at max_new_tokens
        "response_length_mean": sum(m["rollout/response_length_mean"] for m in steady) / n,
        "response_length_max": max(m["rollout/response_length_max"] for m in steady),
        "truncation_rate": sum(m["rollout/truncation_rate"] for m in steady) / n,
    }


def _load() -> str:
    """The machine's 1-minute load average and its core count, e.g. ``3.2 on 2 cores``."""
    try:
        return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the bench; returns each schedule's :func:`figures` (also printed as a table)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"command: python bench/bench_e2e.py {shlex.join(argv)}", flush=True)
    root = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    names = args.schedules.split(",")
    order = [n for r in range(args.repeats) for n in (names if r % 2 == 0 else names[::-1])]
    if args.warmup_steps:
        order.insert(0, "warm-up")
    runs: dict[str, list[list[dict[str, float]]]] = {n: [] for n in names}
    configs: dict[str, RunConfig] = {}
    try:
        for i, name in enumerate(order):
            out = root / f"{i}_{name.replace(' ', '_').replace('=', '')}"
            steps = args.warmup_steps if name == "warm-up" else args.steps
            cfg = _run_config(args, _overrides(args, names[0] if name == "warm-up" else name, steps, out))
            if i == 0:
                cl, sc = cfg.cluster, cfg.schedule
                dev = cl.device if cl.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
                where = (
                    torch.cuda.get_device_name()
                    if dev == "cuda"
                    else f"CPU ({platform.processor() or platform.machine()})"
                )
                placement = resolve_placement(
                    cl.placement, resolve_backend(cfg), dev, cl.num_generation_workers, cl.num_train_workers
                )
                print(
                    f"{where}, torch {torch.__version__}, backend {resolve_backend(cfg)}, placement {placement}, "
                    f"{cl.num_generation_workers} generation + {cl.num_train_workers} train worker(s); a step = "
                    f"{sc.groups_per_step} prompt{'s' * (sc.groups_per_step != 1)} x {sc.group_size} samples, "
                    f"<= {cfg.rollout.max_new_tokens} new tokens, chunks of {sc.min_groups_per_chunk} "
                    f"group{'s' * (sc.min_groups_per_chunk != 1)}; "
                    f"{args.steps} steps per run, figures over steps 2-{args.steps}; run order {order}; "
                    f"runs under {root}; load average {_load()} at the start",
                    flush=True,
                )
                if args.stop_note:
                    print(args.stop_note, flush=True)
            t0 = time.perf_counter()
            res = train(cfg)
            if res.interrupted:  # Ctrl-C / SIGTERM: the user's stop, not a bench failure (no traceback)
                sig = res.interrupt_signal or signal.SIGINT
                print(
                    f"{name}: stopped by {signal.Signals(sig).name} after {res.steps_done} of {steps} steps; "
                    "the lines above are what was measured",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(128 + sig)
            if res.steps_done != steps or len(res.metrics) != steps:
                raise RuntimeError(f"{name}: the run stopped after {res.steps_done} of {steps} steps")
            if name != "warm-up":
                runs[name].append(res.metrics)
                configs[name] = cfg
            line = ""
            if name != "warm-up":  # printed now, so that a run cut short still reports what it measured
                f = figures(cfg, [res.metrics])
                line = f", this run: {f['samples_per_s']:.1f} samples/s, step {f['step_s']:.3f} s, wait {f['wait_s']:.3f} s"
            print(f"  {name}: done in {time.perf_counter() - t0:.0f} s{line}", flush=True)
            del res
            shutil.rmtree(out / "checkpoints", ignore_errors=True)  # 10 GB a run for the 0.6 B model
            gc.collect()  # the finished run's models and engines, before the next run builds its own
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        if not args.output_dir:
            shutil.rmtree(root, ignore_errors=True)
        if "ray" in sys.modules:
            import ray

            if ray.is_initialized():
                ray.shutdown()
    print(f"load average {_load()} at the end (other jobs on this machine slow some runs more than others)")
    results = {n: figures(configs[n], runs[n]) for n in names}
    ref = results.get("sync")
    head = (
        f"{'schedule':<17} {'samples/s':>10} {'gen tok/s':>11} {'train tok/s':>12} {'x sync':>7} "
        f"{'step s':>8} {'wait s':>8} {'overlap s':>10} {'step 1 s':>9} {'reward':>7} "
        f"{'resp mean':>9} {'resp max':>8} {'cut':>5}"
    )
    print(head)
    for name, f in results.items():
        # without a sync run there is nothing to divide by: a dash, not "nanx"
        ratio = f"{f['samples_per_s'] / ref['samples_per_s']:>6.2f}x" if ref else f"{'-':>7}"
        print(
            f"{name:<17} {f['samples_per_s']:>10.1f} {f['gen_tokens_per_s']:>11.0f} {f['trained_tokens_per_s']:>12.0f} "
            f"{ratio} {f['step_s']:>8.3f} {f['wait_s']:>8.3f} {f['overlap_s']:>10.3f} {f['step1_s']:>9.1f} "
            f"{f['reward']:>7.3f} {f['response_length_mean']:>9.1f} {f['response_length_max']:>8.0f} "
            f"{f['truncation_rate']:>5.2f}",
            flush=True,
        )
    print(
        f"resp mean / max: response length in tokens (<= {configs[names[0]].rollout.max_new_tokens}), mean over the "
        "steady steps / largest; cut: share of responses that reached max_new_tokens"
    )
    return results


if __name__ == "__main__":
    main()
