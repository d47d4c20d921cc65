"""Throughput of the split train step against the synchronous one, in one run.

Builds a Qwen3-shaped policy with MTP heads (random init), a step of ragged GRPO samples, and
times: the synchronous step (one chunk), the split step fed as K chunks, and a plain Hugging Face
forward/backward of the backbone alone (what a user already has: next-token CE, no MTP). Prints
tokens/s, the ratios, model FLOPs utilization and peak memory, and the command that reproduces
the figures.

    python bench/bench_train_step.py --device cuda --preset qwen3-0.6b --mtp 2
    python bench/bench_train_step.py --device cpu --preset tiny
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

from splitrl.loss import ClippedPGLoss, GRPOLossConfig
from splitrl.models import ModelConfig, MTPConfig, PolicyModel
from splitrl.train import MicrobatchConfig, OptimConfig, TrainBatch, TrainConfig, TrainWorker

PRESETS = {
    "tiny": dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=4096),
}
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


def time_it(fn, device: str, repeats: int) -> float:
    fn()  # warm-up: the first calls pay one-time kernel selection (seconds on CPU)
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--mtp", type=int, default=2, help="MTP depths")
    ap.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=1792)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16384, help="token budget per microbatch")
    ap.add_argument("--no-pack", action="store_true", help="padded rows (one sample each) instead of packed rows")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    print("command:", "python bench/bench_train_step.py " + shlex.join(sys.argv[1:] if argv is None else argv))

    backbone = PRESETS[args.preset]
    model = PolicyModel.from_config(ModelConfig(backbone=backbone, mtp=MTPConfig(mtp_num_layers=args.mtp)))
    n_params = sum(p.numel() for p in model.parameters())
    n_backbone = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    cfg = TrainConfig(
        precision=precision,
        device=args.device,
        microbatch=MicrobatchConfig(max_tokens_per_microbatch=args.max_tokens, pack_sequences=not args.no_pack),
        optim=OptimConfig(lr=1e-6),
    )
    worker = TrainWorker(model, cfg)
    loss = ClippedPGLoss(GRPOLossConfig())
    batch = make_batch(args.samples, args.prompt, args.response, backbone["vocab_size"])
    tokens = batch.num_tokens
    per = max(1, args.samples // args.chunks)
    chunks = [batch.select(list(range(i, min(i + per, args.samples)))) for i in range(0, args.samples, per)]

    def split_step():
        worker.begin_train_step(loss)
        for c in chunks:
            worker.train_microbatch(c)
        worker.finish_train_step()

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_sync = time_it(lambda: worker.train(batch, loss), args.device, args.repeats)
    t_split = time_it(split_step, args.device, args.repeats)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")

    # what a user already has: the plain HF backbone, next-token CE, fused AdamW, same tokens
    from transformers import AutoModelForCausalLM, Qwen3Config

    worker = model = None  # free the policy before the HF baseline runs
    if args.device == "cuda":
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_config(Qwen3Config(**backbone), dtype=torch.float32).to(args.device)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=args.device == "cuda")
    L = args.prompt + args.response
    rows = max(1, tokens // L)
    x = torch.randint(0, backbone["vocab_size"], (rows, L), device=args.device)

    def hf_step():
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = hf(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_hf = time_it(hf_step, args.device, args.repeats)
    hf_tokens = rows * L

    def report(name, t, tok, params):
        tps = tok / t
        line = f"{name:<28} {t * 1e3:9.1f} ms/step  {tps:11.0f} tokens/s"
        peak_tf = PEAK_TFLOPS.get(args.device)
        if peak_tf:
            line += f"  MFU {100 * 6 * params * tps / (peak_tf * 1e12):5.1f}%"
        print(line)
        return tps

    print(f"model: {args.preset} + {args.mtp} MTP depths, {n_params / 1e6:.1f} M parameters "
          f"({n_backbone / 1e6:.1f} M backbone); {precision} on {args.device}; step = {args.samples} samples, "
          f"{tokens} tokens; split = {len(chunks)} chunks; microbatch budget {args.max_tokens} tokens, "
          f"{'padded' if args.no_pack else 'packed'}")
    s = report("splitrl sync step", t_sync, tokens, n_params)
    p = report(f"splitrl split step ({len(chunks)} chunks)", t_split, tokens, n_params)
    h = report("plain HF backbone (no MTP)", t_hf, hf_tokens, n_backbone)
    print(f"split / sync throughput: {p / s:.3f}   splitrl sync / plain HF: {s / h:.3f}")
    print(f"peak memory (splitrl steps): {peak:.1f} GiB")


if __name__ == "__main__":
    main()
