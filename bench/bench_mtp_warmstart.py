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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py

import torch  # noqa: E402

from shapes import check_switches  # noqa: E402

check_switches()  # a bad SPLITRL_* value: one line and exit 2, before the rollout's imports read it

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
def heldout_acceptance(model: PolicyModel, samples, device: str, temperature: float, draws: int = 4) -> dict:
    """Depth-1 figures (%) over the held-out samples' response targets, one sample a forward.

    ``hit``: teacher-forced acceptance as the train step counts it (top-1 of q_1 equals the sampled
    token x_{t+2}, DESIGN §3). ``ceiling``: the same count for the main head one position later
    (top-1 of p at t+1 equals x_{t+2}): what a drafter equal to the policy would score.
    ``coupled_T`` / ``coupled_1``: the engine's rule, simulated: with shared Gumbel noise (``draws``
    draws a position) the draft argmax(z_q / Td + g) equals the target's argmax(z_p / T + g), the
    draft at Td = T (as the drafter samples today) or at Td = 1. ``sum_min``: Σ_v min(p_T, q_T),
    the acceptance of the rejection rule.
    """
    from splitrl.models.policy import _shift_left

    tot = {"hit": 0.0, "ceiling": 0.0, "coupled_T": 0.0, "coupled_1": 0.0, "sum_min": 0.0}
    count = 0
    model.eval()
    gen = torch.Generator(device=device).manual_seed(1234)
    W = model.output_weight
    for p, r in samples:
        if len(r) < 2:
            continue
        ids = torch.tensor([p + r], device=device)
        S = ids.shape[1]
        seg = torch.zeros_like(ids)
        pos = torch.arange(S, device=device)[None]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            emb, h0, mask, _ = model._backbone_hidden(ids, seg, pos, True)
            h1 = model.mtp.depth_forward(1, _shift_left(emb, 1), h0, attention_mask=mask,
                                         position_embeddings=model.rotary_emb(h0, pos), position_ids=pos)  # fmt: skip
        t = torch.arange(len(p) - 2, S - 2, device=device)  # x_{t+2} is a response token
        target = ids[0, t + 2]
        zq = (h1[0, t] @ W.T).float()
        zp = (h0[0, t + 1] @ W.T).float()
        tot["hit"] += float((zq.argmax(-1) == target).sum())
        tot["ceiling"] += float((zp.argmax(-1) == target).sum())
        tot["sum_min"] += float(torch.minimum((zp / temperature).softmax(-1), (zq / temperature).softmax(-1)).sum())
        for _ in range(draws):
            g = -torch.log(-torch.log(torch.rand(zp.shape, device=device, generator=gen).clamp_min(1e-20)))
            y = (zp / temperature + g).argmax(-1)
            tot["coupled_T"] += float(((zq / temperature + g).argmax(-1) == y).sum()) / draws
            tot["coupled_1"] += float(((zq + g).argmax(-1) == y).sum()) / draws
        count += len(t)
    model.train()
    return {k: 100.0 * v / max(count, 1) for k, v in tot.items()}


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
        help="only these init/objective/lr[/batch[/beta2]] entries, e.g. random/ce/1e-3,random/ce/1e-3/32/0.95; "
        "a smaller batch runs more steps over the same samples (steps × batch is kept)",
    )
    ap.add_argument("--lr-warmup", type=int, default=0, help="linear LR warm-up steps (OptimConfig.warmup_steps)")
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
        combos = [c.split("/") for c in args.combos.split(",")]
    else:
        combos = [list(c) for c in itertools.product(args.inits.split(","), args.objectives.split(","),
                                                     args.mtp_lrs.split(","))]  # fmt: skip
    base = PolicyModel.from_pretrained(model_dir, mtp=MTPConfig(mtp_num_layers=0))
    rows = []
    print(f"per row: held-out hit % (the train step's acceptance) at steps 0, {args.eval_every}, ...; at the end also "
          "the ceiling (main head at t+1), the engine's coupled rule with drafts at T and at 1, and sum-min", flush=True)  # fmt: skip
    for combo in combos:
        init, objective, lr = combo[:3]
        batch = int(combo[3]) if len(combo) > 3 else args.batch
        beta2 = float(combo[4]) if len(combo) > 4 else 0.999
        steps = args.steps * args.batch // batch  # the same number of samples seen, whatever the batch
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
            optim=OptimConfig(
                lr=3e-6, mtp_lr=float(lr), max_grad_norm=1.0, betas=(0.9, beta2), warmup_steps=args.lr_warmup
            ),
        )
        worker = TrainWorker(model, cfg)
        loss = make_loss(GRPOLossConfig(temperature=args.temperature))
        curve = [heldout_acceptance(worker.model, heldout, args.device, args.temperature)]
        g = torch.Generator().manual_seed(args.seed)
        order: list[int] = []
        eval_every = max(1, args.eval_every * args.batch // batch)
        for step in range(1, steps + 1):
            while len(order) < batch:  # fresh samples first: epochs of a permutation
                order += torch.randperm(len(train), generator=g).tolist()
            idx, order = order[:batch], order[batch:]
            worker.train(as_batch([train[i] for i in idx]), loss)
            if step % eval_every == 0 or step == steps:
                curve.append(heldout_acceptance(worker.model, heldout, args.device, args.temperature))
        secs = time.perf_counter() - t
        end = curve[-1]
        name = f"{init}/{objective}/{lr}/b{batch}/beta2={beta2:g}"
        print(f"{name:<44} " + " ".join(f"{c['hit']:5.1f}" for c in curve)
              + f" | ceiling {end['ceiling']:.1f} coupled@T {end['coupled_T']:.1f} coupled@1 {end['coupled_1']:.1f} "
              f"sum-min {end['sum_min']:.1f} ({steps} steps, {secs:.0f} s)", flush=True)  # fmt: skip
        rows.append({"init": init, "objective": objective, "mtp_lr": float(lr), "batch": batch, "beta2": beta2,
                     "steps": steps, "curve": curve, "acceptance": [c["hit"] for c in curve], "seconds": secs})  # fmt: skip
        del worker, model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    best = max(rows, key=lambda r: r["acceptance"][-1])
    print(f"best after {args.steps * args.batch} samples: {best['init']} / {best['objective']} / mtp_lr "
          f"{best['mtp_lr']:g} / batch {best['batch']}: {best['acceptance'][-1]:.1f} % (baseline {rows[0]['init']}/"
          f"{rows[0]['objective']}/{rows[0]['mtp_lr']:g}: {rows[0]['acceptance'][-1]:.1f} %)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
