"""Generation of a real checkpoint on real prompts: splitrl's engine, plain and speculative, against
transformers' ``generate`` on the same prompts, in one run.

The model is a checkpoint directory, a ``policy/`` export or a ``.gguf`` file; the prompts are
ASDiv training problems in the model's chat template (what ``examples/smollm2_asdiv.yaml``
trains on). For each batch size it prints tokens/s of

- ``hf``: ``model.generate`` (dynamic cache, greedy or sampled at T), the baseline a user has;
- ``plain``: the rollout engine without speculation;
- ``speculative``: the engine drafting with the checkpoint's MTP heads (the switch-off rule off,
  so what is timed is speculation itself), with its acceptance rate;
- ``spec-dv`` (with ``--draft-vocab-size N``): the same, drafting from N tokens only
  (``GenerationConfig.draft_vocab_size``). The set is fitted first on the responses to
  ``--draft-vocab-fit`` other training problems (the ones after the timed prompts) and then held
  fixed, so that the timed calls draft from a set that has not seen their own tokens; the share of
  their tokens inside it (``cover %``) is printed with the acceptance;

and the ratios to ``hf`` and ``plain``. Tokens counted are the generated ones (stop tokens
included). Each setting gets one untimed warm-up call, then the settings are timed in turns,
``--repeats`` rounds (the order reversed every other round, so that a change of the machine's
load hits every setting alike), and each keeps its best round; the per-round times are printed
too. The torch thread count and the load average are printed with the figures: on a shared CPU
they move them more than anything else (bench/RESULTS.md, CPU generation). Run from the
repository root, e.g.

    python bench/bench_generate.py --model runs/smollm2_asdiv --device cuda --batch-sizes 1,32,128
    python bench/bench_generate.py --model SmolLM2-135M-Instruct.Q4_1.gguf --device cpu --batch-sizes 1,8 --new-tokens 64

Results are recorded in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py

import torch  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> tuple[float, object]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def _interleaved(fns: dict[str, object], repeats: int, device: str) -> dict[str, tuple[list[float], object]]:
    """Each of ``fns`` once untimed (warm-up: compilation, graph capture, allocator), then
    ``repeats`` rounds of one timed call each, the order reversed every other round. Returns
    name -> (seconds of each round, output of the last call)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    outs: dict[str, object] = {}
    names = list(fns)
    for r in range(repeats):
        for k in names if r % 2 == 0 else names[::-1]:
            t, outs[k] = _timed(fns[k], device)
            times[k].append(t)
    return {k: (times[k], outs[k]) for k in fns}


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    from shapes import check_switches

    check_switches()  # a bad SPLITRL_* value: one line and exit 2, not a traceback from the imports below
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="run dir, checkpoint, policy/ dir, HF directory or .gguf file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-sizes", default="1,32,128")
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (best kept)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--no-speculative", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    ap.add_argument("--draft-vocab-size", type=int, default=0, help="also time drafts from this many tokens (0: not)")
    ap.add_argument("--draft-vocab-fit", type=int, default=256, help="problems whose responses choose those tokens")
    args = ap.parse_args(argv)
    print("command: python bench/bench_generate.py " + " ".join(sys.argv[1:] if argv is None else argv), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)

    from splitrl.cli_eval import resolve_policy_dir
    from splitrl.models import PolicyModel
    from splitrl.models.hf_files import rollout_stop_token_ids
    from splitrl.rollout import GenerationConfig, RolloutEngine
    from splitrl.tasks import encode_prompt, make_task
    from splitrl.tasks.tokenizer import TokenizerConfig
    from splitrl.workers.generation import load_tokenizer

    policy_dir, _ = resolve_policy_dir(args.model)
    tok = load_tokenizer(TokenizerConfig(kind="pretrained"), str(policy_dir))
    task = make_task({"kind": "asdiv", "split": "train", "chat_template": True})
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = PolicyModel.from_pretrained(str(policy_dir)).to(dtype)
    greedy = args.temperature == 0
    gen = GenerationConfig(
        temperature=1.0 if greedy else args.temperature, top_k=1 if greedy else 0,
        max_new_tokens=args.new_tokens, batch_size=max(int(b) for b in args.batch_sizes.split(",")),
    )  # fmt: skip
    gen = gen.model_copy(update={"stop_token_ids": rollout_stop_token_ids(gen, tok, policy_dir)})
    spec_ok = model.num_mtp_depths > 0 and not args.no_speculative
    plain = RolloutEngine(model, gen, device=args.device)
    spec = spec_dv = None
    if spec_ok:
        spec = RolloutEngine(model, gen.model_copy(update={"speculative": True}), device=args.device)
        spec.speculative_switch_off = False
    if spec_ok and args.draft_vocab_size:
        update = {"speculative": True, "draft_vocab_size": args.draft_vocab_size}
        spec_dv = RolloutEngine(model, gen.model_copy(update=update), device=args.device)
        spec_dv.speculative_switch_off = False
        first = max(int(b) for b in args.batch_sizes.split(","))  # after every timed prompt
        fit = [encode_prompt(task.get_prompt(first + i), tok, True) for i in range(args.draft_vocab_fit)]
        t = time.perf_counter()
        for i in range(0, len(fit), gen.batch_size):
            spec_dv.generate(fit[i : i + gen.batch_size], list(range(i, i + len(fit[i : i + gen.batch_size]))))
        vocab = spec_dv.runner.draft_vocab
        seen = int(((vocab.counts + vocab.prompt_counts) > 0).sum())
        vocab.count = lambda token_ids, prompt=False: None  # held fixed from here: the timed calls never shape it
        print(f"draft vocabulary: {args.draft_vocab_size} of {vocab.vocab_size} tokens, the most frequent of "
              f"{args.draft_vocab_fit} other problems' prompts and responses ({seen} distinct tokens; "
              f"{time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=dtype).to(args.device).eval()
    print(f"model {policy_dir} ({sum(p.numel() for p in model.backbone.parameters()) / 1e6:.1f} M parameters, "
          f"{model.num_mtp_depths} MTP depth(s)), {args.device} {dtype}, T={args.temperature}, "
          f"≤ {args.new_tokens} new tokens, {torch.get_num_threads()} torch thread(s) of {os.cpu_count()} CPUs, "
          f"{_load()}", flush=True)  # fmt: skip
    head = f"{'batch':>5} {'hf tok/s':>9} {'plain':>9} {'spec':>9} {'accept %':>8} {'plain/hf':>8} {'spec/plain':>10}"
    if spec_dv is not None:
        head += f" {'spec-dv':>9} {'accept %':>8} {'cover %':>7} {'dv/plain':>8}"
    print(head)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prompts = [encode_prompt(task.get_prompt(i), tok, True) for i in range(b)]
        seeds = list(range(b))
        row: dict[str, float] = {}
        fns = {"plain": lambda: plain.generate(prompts, seeds)}
        if spec is not None:
            fns["spec"] = lambda: spec.generate(prompts, seeds)
        if spec_dv is not None:
            fns["spec-dv"] = lambda: spec_dv.generate(prompts, seeds)
        if hf is not None:
            tok.padding_side = "left"
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            enc = tok.pad({"input_ids": prompts}, return_tensors="pt").to(args.device)
            kw = dict(max_new_tokens=args.new_tokens, eos_token_id=gen.stop_token_ids, pad_token_id=tok.pad_token_id)
            kw.update(do_sample=False) if greedy else kw.update(do_sample=True, temperature=args.temperature, top_k=0)

            def run_hf():
                with torch.no_grad():
                    return hf.generate(**enc, **kw)

            fns["hf"] = run_hf
        timed = _interleaved(fns, args.repeats, args.device)
        rounds = {}
        for k, (ts, out) in timed.items():
            if k == "hf":
                new = out[:, enc["input_ids"].shape[1] :]
                stop = torch.tensor(gen.stop_token_ids, device=new.device)
                # tokens up to and including the first stop token (HF pads after it)
                ended = torch.isin(new, stop).int().cumsum(1)
                n = float(((ended == 0) | ((ended == 1) & torch.isin(new, stop))).sum())
            else:
                n = sum(len(r.response_ids) for r in out)
            row[k] = n / min(ts)
            rounds[k] = ", ".join(f"{n / t:.1f}" for t in ts)
        if spec is not None:
            row["accept"] = spec.last_stats.acceptance_rate
        dv = ""
        if spec_dv is not None:
            st = spec_dv.last_stats
            dv = (f" {row['spec-dv']:9.1f} {st.acceptance_rate:8.1f} {st.draft_vocab_coverage:7.1f} "
                  f"{row['spec-dv'] / row['plain']:7.2f}x")  # fmt: skip
        fmt = lambda k: f"{row[k]:9.1f}" if k in row else f"{'-':>9}"  # noqa: E731
        ratio = lambda a, c: f"{row[a] / row[c]:.2f}x" if a in row and c in row else "-"  # noqa: E731
        acc = f"{row['accept']:8.1f}" if "accept" in row else f"{'-':>8}"
        print(
            f"{b:5d} {fmt('hf')} {fmt('plain')} {fmt('spec')} {acc} {ratio('plain', 'hf'):>8} {ratio('spec', 'plain'):>10}"
            + dv,
            flush=True,
        )
        each = "; ".join(f"{k} {v}" for k, v in rounds.items())
        print(f"      tok/s of each round: {each}; {_load()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
