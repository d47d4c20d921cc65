"""Generation right after a train step in the same process (one GPU shared, as a colocated run).

A colocated run trains and generates on one device. This times the rollout engine's
``generate`` (plain and speculative, CUDA graphs captured) three ways, in one process:

1. warm: after its own warm-up calls, before any train step;
2. after a small train step (``--small-samples`` samples);
3. after a large one (``--big-samples`` samples of ``--train-len`` tokens: the issue's 48 k-token
   step of the Qwen3-1.7B shape);

and then the large step again followed by ``torch.cuda.empty_cache()`` (``--empty-cache`` runs only
that way), printing each call's seconds, its ratio to the warm call, the graphs torch.compile made
during the calls (a slow call that compiled was recompiling, not waiting on memory) and the CUDA
allocator's reserved / allocated memory at each point. ``--no-train-compile`` trains with eager
layers (the train step's own compilation is then not paid: a shorter run; the engine's is). The baseline a user compares with is the warm call.
Run from the repository root, on a GPU:

    python bench/bench_colocated.py --preset qwen3-1.7b

Results are recorded in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_train_step import PRESETS  # noqa: E402 - the model shapes of the train-step bench
from shapes import check_switches  # noqa: E402

check_switches()  # a bad SPLITRL_* value: one line and exit 2, before the rollout's imports read it

from splitrl.loss import ClippedPGLoss, GRPOLossConfig  # noqa: E402
from splitrl.models import ModelConfig, MTPConfig, PolicyModel  # noqa: E402
from splitrl.rollout import GenerationConfig, RolloutEngine  # noqa: E402
from splitrl.rollout.spec_policy import _compilations  # noqa: E402 - Dynamo's count of graphs made
from splitrl.train import TrainBatch, TrainConfig, TrainWorker  # noqa: E402
from splitrl.train.config import MicrobatchConfig, SpeedConfig  # noqa: E402


def batch_of(n: int, length: int, prompt: int, vocab: int, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]
    mask = [torch.cat([torch.zeros(prompt), torch.ones(length - prompt)]) for _ in range(n)]
    gen = [torch.cat([torch.zeros(prompt), -torch.rand(length - prompt, generator=g)]) for _ in range(n)]
    adv = torch.randn(n, generator=g)
    return TrainBatch(input_ids=ids, token_mask=mask, advantages=adv, generation_logprobs=gen)


def gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-1.7b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mtp", type=int, default=1)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--big-samples", type=int, default=32)
    ap.add_argument("--small-samples", type=int, default=2)
    ap.add_argument("--train-len", type=int, default=1516, help="tokens a training sample (32 x 1516 = 48.5 k)")
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=16384)
    ap.add_argument("--empty-cache", action="store_true", help="only the large step followed by empty_cache()")
    ap.add_argument("--no-train-compile", action="store_true", help="train with eager layers (train.speed.compile_layers=false)")
    args = ap.parse_args(argv)
    print("command: python bench/bench_colocated.py " + " ".join(sys.argv[1:] if argv is None else argv), flush=True)
    dev = args.device
    cuda = dev == "cuda"
    torch.manual_seed(0)
    backbone = dict(PRESETS[args.preset], rms_norm_eps=1e-6,
                    max_position_embeddings=max(4096, args.prompt_len + args.new_tokens, args.train_len))  # fmt: skip
    model = PolicyModel.from_config(ModelConfig(backbone=backbone, mtp=MTPConfig(mtp_num_layers=args.mtp)))
    gen_model = copy.deepcopy(model).to(device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
    worker = TrainWorker(
        model,
        TrainConfig(
            precision="bf16" if cuda else "fp32",
            device=dev,
            microbatch=MicrobatchConfig(max_tokens_per_microbatch=args.max_tokens_per_microbatch, pack_sequences=True),
            speed=SpeedConfig(compile_layers=not args.no_train_compile),
        ),
    )
    loss = ClippedPGLoss(GRPOLossConfig(temperature=1.0))
    vocab = PRESETS[args.preset]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.gen_batch)]
    seeds = list(range(args.gen_batch))
    gen = GenerationConfig(temperature=1.0, max_new_tokens=args.new_tokens, batch_size=args.gen_batch)
    engines = {"plain": RolloutEngine(gen_model, gen, device=dev)}
    if args.mtp:
        engines["speculative"] = RolloutEngine(gen_model, gen.model_copy(update={"speculative": True}), device=dev)
        engines["speculative"].speculative_switch_off = False

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def mem() -> str:
        if not cuda:
            return ""
        return f"reserved {gib(torch.cuda.memory_reserved())} GiB, allocated {gib(torch.cuda.memory_allocated())} GiB"

    def time_generate(label: str, base: dict[str, float] | None) -> dict[str, float]:
        out = {}
        graphs = _compilations()
        for name, engine in engines.items():
            sync()
            t = time.perf_counter()
            engine.generate(prompts, seeds)
            sync()
            out[name] = time.perf_counter() - t
        ratios = "" if base is None else "  (" + ", ".join(f"{k} {out[k] / base[k]:.2f}x warm" for k in out) + ")"
        compiled = f", {_compilations() - graphs} graph(s) compiled" if _compilations() != graphs else ""
        print(f"{label:<44} " + "  ".join(f"{k} {v:.2f} s" for k, v in out.items()) + ratios + f"   [{mem()}{compiled}]",
              flush=True)  # fmt: skip
        return out

    def train_step(n: int, empty_cache: bool) -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        worker.train(batch_of(n, args.train_len, min(64, args.train_len // 4), vocab, seed=n), loss)
        sync()
        peak = gib(torch.cuda.max_memory_allocated()) if cuda else "-"
        with torch.no_grad():  # the weight sync of a colocated run: in place, graphs stay valid
            for dst, src in zip(gen_model.parameters(), model.parameters()):
                dst.copy_(src)
        if empty_cache and cuda:
            torch.cuda.empty_cache()
        print(f"train step: {n} sample{'s' * (n != 1)} x {args.train_len} tokens in {time.perf_counter() - t:.2f} s, "
              f"peak {peak} GiB" + (", then empty_cache()" if empty_cache else ""), flush=True)  # fmt: skip

    for _ in range(2):  # compile, capture graphs
        for engine in engines.values():
            engine.generate(prompts, seeds)
    warm = time_generate("warm (before any train step)", None)
    if not args.empty_cache:
        train_step(args.small_samples, False)
        time_generate("after a small train step", warm)
        train_step(args.big_samples, False)
        time_generate("after a large train step", warm)
        time_generate("  and the call after that", warm)
    train_step(args.big_samples, True)
    time_generate("after a large train step + empty_cache()", warm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
