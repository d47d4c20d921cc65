"""Where the time of one train step goes: torch.profiler on the split step and on plain HF.

Prints wall time, summed kernel time, idle gaps, the top kernels, cast kernels and host syncs of
one profiled step (after warm-ups), for a splitrl step and for a plain Hugging Face
forward/backward on the same padded rows.

    python bench/profile_train_step.py --preset qwen3-0.6b --what splitrl --max-tokens 8192 --no-pack
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_train_step import PRESETS, make_batch  # noqa: E402


def summarize(prof, title: str, wall_ms: float, out) -> None:
    path = f"/tmp/trace_{os.getpid()}.json"
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    kern = [e for e in ev if e.get("cat") == "kernel"]
    busy = sum(e["dur"] for e in kern) / 1e3
    t0 = min(e["ts"] for e in kern)
    t1 = max(e["ts"] + e["dur"] for e in kern)
    by = defaultdict(lambda: [0.0, 0])
    for e in kern:
        by[e["name"][:110]][0] += e["dur"] / 1e3
        by[e["name"][:110]][1] += 1
    runtime = [e for e in ev if e.get("cat") == "cuda_runtime"]
    syncs = defaultdict(lambda: [0.0, 0])
    for e in runtime:
        n = e["name"]
        if "Synchronize" in n or ("Memcpy" in n and "Async" not in n) or n == "cudaMemcpyAsync":
            syncs[n][0] += e["dur"] / 1e3
            syncs[n][1] += 1
    memcpy = [e for e in ev if e.get("cat") == "gpu_memcpy"]
    dtoh = [
        e for e in memcpy if "DtoH" in e["name"] or "Device -> Pageable" in e["name"] or "Device -> Pinned" in e["name"]
    ]
    casts = sum(v[0] for k, v in by.items() if "copy" in k.lower() or "cast" in k.lower())
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    p(f"=== {title}")
    p(
        f"wall {wall_ms:.1f} ms; kernel span {(t1 - t0) / 1e3:.1f} ms; kernel busy {busy:.1f} ms "
        f"({100 * busy / wall_ms:.0f}% of wall); launches {len(kern)}; cast/copy kernels {casts:.1f} ms; "
        f"DtoH copies {len(dtoh)}"
    )
    for n, (d, c) in sorted(syncs.items(), key=lambda x: -x[1][0]):
        p(f"  host-side {n}: {c} calls, {d:.1f} ms")
    p("  top kernels (ms, count):")
    for n, (d, c) in sorted(by.items(), key=lambda x: -x[1][0])[:22]:
        p(f"   {d:8.1f} {c:6d}  {n}")
    p(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))


def run_profiled(fn, title, out):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    print(f"{title}: unprofiled median {sorted(ts)[1] * 1e3:.1f} ms", file=out, flush=True)
    summarize(prof, title, wall, out)
    return sorted(ts)[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--what", choices=["splitrl", "hf"], default="splitrl")
    ap.add_argument("--mtp", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--no-pack", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--out", default="-")
    ap.add_argument("--samples", type=int, default=16)
    args = ap.parse_args()
    out = sys.stdout if args.out == "-" else open(args.out, "a")
    from splitrl.loss import GRPOLossConfig, make_loss
    from splitrl.models import ModelConfig, MTPConfig, PolicyModel
    from splitrl.train import MicrobatchConfig, OptimConfig, TrainConfig, TrainWorker
    from splitrl.train.microbatch import build_microbatches

    backbone = PRESETS[args.preset]
    batch = make_batch(args.samples, 256, 1792, backbone["vocab_size"])
    mbcfg = MicrobatchConfig(max_tokens_per_microbatch=args.max_tokens, pack_sequences=not args.no_pack)
    tag = f"{args.what} mtp={args.mtp} {'padded' if args.no_pack else 'packed'} budget={args.max_tokens}"
    if args.what == "splitrl":
        model = PolicyModel.from_config(ModelConfig(backbone=backbone, mtp=MTPConfig(mtp_num_layers=args.mtp)))
        extra = {}
        try:
            from splitrl.train.speed import SpeedConfig

            extra["speed"] = SpeedConfig(compile_layers=args.compile, activation_checkpointing=args.ckpt)
            tag += f" compile={args.compile} ckpt={args.ckpt}"
        except ImportError:
            tag += " (main branch code)"
        worker = TrainWorker(
            model, TrainConfig(precision="bf16", device="cuda", microbatch=mbcfg, optim=OptimConfig(lr=1e-6), **extra)
        )
        loss = make_loss(GRPOLossConfig())
        torch.cuda.reset_peak_memory_stats()
        t = run_profiled(lambda: worker.train(batch, loss), tag, out)
    else:
        from transformers import AutoModelForCausalLM, Qwen3Config

        hf = AutoModelForCausalLM.from_config(Qwen3Config(**backbone), dtype=torch.float32).cuda()
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=True)
        mbs = [mb.to("cuda") for mb in build_microbatches(batch, mbcfg)]

        def step():
            for mb in mbs:
                labels = torch.where(mb.segment_ids >= 0, mb.input_ids, -100)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    o = hf(input_ids=mb.input_ids, labels=labels)
                o.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        torch.cuda.reset_peak_memory_stats()
        t = run_profiled(step, tag, out)
    print(
        f"RESULT {tag}: {batch.num_tokens / t:.0f} tokens/s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
        file=out,
        flush=True,
    )
    print(
        f"RESULT {tag}: {batch.num_tokens / t:.0f} tokens/s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
        flush=True,
    )


if __name__ == "__main__":
    main()
