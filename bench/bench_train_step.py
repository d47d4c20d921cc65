"""Throughput, MFU and memory of the train step against plain Hugging Face, in one run.

One run measures, on one device, with the same random-init Qwen3-shaped model and one step of
ragged GRPO samples:

- plain Hugging Face forward/backward + fused AdamW (what a user already has: fp32 weights under
  bf16 autocast, next-token CE) on the *same padded rows* the microbatch builder makes, and on
  full-length rows;
- the splitrl synchronous step without MTP and with ``--mtp`` depths, on padded and on packed
  rows, and the split step fed as 1, 4 and 16 chunks (packed, with MTP), timed in rounds that
  alternate with the synchronous step (their ratio: median over forward-reverse pairs of rounds);
- packed rows with the other attention kernel (``SpeedConfig.packed_attention``: flex / varlen);
- the rows above run eager decoder layers; then the packed steps with MTP run again with
  compiled decoder layers (``SpeedConfig.compile_layers``, the default on one GPU);
- peak memory of one packed step with MTP at 16 k and 32 k tokens per microbatch, with and without
  activation checkpointing, next to the memory planner's estimate (``splitrl.train.memory_plan``).

``--mode planned`` (the default of the 1.7B / 4B / 8B presets) runs one configuration instead: the
synchronous splitrl step on packed rows with ``--mtp`` depths (default 1) and compiled layers,
with the microbatch budget and activation checkpointing the memory planner chooses (``--max-tokens
auto``, ``--ckpt auto``; give numbers / on / off to force them) and ``--offload`` for the
CPU-offloaded AdamW (``train.optim.offload: cpu``). It prints the plan's line, tokens/s, MFU and
the measured peak memory next to the estimate, and with offload the host step's phases.

Tokens/s counts real tokens (no padding). MFU = model FLOPs / (time · peak), with model FLOPs of a
step (Kaplan et al. 2020 "6N" for matrix products, plus attention):

    F = 6 · T · P_mm  +  12 · n_h · d_h · (n_layers + D) · Σ_samples L_i (L_i + 1) / 2

    P_mm = backbone matrix parameters per token (decoder layers + output head V·H; the embedding
           lookup is not a matrix product) + D · (MTP decoder layer + eh_proj 2H·H + output head V·H)

T = real tokens, L_i = sample lengths, n_h·d_h = query heads × head dim; the attention term is
causal QKᵀ and PV (2 · 2 · n_h · d_h per attended pair, L(L+1)/2 pairs per sample) × 3 for forward
+ backward. Plain HF is counted with the same formula and D = 0. Peak: 989 TFLOP/s dense bf16 (H200).

    python bench/bench_train_step.py --device cuda --preset qwen3-0.6b --mtp 2
    python bench/bench_train_step.py --device cpu --preset tiny --repeats 1
    python bench/bench_train_step.py --device cuda --preset qwen3-4b                 # planned mode
    python bench/bench_train_step.py --device cuda --preset qwen3-8b --offload
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from splitrl.loss import GRPOLossConfig, make_loss
from splitrl.models import ModelConfig, MTPConfig, PolicyModel
from splitrl.train import (
    MemoryConfig,
    MicrobatchConfig,
    OptimConfig,
    SpeedConfig,
    TrainBatch,
    TrainConfig,
    TrainWorker,
)
from splitrl.train.memory_plan import GiB, ModelShape, estimate_peak
from splitrl.train.microbatch import build_microbatches
from splitrl.train.speed import compile_layers, set_activation_checkpointing

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py, beside this script (tests load it by path)
from shapes import QWEN3_SHAPES  # noqa: E402

PRESETS = {
    "tiny": dict(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    # the Qwen3 release shapes (random init; vocabulary and heads as released)
    **{
        name: dict(shape, tie_word_embeddings=name != "qwen3-8b", max_position_embeddings=4096)
        for name, shape in QWEN3_SHAPES.items()
    },
}
# presets whose default is --mode planned (the full comparison would not fit or take too long)
PLANNED_PRESETS = {"qwen3-1.7b", "qwen3-4b", "qwen3-8b"}
PEAK_TFLOPS = {"cuda": 989.0}  # H200 dense bf16


def make_batch(n: int, prompt: int, response: int, vocab: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids, tm, lp = [], [], []
    for _ in range(n):
        P = int(torch.randint(prompt // 2, prompt + 1, (), generator=g))
        R = int(torch.randint(response // 2, response + 1, (), generator=g))
        ids.append(torch.randint(0, vocab, (P + R,), generator=g))
        tm.append(torch.cat([torch.zeros(P), torch.ones(R)]))
        lp.append(-torch.rand(P + R, generator=g))
    return TrainBatch(ids, tm, torch.randn(n, generator=g), generation_logprobs=lp)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Seconds of one call of ``fn``, the device's queued work included."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def time_it(fn, device: str, repeats: int, warmups: int = 1) -> float:
    for _ in range(warmups):  # first calls pay kernel selection and compilation
        fn()
    return statistics.median(timed(fn, device) for _ in range(repeats))


def time_interleaved(fns: dict[str, object], device: str, repeats: int, warmups: int = 1):
    """Median seconds of each of ``fns``, and per function its speed relative to the first one.

    Rounds run every function once, in forward then reverse order (A B C, C B A, ...; ``repeats``
    is rounded up to an even count). The relative speed is t_first / t_function within a round;
    the two rounds of a forward-reverse pair are combined by their geometric mean, which cancels a
    steady drift of the device's speed (clocks, other jobs); the figure is the median over pairs.
    On the GPU a one-after-the-other order made configurations measured later look slower than the
    same work measured first (bench/RESULTS.md).
    """
    names = list(fns)
    repeats += repeats % 2
    for name in names:
        for _ in range(warmups):
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(timed(fns[name], device))
    base = times[names[0]]
    med = {n: statistics.median(ts) for n, ts in times.items()}
    ratio = {}
    for n, ts in times.items():
        per_round = [b / t for b, t in zip(base, ts)]
        ratio[n] = statistics.median(math.sqrt(per_round[i] * per_round[i + 1]) for i in range(0, repeats, 2))
    return med, ratio


def model_flops(cfg: dict, lengths: list[int], D: int) -> float:
    """F of the module docstring for one step over samples of the given lengths."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hq, hkv, dh, ffn = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
    layer = H * (hq * dh) * 2 + H * (hkv * dh) * 2 + 3 * H * ffn
    p_mm = L * layer + V * H + D * (layer + 2 * H * H + V * H)
    T = sum(lengths)
    attn = 12 * hq * dh * (L + D) * sum(n * (n + 1) / 2 for n in lengths)
    return 6 * T * p_mm + attn


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"a token budget is >= 2 or auto, got {text}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument(
        "--mode",
        choices=["full", "planned"],
        default=None,
        help="full: the comparison of the module docstring; planned: one configuration as the memory planner "
        "chooses (default for the 1.7b / 4b / 8b presets)",
    )
    ap.add_argument("--mtp", type=int, default=None, help="MTP depths of the MTP runs (default: 2 full, 1 planned)")
    ap.add_argument("--samples", type=int, default=None, help="samples of a step (default: 16 full, 32 planned)")
    ap.add_argument(
        "--also-samples",
        type=int,
        nargs="*",
        default=[],
        help="planned mode: time steps of these sample counts too, with the same worker (after the --samples step)",
    )
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=1792)
    ap.add_argument(
        "--max-tokens",
        type=_budget,
        default=None,
        help="token budget per microbatch, or auto (the planner's; default: 8192 full, auto planned)",
    )
    ap.add_argument("--ckpt", choices=["auto", "on", "off"], default="auto", help="activation checkpointing (planned)")
    ap.add_argument(
        "--offload", action="store_true", help="AdamW state and fp32 masters on the CPU (train.optim.offload)"
    )
    ap.add_argument(
        "--memory-gib", type=float, default=None, help="plan against this memory (train.memory.device_memory_gib)"
    )
    ap.add_argument("--memory-budgets", type=int, nargs="*", default=[16384, 32768])
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled-layer runs (planned: eager layers)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    planned = args.mode == "planned" or (args.mode is None and args.preset in PLANNED_PRESETS)
    args.mode = "planned" if planned else "full"
    args.mtp = args.mtp if args.mtp is not None else (1 if planned else 2)
    args.samples = args.samples if args.samples is not None else (32 if planned else 16)
    args.max_tokens = args.max_tokens if args.max_tokens is not None else ("auto" if planned else 8192)
    if args.mode == "full" and args.max_tokens == "auto":
        ap.error("--max-tokens auto is for --mode planned; the full comparison runs every row at one given budget")
    return args


def memory_config(args) -> MemoryConfig:
    return MemoryConfig(device_memory_gib=args.memory_gib) if args.memory_gib else MemoryConfig()


def peak_line(worker: TrainWorker, device: str, step: int) -> str:
    """The measured peak of the steps since the last reset next to the plan's estimate."""
    if device != "cuda":
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return (
            f"  peak memory: not measured on {device} (process max RSS {rss / GiB:.2f} GiB); estimated "
            f"{worker.memory_plan.estimate.peak / GiB:.2f} GiB"
        )
    measured = torch.cuda.max_memory_allocated() - worker._memory_base
    line, _ = worker.memory_plan.compare(measured, step)
    return "  " + line


def run_planned(args) -> None:
    """One configuration, as the memory planner chooses it (module docstring)."""
    dev = args.device
    precision = "bf16" if dev == "cuda" else "fp32"
    cfg = PRESETS[args.preset]
    print(
        f"{args.preset} + {args.mtp} MTP; {precision} on {dev}; packed rows; microbatch budget {args.max_tokens}, "
        f"activation checkpointing {args.ckpt}, offload {'cpu' if args.offload else 'none'}",
        flush=True,
    )
    t0 = time.perf_counter()
    # random init on the device (on a CPU the 8B shape's init took 141 s); offload wants the fp32
    # masters on the host, so the initialized model goes there
    with torch.device(dev):
        model = PolicyModel.from_config(ModelConfig(backbone=cfg, mtp=MTPConfig(mtp_num_layers=args.mtp)))
    if args.offload:
        model = model.to("cpu")
    ckpt = {"auto": "auto", "on": True, "off": False}[args.ckpt]
    worker = TrainWorker(
        model,
        TrainConfig(
            precision=precision,
            device=dev,
            optim=OptimConfig(lr=1e-6, offload="cpu" if args.offload else "none"),
            microbatch=MicrobatchConfig(max_tokens_per_microbatch=args.max_tokens, pack_sequences=True),
            speed=SpeedConfig(compile_layers=not args.no_compile, activation_checkpointing=ckpt),
            memory=memory_config(args),
        ),
    )
    plan = worker.memory_plan
    print(f"  built in {time.perf_counter() - t0:.1f} s; {plan.summary()}", flush=True)
    loss = make_loss(GRPOLossConfig())
    for k, samples in enumerate([args.samples, *args.also_samples]):
        batch = make_batch(samples, args.prompt, args.response, cfg["vocab_size"], seed=k)
        print(
            f"step = {samples} sample{'s' * (samples != 1)}, {batch.num_tokens} tokens "
            f"(lengths {min(batch.lengths)}-{max(batch.lengths)})",
            flush=True,
        )
        for i in range(2 if k == 0 else 1):  # compilation and kernel selection; the AdamW state appears in the first
            t = timed(lambda: worker.train(batch, loss), dev)
            print(f"  warm-up step {i + 1}: {t:.2f} s", flush=True)
            if i == 0 and k == 0:
                print(peak_line(worker, dev, 1), flush=True)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = [timed(lambda: worker.train(batch, loss), dev) for _ in range(args.repeats)]
        t = statistics.median(times)
        tps = batch.num_tokens / t
        line = f"splitrl, {args.mtp} MTP, packed, sync, planned, {samples} samples: {t * 1e3:8.1f} ms/step {tps:9.0f} tokens/s"
        peak_tf = PEAK_TFLOPS.get(dev)
        if peak_tf:
            line += f"  MFU {100 * model_flops(cfg, batch.lengths, args.mtp) / t / (peak_tf * 1e12):5.1f}%"
        print(line, flush=True)
        print(peak_line(worker, dev, 2), flush=True)
        if worker.offload is not None:
            phases = ", ".join(f"{name} {v:.2f} s" for name, v in worker.offload.timings.items())
            print(f"  offloaded AdamW step (last step): {phases}; {len(worker.offload.buckets)} buckets", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command: python bench/bench_train_step.py " + shlex.join(sys.argv[1:] if argv is None else argv), flush=True)
    if args.mode == "planned":
        run_planned(args)
        return
    dev = args.device
    precision = "bf16" if dev == "cuda" else "fp32"
    cfg = PRESETS[args.preset]
    batch = make_batch(args.samples, args.prompt, args.response, cfg["vocab_size"])
    tokens = batch.num_tokens
    peak_tf = PEAK_TFLOPS.get(dev)
    results: dict[str, float] = {}
    print(
        f"{args.preset}; {precision} on {dev}; step = {args.samples} sample{'s' * (args.samples != 1)}, "
        f"{tokens} tokens "
        f"(lengths {min(batch.lengths)}-{max(batch.lengths)}); microbatch budget {args.max_tokens} tokens",
        flush=True,
    )

    def report(name: str, t: float, lengths: list[int], D: int) -> float:
        tps = sum(lengths) / t
        line = f"{name:<52} {t * 1e3:8.1f} ms/step {tps:9.0f} tokens/s"
        if peak_tf:
            line += f"  MFU {100 * model_flops(cfg, lengths, D) / t / (peak_tf * 1e12):5.1f}%"
        print(line, flush=True)
        results[name] = tps
        return tps

    # --- plain Hugging Face: the same padded rows, and full-length rows
    from transformers import AutoModelForCausalLM, Qwen3Config

    hf = AutoModelForCausalLM.from_config(Qwen3Config(**cfg), dtype=torch.float32).to(dev)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=dev == "cuda")
    padded = [
        mb.to(dev) for mb in build_microbatches(batch, MicrobatchConfig(max_tokens_per_microbatch=args.max_tokens))
    ]
    Lmax = args.prompt + args.response
    full = torch.randint(0, cfg["vocab_size"], (max(1, tokens // Lmax), Lmax), device=dev)

    def hf_step(rows):
        for ids, labels in rows:
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=precision == "bf16"):
                out = hf(input_ids=ids, labels=labels)
            out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    hf_padded = [(mb.input_ids, torch.where(mb.segment_ids >= 0, mb.input_ids, -100)) for mb in padded]
    h_pad = report(
        "plain HF, padded rows (same as splitrl's)",
        time_it(lambda: hf_step(hf_padded), dev, args.repeats),
        batch.lengths,
        0,
    )
    report(
        f"plain HF, full rows ({full.shape[0]} x {Lmax})",
        time_it(lambda: hf_step([(full, full)]), dev, args.repeats),
        [Lmax] * full.shape[0],
        0,
    )
    hf = opt = padded = hf_padded = full = None
    if dev == "cuda":
        torch.cuda.empty_cache()

    loss = make_loss(GRPOLossConfig())

    def chunks_of(k: int) -> list[TrainBatch]:
        per = -(-args.samples // k)
        return [batch.select(list(range(i, min(i + per, args.samples)))) for i in range(0, args.samples, per)]

    def split_step(worker, chunks):
        worker.begin_train_step(loss)
        for c in chunks:
            worker.train_microbatch(c)
        worker.finish_train_step()

    def set_layout(worker, pack: bool, budget: int):
        worker.config.microbatch = MicrobatchConfig(max_tokens_per_microbatch=budget, pack_sequences=pack)

    for D in (0, args.mtp):
        model = PolicyModel.from_config(ModelConfig(backbone=cfg, mtp=MTPConfig(mtp_num_layers=D)))
        worker = TrainWorker(
            model,
            TrainConfig(
                precision=precision,
                device=dev,
                optim=OptimConfig(lr=1e-6, offload="cpu" if args.offload else "none"),
                # the rows below set their layout and checkpointing themselves
                speed=SpeedConfig(compile_layers=False, activation_checkpointing=False),
                memory=memory_config(args),
            ),
        )
        tag = f"splitrl, {D} MTP"
        for pack in (False, True):
            set_layout(worker, pack, args.max_tokens)
            report(
                f"{tag}, {'packed' if pack else 'padded'}, sync",
                time_it(lambda: worker.train(batch, loss), dev, args.repeats),
                batch.lengths,
                D,
            )
        if dev == "cuda":
            try:  # the other packed-attention kernel, for the choice of the default
                model.packed_attention = "varlen"
                report(
                    f"{tag}, packed, sync, varlen attention",
                    time_it(lambda: worker.train(batch, loss), dev, args.repeats),
                    batch.lengths,
                    D,
                )
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  varlen attention failed: {type(e).__name__}: {e}"[:1500], flush=True)
            model.packed_attention = "flex"
        if D > 0:
            # sync and the split steps in alternating rounds: their ratio is the figure (DESIGN §2: same work)
            fns = {f"{tag}, packed, sync": lambda: worker.train(batch, loss)}
            for k in (1, 4, 16):
                fns[f"{tag}, packed, split {k} chunks"] = (lambda cs: lambda: split_step(worker, cs))(chunks_of(k))
            med, ratio = time_interleaved(fns, dev, max(args.repeats, 2))
            for name, t in med.items():
                report(name + " (interleaved)" if name.endswith("sync") else name, t, batch.lengths, D)
            print(
                "  split / sync (interleaved rounds, median over forward-reverse pairs): "
                + ", ".join(f"{k} chunks {ratio[f'{tag}, packed, split {k} chunks']:.3f}" for k in (1, 4, 16)),
                flush=True,
            )
            results[f"{tag}, split 16 / sync"] = ratio[f"{tag}, packed, split 16 chunks"]
        if D > 0 and dev == "cuda":
            for budget in args.memory_budgets:
                big = make_batch(2 * args.samples, args.prompt, args.response, cfg["vocab_size"], seed=1)
                set_layout(worker, True, budget)
                for ckpt in (False, True):
                    set_activation_checkpointing(model, ckpt)
                    # optimizer state exists already: the first step at this budget shows the peak
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    t = time.perf_counter()
                    worker.train(big, loss)
                    torch.cuda.synchronize()
                    t = time.perf_counter() - t
                    est = estimate_peak(
                        ModelShape.from_hf_config(model.config, model.mtp_config),
                        budget,
                        worker.memory_plan.layout,
                        checkpointing=ckpt,
                        compiled=False,
                        fused_head=worker.config.speed.fused_head_kernels,
                        device_type=dev,
                    )
                    print(
                        f"  peak memory, packed, {D} MTP, {budget} tokens/microbatch, activation checkpointing "
                        f"{'on ' if ckpt else 'off'}: {torch.cuda.max_memory_allocated() / 2**30:5.1f} GiB "
                        f"(planner's estimate {est.peak / GiB:5.1f} GiB; {big.num_tokens / t:.0f} tokens/s)",
                        flush=True,
                    )
                set_activation_checkpointing(model, False)
        if D == args.mtp:
            summarize(results, h_pad, D)
        if not args.no_compile and dev == "cuda":
            try:
                compile_layers(model)
                set_layout(worker, True, args.max_tokens)
                if D == 0:
                    c = report(
                        f"{tag}, packed, sync, compiled layers",
                        time_it(lambda: worker.train(batch, loss), dev, args.repeats, warmups=2),
                        batch.lengths,
                        D,
                    )
                    line = f"; no MTP, splitrl packed compiled / plain HF padded: {c / h_pad:.3f}"
                else:
                    cs = chunks_of(16)
                    fns = {"sync": lambda: worker.train(batch, loss), "split 16": lambda: split_step(worker, cs)}
                    med, ratio = time_interleaved(fns, dev, max(args.repeats, 2), warmups=2)
                    c = report(f"{tag}, packed, sync, compiled layers", med["sync"], batch.lengths, D)
                    report(f"{tag}, packed, split 16 chunks, compiled layers", med["split 16"], batch.lengths, D)
                    line = f"; compiled split 16 / sync (interleaved rounds): {ratio['split 16']:.3f}"
                print(
                    f"  compiled / eager layers ({tag}, packed, sync): {c / results[f'{tag}, packed, sync']:.3f}"
                    + line,
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001 - report and keep the figures above
                print(f"  compiled layers failed: {type(e).__name__}: {e}"[:2000])
        worker = model = None
        if dev == "cuda":
            torch.cuda.empty_cache()


def summarize(r: dict[str, float], h_pad: float, D: int) -> None:
    print("summary:")
    print(f"  no MTP, splitrl padded / plain HF padded: {r['splitrl, 0 MTP, padded, sync'] / h_pad:.3f}")
    print(f"  no MTP, splitrl packed / plain HF padded: {r['splitrl, 0 MTP, packed, sync'] / h_pad:.3f}")
    print(
        f"  {D} MTP, split 16 chunks / sync (packed, interleaved rounds): {r[f'splitrl, {D} MTP, split 16 / sync']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
