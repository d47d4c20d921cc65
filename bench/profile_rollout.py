"""Where a rollout call's time goes: the GPU timeline of whole ``generate`` calls, plain and
speculative, and the call's phases.

For each batch size and kind (plain, speculative with the switch-off rule off), after warm-up calls
(CUDA-graph captures, compilations) on the same engine:

- ``walls``: three unprofiled calls, ms;
- one call under torch.profiler: its GPU span, the summed kernel time, the idle gaps between
  kernels (count and total over 20 us, and the kernels they follow: a host sync shows as a gap
  after "Memcpy DtoH", an eager prefill as gaps between its GEMMs), the decode chunks the engine
  ran (rows bucket, cache bucket, steps), and the top kernels per decode forward (us and launches
  per forward: a speculative forward is one verify);
- with ``--phases``: one more call with a synchronize around each phase (prefills, decode chunks,
  collections of finished rows, compactions): seconds and counts, and the rest.

The profiled call is slower than the unprofiled ones (the profiler's host overhead widens the
gaps); compare kinds within a run. On a CPU there are no kernels: only walls, chunks and phases.

    python bench/profile_rollout.py --device cuda --preset qwen3-0.6b --batch-sizes 1,32 --phases
    python bench/profile_rollout.py --device cuda --preset qwen3-0.6b --ragged 1024 --phases   # the ragged call

Figures measured with the scripts this was made from: bench/RESULTS.md (rollout decoding).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_rollout as br  # noqa: E402
from splitrl.rollout import GenerationConfig, RolloutEngine  # noqa: E402
from splitrl.rollout.scheduler import Scheduler  # noqa: E402

GAP_US = 20.0  # idle stretches longer than this are listed


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--preset", default=None, choices=sorted(br.PRESETS), help="the model (default qwen3-0.6b on cuda, tiny on cpu)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU (1 steadies a shared CPU)")
    p.add_argument(
        "--batch-sizes", default=None, type=br._batch_sizes, help="comma list of positive ints (default 1,32)"
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (not with --ragged)")
    p.add_argument(
        "--train-mtp-steps",
        type=int,
        default=None,
        help="MTP warm-up steps, as in the bench (default 600 on cuda, 200 on cpu)",
    )
    p.add_argument(
        "--mtp-samples", type=int, default=None, help="the warm-up's samples (default 2048 on cuda, 256 on cpu)"
    )
    p.add_argument(
        "--mtp-objective", default="distill", choices=["distill", "ce"], help="the warm-up's loss, as in the bench"
    )
    p.add_argument(
        "--ragged",
        type=int,
        default=0,
        help="profile the bench's ragged call of this many samples instead (0, the default: off; its slots "
        "and new tokens are bench_rollout's --ragged-batch and --ragged-max-new defaults; not with "
        "--batch-sizes or --new-tokens)",
    )
    p.add_argument("--phases", action="store_true", help="also time the phases of one call (synchronized)")
    p.add_argument("--top", type=int, default=20, help="kernels listed per call")
    p.add_argument(
        "--kinds",
        default="plain,speculative",
        help="comma list of the calls to profile: plain, speculative (default both; plain alone needs no MTP warm-up)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="drafts a verify of the speculative calls (default: every MTP depth; fewer is a kind the "
        "engine's measured choice tries)",
    )
    args = p.parse_args(argv)
    for name in ("prompt_len", "new_tokens", "top"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_draft_tokens is not None and not 1 <= args.num_draft_tokens <= 2:
        p.error(f"--num-draft-tokens must be 1 or 2 (the bench's MTP depths), got {args.num_draft_tokens}")
    for name in ("train_mtp_steps", "ragged"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.ragged and (args.batch_sizes is not None or args.new_tokens is not None):
        p.error(
            "--ragged profiles one ragged call (its slots and new tokens are bench_rollout's --ragged-batch and "
            "--ragged-max-new); leave out --batch-sizes and --new-tokens"
        )
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    args.preset = args.preset or ("qwen3-0.6b" if args.device == "cuda" else "tiny")
    args.batch_sizes = args.batch_sizes or "1,32"
    args.new_tokens = 128 if args.new_tokens is None else args.new_tokens
    kinds = [k.strip() for k in args.kinds.split(",")]
    if any(k not in ("plain", "speculative") for k in kinds) or len(set(kinds)) != len(kinds):
        p.error(f"--kinds takes a comma list of plain, speculative, each at most once; got {args.kinds!r}")
    args.kinds = kinds
    if "speculative" not in kinds:  # the warm-up and the drafts are read only for speculative calls
        given = [flag for flag, on in (("--train-mtp-steps", args.train_mtp_steps is not None),
                                       ("--mtp-samples", args.mtp_samples is not None),
                                       ("--mtp-objective", args.mtp_objective != "distill"),
                                       ("--num-draft-tokens", args.num_draft_tokens != p.get_default("num_draft_tokens")))
                 if on]  # fmt: skip
        if given:
            p.error(f"{', '.join(given)}: read only when --kinds includes speculative")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU is visible here; use --device cpu")
    args.bench = bench_args(args, p)  # bench_rollout's checks, reported as this script's usage errors
    return args


def bench_args(args: argparse.Namespace, errors: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """bench_rollout's settings for the same model, lengths and MTP warm-up (their mistakes: usage
    errors of ``errors``, this script's parser)."""
    argv = ["--device", args.device, "--preset", args.preset, "--batch-sizes", args.batch_sizes, "--speculative",
            "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
            "--mtp-objective", args.mtp_objective]  # fmt: skip
    for flag, value in (("--train-mtp-steps", args.train_mtp_steps), ("--mtp-samples", args.mtp_samples)):
        if value is not None:  # else the bench's defaults for the device
            argv += [flag, str(value)]
    if args.ragged:
        argv += ["--ragged", str(args.ragged)]
    return br.parse_args(argv, errors)


def timeline(trace_path: str, forwards: int, top: int) -> list[str]:
    """Summary lines of a chrome trace: GPU span, kernel sum, gaps, top kernels per forward."""
    events = json.load(open(trace_path))["traceEvents"]
    device = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    if not device:
        return ["  no device kernels in the trace (a CPU run)"]
    busy, end, after = 0.0, None, ""
    gaps: list[tuple[float, str]] = []
    for e in device:
        start, dur = e["ts"], e.get("dur", 0)
        if end is not None and start > end:
            gaps.append((start - end, after))
        busy += dur
        if end is None or start + dur > end:
            end, after = start + dur, e["name"][:60]
    span = end - device[0]["ts"]
    big = [g for g in gaps if g[0] > GAP_US]
    by_follower = collections.Counter()
    for g, name in big:
        by_follower[name] += g
    time_by, count_by = collections.Counter(), collections.Counter()
    for e in device:
        time_by[e["name"][:80]] += e.get("dur", 0)
        count_by[e["name"][:80]] += 1
    n = max(1, forwards)
    lines = [
        f"  GPU span {span / 1e3:.1f} ms, kernels {busy / 1e3:.1f} ms ({100 * busy / span:.0f}% busy); "
        f"{len(big)} gap{'s' * (len(big) != 1)} > {GAP_US:.0f} us totalling {sum(g for g, _ in big) / 1e3:.1f} ms",
        "  gaps after (ms): " + ", ".join(f"{name} {g / 1e3:.2f}" for name, g in by_follower.most_common(6)),
        f"  top kernels, us and launches per forward ({forwards} forward{'s' * (forwards != 1)}):",
    ]
    lines += [f"    {t / n:8.1f} {count_by[k] / n:6.2f}  {k}" for k, t in time_by.most_common(top)]
    return lines


class _Phases:
    """Wraps an engine's phase methods with a synchronize and a clock: the runner's as instance
    attributes, the scheduler's (one scheduler a call) on its class until :meth:`close`."""

    def __init__(self, engine: RolloutEngine, device: str):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        for attr, name in (("prefill", "prefills"), ("run_steps", "decode chunks")):
            setattr(engine.runner, attr, self._timed(getattr(engine.runner, attr), name, device, generator=False))
        self._originals = {attr: getattr(Scheduler, attr) for attr in ("collect", "compact")}
        for attr, name in (("collect", "collections"), ("compact", "compactions")):
            setattr(Scheduler, attr, self._timed(self._originals[attr], name, device, generator=attr == "collect"))

    def close(self) -> None:
        for attr, fn in self._originals.items():
            setattr(Scheduler, attr, fn)

    def _timed(self, fn, name: str, device: str, generator: bool):
        def run(*a, **k):
            br.sync(device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if generator:
                out = list(out)  # the collection's device reads happen when it is consumed
            br.sync(device)
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return iter(out) if generator else out

        return run


def profile_call(model, args, label: str, cfg: GenerationConfig, prompts, seeds) -> None:
    """Profile one kind of call (see the module docstring) and print its summary."""
    from torch.profiler import ProfilerActivity, profile

    out: list[str] = []
    engine = RolloutEngine(model, cfg, args.device)
    engine.speculative_switch_off = False
    chunks: list[tuple[int, int, int]] = []
    run_steps = engine.runner.run_steps

    def recording(kind, B, L, n):
        chunks.append((B, L, n))
        return run_steps(kind, B, L, n)

    engine.runner.run_steps = recording
    for _ in range(2):  # captures, compilations
        engine.generate(prompts, seeds)
    walls = []
    for _ in range(3):
        br.sync(args.device)
        t0 = time.perf_counter()
        engine.generate(prompts, seeds)
        br.sync(args.device)
        walls.append(1e3 * (time.perf_counter() - t0))
    chunks.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    # one profiler a call; acc_events only silences torch's warning that a new cycle clears events
    with profile(activities=activities, acc_events=True) as prof:
        br.sync(args.device)
        t0 = time.perf_counter()
        engine.generate(prompts, seeds)
        br.sync(args.device)
        wall = 1e3 * (time.perf_counter() - t0)
    st = engine.last_stats
    accepted = f", acceptance {st.acceptance_rate:.1f}%" if cfg.speculative else ""
    out.append(
        f"== {label}: walls {', '.join(f'{w:.1f}' for w in walls)} ms; profiled call {wall:.1f} ms, "
        f"{st.num_forwards} forward{'s' * (st.num_forwards != 1)}{accepted}; {len(chunks)} decode chunk"
        f"{'s' * (len(chunks) != 1)} (rows, cache, steps): "
        + " ".join(f"{b}/{length}/{n}" for b, length, n in chunks)
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        out.extend(timeline(path, st.num_forwards, args.top))
    if args.phases:
        phases = _Phases(engine, args.device)
        br.sync(args.device)
        t0 = time.perf_counter()
        try:
            engine.generate(prompts, seeds)
        finally:
            phases.close()
        br.sync(args.device)
        wall = time.perf_counter() - t0
        parts = ", ".join(f"{k} {v:.3f} s / {phases.calls[k]}" for k, v in phases.seconds.items())
        out.append(
            f"  phases (synchronized call, {wall:.3f} s): {parts}; rest {wall - sum(phases.seconds.values()):.3f} s"
        )
    print("\n".join(out), flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(f"command: python bench/profile_rollout.py {shlex.join(argv)}", flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    bargs = args.bench
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = br.build_model(bargs, dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    if bargs.train_mtp_steps and "speculative" in args.kinds:
        t0 = time.perf_counter()
        acceptance, samples = br.train_mtp_heads(model, bargs)
        print(br.describe_warm_up(bargs, acceptance, samples, time.perf_counter() - t0), flush=True)
    if args.ragged:
        stops = br.ragged_stop_ids(model, bargs)
        prompts = br.prompts_for(model, args.ragged, args.prompt_len, seed=8)
        seeds = list(range(20_000, 20_000 + args.ragged))
        base = dict(
            temperature=1.0, max_new_tokens=bargs.ragged_max_new, stop_token_ids=stops, batch_size=bargs.ragged_batch
        )
        for spec in [k == "speculative" for k in args.kinds]:
            label = (
                f"ragged {args.ragged} sample{'s' * (args.ragged != 1)}, {bargs.ragged_batch} slot"
                f"{'s' * (bargs.ragged_batch != 1)}, {'speculative' if spec else 'plain'}"
            )
            drafts = args.num_draft_tokens if spec else None
            cfg = GenerationConfig(speculative=spec, num_draft_tokens=drafts, **base)
            profile_call(model, args, label, cfg, prompts, seeds)
        return
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts, seeds = br.prompts_for(model, batch, args.prompt_len), list(range(batch))
        for spec in [k == "speculative" for k in args.kinds]:
            cfg = GenerationConfig(
                temperature=1.0, max_new_tokens=args.new_tokens, batch_size=batch, speculative=spec, stop_token_ids=[],
                num_draft_tokens=args.num_draft_tokens if spec else None,
            )  # fmt: skip
            drafts = cfg.num_draft_tokens
            kind = "plain" if not spec else (
                "speculative (every depth drafts a verify)" if drafts is None
                else f"speculative ({drafts} draft{'s' * (drafts != 1)} a verify)"
            )  # fmt: skip
            profile_call(model, args, f"batch {batch}, {kind}", cfg, prompts, seeds)


if __name__ == "__main__":
    main()
