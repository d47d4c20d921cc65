"""Rollout throughput of the splitrl engine: plain decoding, and speculative vs plain with MTP heads.

Random-init models (no hub access), fixed-length responses (no stop tokens), so every row decodes
``--new-tokens`` tokens. tokens/s = generated tokens / wall time of the whole ``generate`` call
(prefill included). With random weights the MTP drafts are only as good as chance makes them:
read the speculative numbers together with the acceptance they were measured at.

    python bench/bench_rollout.py                                   # tiny model, CPU
    python bench/bench_rollout.py --device cuda --preset qwen3-0.6b --batch-sizes 1,32,256 --speculative
    python bench/bench_rollout.py --device cuda --preset qwen3-0.6b --check   # fp32 exactness on the device

Measured 2026-11-29 on one H200 (torch 2.11, transformers 5.17, bf16, SDPA, random init, prompt
128 + 128 new tokens, T = 1; `--device cuda --preset qwen3-0.6b --check --batch-sizes 1,32,256
--prompt-len 128 --new-tokens 128 --speculative`): fp32 check max |Δ logprob| 2.9e-6, greedy
speculative = plain 6/6 rows; plain 29.8 / 1231 / 8259 tokens/s at batch 1 / 32 / 256
(FINDINGS.md: HF `generate` 16.7 / 462 / 3945); speculative with D = 2 random heads (acceptance
~54 %) 48.8 / 1340 / 4846 tokens/s, i.e. 1.64x / 1.09x / 0.59x. Decoding is bound by the CPU's
kernel launches (HF eager layers, ~30 ms a step at batch 1), which is why drafting pays at small
batches; at batch 256 the engine's own estimate (0.80x) switches speculation off.
"""

from __future__ import annotations

import argparse
import logging
import random
import shlex
import sys
import time

import torch

from splitrl.models import ModelConfig, MTPConfig, PolicyModel
from splitrl.rollout import GenerationConfig, RolloutEngine

PRESETS = {
    "tiny": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "small": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
    # the shape of Qwen3-0.6B (596 M parameters), as in FINDINGS.md's H200 baseline
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
    ),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument(
        "--mtp-depths", type=int, default=2, help="MTP depths of the model (drafted tokens when speculative)"
    )
    p.add_argument("--init-range", type=float, default=0.02, help="init std; larger gives peakier distributions")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--speculative", action="store_true", help="also measure speculative decoding")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per setting (best is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    p.add_argument("--check", action="store_true", help="first check fp32 exactness on the device")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace, dtype: torch.dtype) -> PolicyModel:
    backbone = dict(
        PRESETS[args.preset],
        max_position_embeddings=max(4096, args.prompt_len + args.new_tokens),
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        initializer_range=args.init_range,
    )
    cfg = ModelConfig(backbone=backbone, mtp=MTPConfig(mtp_num_layers=args.mtp_depths))
    return PolicyModel.from_config(cfg).to(device=args.device, dtype=dtype)


def measure(model: PolicyModel, cfg: GenerationConfig, batch: int, args: argparse.Namespace):
    """Best of ``repeats`` timed calls after one warm-up call (each on a fresh engine, so a
    speculative run is never switched off by the warm-up's own measurement)."""
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
    seeds = list(range(batch))
    RolloutEngine(model, cfg, args.device).generate(prompts, seeds)
    best = None
    for _ in range(args.repeats):
        engine = RolloutEngine(model, cfg, args.device)
        engine.generate(prompts, seeds)
        stats = engine.last_stats
        if best is None or stats.tokens_per_s > best.tokens_per_s:
            best = stats
    return best


@torch.no_grad()
def check_exactness(args: argparse.Namespace) -> None:
    """fp32 on the device: logprobs equal PolicyModel.forward's teacher-forced ones, and greedy
    speculative decoding emits the plain greedy tokens."""
    model = build_model(args, torch.float32)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 24))] for _ in range(6)]
    seeds = list(range(6))
    common = dict(max_new_tokens=24, batch_size=4)
    results = RolloutEngine(model, GenerationConfig(temperature=0.8, **common), args.device).generate(prompts, seeds)
    worst = 0.0
    for prompt, res in zip(prompts, results):
        ids = torch.tensor([prompt + res.response_ids], device=args.device)
        ref = model(ids, mtp_loss_mask=torch.zeros(ids.shape, device=args.device), temperature=0.8).logprobs[
            0, len(prompt) :
        ]
        worst = max(worst, float((ref.cpu() - torch.tensor(res.logprobs)).abs().max()))
    greedy = GenerationConfig(top_k=1, **common)
    plain = RolloutEngine(model, greedy, args.device).generate(prompts, seeds)
    spec = RolloutEngine(model, greedy.model_copy(update={"speculative": True}), args.device).generate(prompts, seeds)
    same = sum(p.response_ids == s.response_ids for p, s in zip(plain, spec))
    print(f"check (fp32): max |logprob - teacher-forced| = {worst:.2e}; ", end="")
    print(f"greedy speculative == plain for {same}/{len(plain)} rows")
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("splitrl.rollout.engine").setLevel(logging.ERROR)  # the table reports the speedups
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    )
    print(f"command: python bench/bench_rollout.py {shlex.join(argv)}")
    if args.check:
        check_exactness(args)
    model = build_model(args, dtype)
    n_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    device_name = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"
    )
    print(
        f"device {device_name}, {dtype}, preset {args.preset} ({n_params / 1e6:.1f} M backbone params, "
        f"D={args.mtp_depths}), prompt {args.prompt_len} + {args.new_tokens} new tokens, "
        f"T={args.temperature}, top_k={args.top_k}, torch {torch.__version__}"
    )
    header = f"{'batch':>6} {'plain tok/s':>12}"
    if args.speculative:
        header += f" {'spec tok/s':>11} {'speedup':>8} {'accept %':>9} {'per depth %':>16} {'engine est.':>12}"
    print(header)
    common = dict(temperature=args.temperature, top_k=args.top_k, max_new_tokens=args.new_tokens, stop_token_ids=[])
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        t0 = time.perf_counter()
        plain = measure(model, GenerationConfig(batch_size=batch, **common), batch, args)
        line = f"{batch:>6} {plain.tokens_per_s:>12.1f}"
        if args.speculative:
            spec = measure(model, GenerationConfig(batch_size=batch, speculative=True, **common), batch, args)
            per_depth = "/".join(f"{r:.0f}" for r in spec.acceptance_rate_per_depth)
            est = f"{spec.speculative_speedup:.2f}x" if spec.speculative_speedup is not None else "n/a"
            line += (
                f" {spec.tokens_per_s:>11.1f} {spec.tokens_per_s / plain.tokens_per_s:>7.2f}x"
                f" {spec.acceptance_rate:>9.1f} {per_depth:>16} {est:>12}"
            )
        print(line + f"   ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
