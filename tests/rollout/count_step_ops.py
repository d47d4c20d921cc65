"""Count the aten ops that launch work in one plain and one speculative decode step, by phase (a
CPU proxy for the GPU kernels of a step). Not a test: ``PYTHONPATH=src python tests/rollout/count_step_ops.py``.

Ops are seen below autograd (a ``TorchDispatchMode``), so composite ops appear as what they run
(``linear`` as ``addmm``/``mm``, ``reshape`` as a view or a ``clone``). View ops and allocations
(``empty*``) launch nothing and are not counted. Functions of :class:`splitrl.rollout.fused.Kernels`
run eagerly here: each call counts its ops, while on CUDA it is one (or a few) compiled kernels;
``--fused`` counts each such call as one op instead.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rollout_helpers import make_model, random_prompts  # noqa: E402

from splitrl.rollout import (  # noqa: E402
    GenerationConfig,
    RolloutEngine,
    fused,  # noqa: E402
)

VIEWS = {
    "view", "reshape", "slice", "select", "expand", "as_strided", "transpose", "permute", "unsqueeze", "squeeze",
    "split", "split_with_sizes", "chunk", "unbind", "detach", "alias", "t", "narrow", "unflatten", "flatten",
    "_unsafe_view", "_reshape_alias", "view_as", "expand_as", "lift_fresh", "resolve_conj", "resolve_neg",
}  # fmt: skip
# allocations; a ``to`` without children returns its input; scalar_tensor wraps a Python number
FREE = VIEWS | {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "set_", "resize_", "to",
    "result_type", "scalar_tensor",
}  # fmt: skip


def _count(event, phase: str, out, fused_as_one: bool, parents: bool = False) -> int:
    """Ops of ``event``'s subtree that do work: the lowest non-free op of each chain (a ``clone``
    counts as its ``copy_``, ``linear`` as its ``addmm``); phases are ``phase:`` ranges."""
    name = event.name
    if name.startswith("phase:"):
        phase = name[len("phase:") :]
    elif name.startswith("fused:") and fused_as_one:
        out[phase][f"[{name}]"] += 1
        return 1
    n = sum(_count(c, phase, out, fused_as_one, parents) for c in event.cpu_children)
    if n or not name.startswith("aten::") or name[len("aten::") :] in FREE:
        return n
    key = name[len("aten::") :]
    if parents:
        chain, e = [], event.cpu_parent
        while e is not None and e.name.startswith("aten::"):
            chain.append(e.name[len("aten::") :])
            e = e.cpu_parent
        if chain:
            key += " <- " + " <- ".join(chain)
    out[phase][key] += 1
    return 1


def _wrap(obj, attr, phase: str):
    orig = getattr(obj, attr)

    def wrapped(*a, **k):
        with torch.profiler.record_function("phase:" + phase):
            return orig(*a, **k)

    setattr(obj, attr, wrapped)


def _wrap_fused(kernels):
    for name in fused._NAMES:
        orig = getattr(kernels, name)

        def wrapped(*a, _orig=orig, _name=name, **k):
            with torch.profiler.record_function("fused:" + _name):
                return _orig(*a, **k)

        setattr(kernels, name, wrapped)


def _count_steps(engine, B: int, args) -> dict:
    """Ops of one plain and one speculative step from a live mid-response state (restored after)."""
    results = {}
    for kind in ("plain", "spec"):
        st = engine.runner.state
        # a live state: slots 0..B-1 mid-response
        st.done[:B] = False
        st.counter[:B] = 3
        st.pos[:B] = 10
        saved = st.snapshot()
        L = 64
        step = engine.runner.plain_step if kind == "plain" else engine.runner.spec_step
        step(B, L)  # warm (lazy inits)
        st.restore(saved)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function("phase:rest"):
                step(B, L)
        st.restore(saved)
        out = collections.defaultdict(collections.Counter)
        for e in prof.events():
            if e.cpu_parent is None:
                _count(e, "rest", out, args.fused, args.parents)
        results[kind] = out
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--fused", action="store_true", help="count each Kernels call as one op")
    p.add_argument("--detail", action="store_true", help="list the ops of each phase")
    p.add_argument("--parents", action="store_true", help="with --detail: name the aten ops each op runs under")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = make_model(vocab=128, depths=2).to(getattr(torch, args.dtype))
    B = args.batch
    cfg = GenerationConfig(max_new_tokens=24, batch_size=B, speculative=True)
    engine = RolloutEngine(model, cfg)
    engine.speculative_switch_off = False
    prompts = random_prompts(B, 128, (5, 9))
    engine.generate(prompts, list(range(B)))  # buffers, drafter, state
    _wrap_fused(engine.fwd.k)
    fwd, drafter = engine.fwd, engine.runner.drafter
    _wrap(fwd, "backbone_decode", "backbone")
    _wrap(fwd, "mtp_decode", "drafter/mtp_decode")
    _wrap(engine.runner, "_logits", "lm_head")
    _wrap(engine.runner, "_sample", "sample")
    _wrap(engine.runner, "_write_outputs", "write_outputs")
    _wrap(drafter, "step", "drafter")
    _wrap(drafter, "_draw", "drafter/draft_head+draw")
    with torch.inference_mode():
        results = _count_steps(engine, B, args)
    for kind, phases in results.items():
        total = sum(sum(c.values()) for c in phases.values())
        print(f"== {kind} step (B={B}, {args.dtype}{', fused calls = 1' if args.fused else ''}): {total} ops")
        for ph in sorted(phases):
            c = phases[ph]
            copies = sum(v for n, v in c.items() if n.split(" ")[0] in ("copy_", "cat", "stack"))
            print(f"  {ph:40s} {sum(c.values()):5d}   (copy_/cat/stack: {copies})")
            if args.detail:
                for n, v in sorted(c.items(), key=lambda x: -x[1]):
                    print(f"      {n:36s} {v}")


if __name__ == "__main__":
    main()
