"""A/B of the rollout engine's switches in one process: plain decoding tokens/s of each variant at
each batch size, in interleaved rounds, against the first variant (the baseline a user has today).

A variant is a name and switches: ``engine.<attr>`` (an on/off attribute of the engine:
``look_ahead``, ``use_cuda_graphs``, ``prefill_buckets``) or ``<module>.<NAME>`` of
``splitrl.rollout.{pdl, forward, skinny_gemm, decode_attention, rope_write}`` (an on/off module
flag the kernels read at launch, e.g. ``pdl.EARLY``), each ``=0`` or ``=1``, or one of the
thresholds ``skinny_gemm.PREFERRED_ROWS``, ``skinny_gemm.GATED_ROWS``, ``skinny_gemm.GATED_WIDE_ROWS``, ``pdl.EARLY_ROWS``,
``rope_write.GROUP_FROM_TOKENS``, ``rope_write.MAX_HEADS_PER_PROGRAM``,
``decode_attention.HEADS_FIRST_PROGRAMS`` ``=<int>`` (e.g.
``skinny_gemm.GATED_ROWS=256``); ``name:``
alone runs the defaults. Module flags are global to the process: a switch that a variant does not name takes its
default (its value when the bench started) for that variant. Each variant gets an engine of its own, built and warmed up (CUDA graphs captured) with
its switches set, so that the graphs hold its kernels; the rounds then alternate the order of the
variants (the first round in the given order, the next reversed) and each variant's best call is
reported. Prompts, model and lengths are those of ``bench_rollout.py`` (random-init weights,
fixed-length rows: 128 + 128 tokens by default). ``same tokens``: the samples identical to the
baseline's (a change of kernel shape changes bf16 rounding, which at T = 1 changes some samples).

    python bench/bench_switches.py --device cuda --batch-sizes 1,8,32,256 --rounds 3 \\
        --variant "before:engine.look_ahead=0,pdl.EARLY=0,forward.FAST_PREFILL=0" \\
        --variant "now:engine.look_ahead=1,pdl.EARLY=1,forward.FAST_PREFILL=1"
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_rollout as br  # noqa: E402
from splitrl.rollout import (  # noqa: E402
    GenerationConfig,
    RolloutEngine,
    decode_attention,
    forward,
    pdl,
    rope_write,
    skinny_gemm,
)

MODULES = {
    "pdl": pdl,
    "forward": forward,
    "skinny_gemm": skinny_gemm,
    "decode_attention": decode_attention,
    "rope_write": rope_write,
}
# integer thresholds a variant may set (rows or tokens from or up to which a kernel is taken)
INT_SWITCHES = (
    ("skinny_gemm", "PREFERRED_ROWS"),
    ("skinny_gemm", "GATED_ROWS"),
    ("skinny_gemm", "GATED_WIDE_ROWS"),
    ("pdl", "EARLY_ROWS"),
    ("rope_write", "GROUP_FROM_TOKENS"),
    ("rope_write", "MAX_HEADS_PER_PROGRAM"),
    ("decode_attention", "HEADS_FIRST_PROGRAMS"),
)
# the engine's on/off attributes a variant may set (plain decoding)
ENGINE_SWITCHES = ("look_ahead", "use_cuda_graphs", "prefill_buckets")


# what the machine can do, not a choice: setting these to 1 where the hardware or Triton lacks it breaks
CAPABILITIES = ("AVAILABLE", "SUPPORTED")


def _is_flag(owner: str, attr: str) -> bool:
    """A module's on/off switch: a bool attribute of a module of :data:`MODULES`, not a capability."""
    return attr not in CAPABILITIES and isinstance(getattr(MODULES.get(owner), attr, None), bool)


def _switch_names() -> str:
    flags = [f"{m}.{a}" for m, mod in MODULES.items() for a in sorted(vars(mod)) if _is_flag(m, a)]
    ints = [f"{m}.{a}=<int>" for m, a in INT_SWITCHES]
    return ", ".join([f"engine.{a}" for a in ENGINE_SWITCHES] + flags + ints)


def parse_variant(text: str) -> tuple[str, dict[tuple[str, str], bool | int]]:
    """"name:owner.attr=value,..." as (name, {(owner, attr): value}); raises ValueError saying what
    is wrong. A switch is one of :data:`ENGINE_SWITCHES` or a bool flag of a module of
    :data:`MODULES` (value 0 or 1), or a threshold of :data:`INT_SWITCHES` (an integer ≥ 0)."""
    name, sep, body = text.partition(":")
    if not sep or not name.strip() or any(c in name for c in ",="):
        raise ValueError(
            f"a variant is 'name:owner.attr=value,...' (no switches: 'name:'; no ',' or '=' in the name); got {text!r}"
        )
    sets: dict[tuple[str, str], bool | int] = {}
    items = [x.strip() for x in body.split(",")] if body.strip() else []
    if "" in items:
        raise ValueError(f"variant {name!r} has an empty switch (a stray ','); got {text!r}")
    for item in items:
        key, eq, value = (part.strip() for part in item.partition("="))
        owner, dot, attr = key.partition(".")
        if (owner, attr) in INT_SWITCHES:
            if not hasattr(MODULES[owner], attr):  # a splitrl older than this script is installed
                raise ValueError(
                    f"switch {key} of variant {name!r}: the installed splitrl ({MODULES[owner].__file__}) has no {attr}; "
                    "install this checkout's (pip install -e .) or leave the switch out"
                )
            if not (eq and value.isascii() and value.isdigit()):
                raise ValueError(f"switch {item!r} of variant {name!r}: write {key}=<an integer >= 0>")
            parsed: bool | int = int(value)
        else:
            known = attr in ENGINE_SWITCHES if owner == "engine" else _is_flag(owner, attr)
            if eq and not known:  # a mistyped name, or one without its owner (engine., pdl., ...)
                raise ValueError(f"switch {item!r} of variant {name!r} is not a switch; the switches: {_switch_names()}")
            if not (eq and dot) or value not in ("0", "1"):
                raise ValueError(
                    f"switch {item!r} of variant {name!r}: write owner.attr=0 or owner.attr=1, switches separated by ','"
                )
            parsed = value == "1"
        if (owner, attr) in sets:
            raise ValueError(f"variant {name!r} sets {key} twice")
        sets[(owner, attr)] = parsed
    return name.strip(), sets


def apply(sets: dict[tuple[str, str], bool | int], defaults: dict, engine: RolloutEngine | None) -> None:
    """Set every switch any variant names: this variant's value, else its default (a module flag's
    value before any variant ran; an engine attribute as the engine was built: None), so that a
    flag one variant sets never carries over into the next. Engine attributes only given ``engine``."""
    for (owner, attr), default in defaults.items():
        value = sets.get((owner, attr), default)
        if owner != "engine":
            setattr(MODULES[owner], attr, value)
        elif engine is not None and value is not None:
            setattr(engine, attr, value)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default: cpu")
    p.add_argument(
        "--preset", default=None, choices=sorted(br.PRESETS), help="the model (default qwen3-0.6b on cuda, tiny on cpu)"
    )
    p.add_argument("--batch-sizes", default="1,32", type=br._batch_sizes, help="comma list (default 1,32)")
    p.add_argument("--prompt-len", type=int, default=128, help="default 128")
    p.add_argument("--new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--rounds", type=int, default=3, help="timed calls of each variant after its warm-up (default 3)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="name:owner.attr=value,... (two or more; the first is the baseline); a value is 0 / 1 for an on/off "
        "switch, an integer >= 0 for a threshold; a mistyped switch lists every switch",
    )
    p.add_argument(
        "--hbm-tb-s", type=float, default=None, help="roofline bandwidth, TB/s (default: the card's, as bench_rollout's)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU (1 steadies a shared CPU)")
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        p.error(str(e))
    if len(variants) < 2:
        p.error("give two or more --variant (the first is the baseline)")
    names = [n for n, _ in variants]
    if len(set(names)) < len(names):
        p.error(f"--variant names must differ; got {names}")
    for flag in ("rounds", "prompt_len", "new_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.hbm_tb_s is not None and not 0 < args.hbm_tb_s < float("inf"):
        p.error(f"--hbm-tb-s must be a positive number, got {args.hbm_tb_s}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU is visible here; use --device cpu")
    if args.device == "cpu" and any(sets.get(("engine", "use_cuda_graphs")) for _, sets in variants):
        p.error("engine.use_cuda_graphs=1 needs --device cuda (CUDA graphs)")
    preset = args.preset or ("qwen3-0.6b" if args.device == "cuda" else "tiny")
    if args.threads:
        torch.set_num_threads(args.threads)
    defaults = {}
    for _, sets in variants:
        for owner, attr in sets:
            # a module flag's value now; an engine attribute: the engine's own (None: left as built)
            defaults[(owner, attr)] = getattr(MODULES[owner], attr) if owner != "engine" else None
    bargs = br.parse_args(["--device", args.device, "--preset", preset, "--prompt-len", str(args.prompt_len),
                           "--new-tokens", str(args.new_tokens), "--mtp-depths", "0", "--batch-sizes", args.batch_sizes]
                          + (["--hbm-tb-s", str(args.hbm_tb_s)] if args.hbm_tb_s else []), errors=p)  # fmt: skip
    print(f"command: python bench/bench_switches.py {shlex.join(argv)}", flush=True)
    model = br.build_model(bargs, torch.bfloat16 if args.device == "cuda" else torch.float32)
    for q in model.parameters():
        q.requires_grad_(False)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    bandwidth = bargs.hbm_tb_s * 1e12 if bargs.hbm_tb_s else None
    roofline = f"roofline at {bargs.hbm_tb_s} TB/s" if bandwidth else "no roofline (--hbm-tb-s)"
    print(f"device {name}, preset {preset}, {roofline}", flush=True)
    if args.device == "cpu":
        print("note: on the CPU the kernel switches change nothing (Triton kernels run on CUDA only) and a ratio "
              "is the run-to-run spread (many times apart on a shared CPU without --threads 1); use the CPU run to "
              "check a variant, not to time it", flush=True)  # fmt: skip
    base = variants[0][0]
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts, seeds = br.prompts_for(model, batch, args.prompt_len), list(range(batch))
        cfg = GenerationConfig(temperature=1.0, max_new_tokens=args.new_tokens, batch_size=batch, stop_token_ids=[])
        engines = {}
        for vname, sets in variants:
            apply(sets, defaults, None)
            engine = RolloutEngine(model, cfg, args.device)
            apply(sets, defaults, engine)
            engine.generate(prompts, seeds)  # captures and compilations
            engines[vname] = engine
        best = {vname: 0.0 for vname, _ in variants}
        tokens = {}
        for r in range(args.rounds):
            for vname, sets in variants if r % 2 == 0 else variants[::-1]:
                apply(sets, defaults, engines[vname])
                results = engines[vname].generate(prompts, seeds)
                best[vname] = max(best[vname], engines[vname].last_stats.tokens_per_s)
                tokens[vname] = [res.response_ids for res in results]
        _, roof = br.roofline(model, batch, args.prompt_len + args.new_tokens / 2, bandwidth)
        parts = []
        for vname, tps in best.items():
            same = sum(a == b for a, b in zip(tokens[vname], tokens[base]))
            parts.append(
                f"{vname} {tps:,.0f} tok/s {br._percent(tps, roof).strip()} ({tps / best[base]:.3f}x, same tokens {same}/{batch})"
            )
        print(f"batch {batch}: " + "; ".join(parts), flush=True)
        del engines
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
