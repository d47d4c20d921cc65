"""Which MTP start, objective and learning rate make a pretrained policy's depth-1 head draft best.

On a real checkpoint without MTP weights (e.g. SmolLM2-135M-Instruct from its GGUF), this:

1. samples the policy's own responses to ASDiv training prompts with the rollout engine (plain
   decoding, the temperature of the RL run), ``--samples`` for training and ``--heldout`` more;
2. for every combination of ``--inits`` × ``--objectives`` × ``--mtp-lrs``, loads the model with
   that MTP start and objective and runs ``--steps`` heads-only warm-up steps (the train worker's
   ``mtp_warmup_steps``: the policy does not move) on batches of ``--batch`` samples;
3. prints, per combination, the held-out teacher-forced depth-1 acceptance (top-1 of q_1 equals
   the sampled token, DESIGN §3) at step 0 and every ``--eval-every`` steps, and the time taken.

The baseline a user gets without this work is the first row: random init, cross-entropy, the
policy's learning rate. Run from the repository root:

    python bench/bench_mtp_warmstart.py --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda

Results are recorded in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from splitrl.loss import GRPOLossConfig, make_loss  # noqa: E402
from splitrl.models import MTPConfig, PolicyModel  # noqa: E402
from splitrl.models.gguf import resolve_model_path  # noqa: E402
from splitrl.models.hf_files import rollout_stop_token_ids  # noqa: E402
from splitrl.models.mtp import warm_start_from_backbone  # noqa: E402
from splitrl.rollout import GenerationConfig, RolloutEngine  # noqa: E402
from splitrl.tasks import encode_prompt, make_task  # noqa: E402
from splitrl.tasks.tokenizer import TokenizerConfig  # noqa: E402
from splitrl.train import TrainBatch, TrainConfig, TrainWorker  # noqa: E402
from splitrl.train.config import MicrobatchConfig, OptimConfig  # noqa: E402
from splitrl.workers.generation import load_tokenizer  # noqa: E402


def own_samples(
    model_dir: str, n: int, temperature: float, max_new: int, device: str, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of the policy's own samples on the first n ASDiv training prompts."""
    tok = load_tokenizer(TokenizerConfig(kind="pretrained"), model_dir)
    task = make_task({"kind": "asdiv", "split": "train", "chat_template": True})
    prompts = [encode_prompt(task.get_prompt(i % task.num_prompts), tok, True) for i in range(n)]
    model = PolicyModel.from_pretrained(model_dir, mtp=MTPConfig(mtp_num_layers=0))
    if device == "cuda":
        model = model.to(torch.bfloat16)
    gen = GenerationConfig(temperature=temperature, max_new_tokens=max_new, batch_size=256)
    gen = gen.model_copy(update={"stop_token_ids": rollout_stop_token_ids(gen, tok, model_dir)})
    engine = RolloutEngine(model, gen, device=device)
    results = engine.generate(prompts, seeds=[seed * 1_000_003 + i for i in range(n)])
    return [(p, list(r.response_ids)) for p, r in zip(prompts, results)]


def as_batch(samples) -> TrainBatch:
    ids = [torch.tensor(p + r, dtype=torch.long) for p, r in samples]
    mask = [torch.cat([torch.zeros(len(p)), torch.ones(len(r))]) for p, r in samples]
    return TrainBatch(input_ids=ids, token_mask=mask, advantages=torch.zeros(len(samples)))


@torch.no_grad()
def heldout_acceptance(model: PolicyModel, samples, device: str, temperature: float) -> float:
    """Teacher-forced depth-1 acceptance (%) over the held-out samples, one sample a forward."""
    hits = count = 0.0
    model.eval()
    for p, r in samples:
        ids = torch.tensor([p + r], device=device)
        mask = torch.cat([torch.zeros(len(p)), torch.ones(len(r))])[None].to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model(ids, mtp_loss_mask=mask, temperature=temperature)
        hits += float(out.mtp_hit_sums[0])
        count += float(out.mtp_counts[0])
    model.train()
    return 100.0 * hits / max(count, 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file or a Hugging Face directory without MTP weights")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=128, help="samples per warm-up step")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--inits", default="random,last_layer,last_layer_embedding,last_layer_sum")
    ap.add_argument("--objectives", default="ce,distill")
    ap.add_argument("--mtp-lrs", default="3e-6,1e-4,1e-3")
    ap.add_argument(
        "--combos",
        default=None,
        help="only these init/objective/lr triples, e.g. random/ce/3e-6,last_layer/distill/1e-3",
    )
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(
        "command: python bench/bench_mtp_warmstart.py " + " ".join(sys.argv[1:] if argv is None else argv), flush=True
    )

    model_dir = resolve_model_path(args.model)
    t0 = time.perf_counter()
    samples = own_samples(
        model_dir, args.samples + args.heldout, args.temperature, args.max_new_tokens, args.device, args.seed
    )
    train, heldout = samples[: args.samples], samples[args.samples :]
    lengths = [len(r) for _, r in samples]
    print(f"{len(samples)} own samples at T={args.temperature} in {time.perf_counter() - t0:.1f}s; "
          f"response tokens mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}", flush=True)  # fmt: skip

    if args.combos:
        combos = [tuple(c.split("/")) for c in args.combos.split(",")]
    else:
        combos = list(itertools.product(args.inits.split(","), args.objectives.split(","), args.mtp_lrs.split(",")))
    base = PolicyModel.from_pretrained(model_dir, mtp=MTPConfig(mtp_num_layers=0))
    rows = []
    print(
        f"{'init':<22}{'objective':<10}{'mtp_lr':>8}  acceptance % at steps 0, {args.eval_every}, ...  (s)", flush=True
    )
    for init, objective, lr in combos:
        t = time.perf_counter()
        torch.manual_seed(args.seed)
        model = PolicyModel(
            copy.deepcopy(base.backbone), MTPConfig(mtp_num_layers=1, mtp_init=init, mtp_objective=objective)
        )
        warm_start_from_backbone(model.mtp, model.backbone, init)
        model = model.to(args.device)
        cfg = TrainConfig(
            precision="bf16" if args.device == "cuda" else "fp32",
            device=args.device,
            mtp_warmup_steps=10**9,
            microbatch=MicrobatchConfig(max_tokens_per_microbatch=16384, pack_sequences=True),
            optim=OptimConfig(lr=3e-6, mtp_lr=float(lr), max_grad_norm=1.0),
        )
        worker = TrainWorker(model, cfg)
        loss = make_loss(GRPOLossConfig(temperature=args.temperature))
        curve = [heldout_acceptance(worker.model, heldout, args.device, args.temperature)]
        g = torch.Generator().manual_seed(args.seed)
        for step in range(1, args.steps + 1):
            idx = torch.randint(0, len(train), (args.batch,), generator=g).tolist()
            worker.train(as_batch([train[i] for i in idx]), loss)
            if step % args.eval_every == 0 or step == args.steps:
                curve.append(heldout_acceptance(worker.model, heldout, args.device, args.temperature))
        secs = time.perf_counter() - t
        print(
            f"{init:<22}{objective:<10}{lr:>8}  " + " ".join(f"{a:5.1f}" for a in curve) + f"  ({secs:.0f})", flush=True
        )
        rows.append({"init": init, "objective": objective, "mtp_lr": float(lr), "acceptance": curve, "seconds": secs})
        del worker, model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    best = max(rows, key=lambda r: r["acceptance"][-1])
    print(f"best after {args.steps} steps: {best['init']} / {best['objective']} / mtp_lr {best['mtp_lr']:g}: "
          f"{best['acceptance'][-1]:.1f} % (baseline {rows[0]['init']}/{rows[0]['objective']}/{rows[0]['mtp_lr']:g}: "
          f"{rows[0]['acceptance'][-1]:.1f} %)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
