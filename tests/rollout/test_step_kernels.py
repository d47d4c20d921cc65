"""The decode steps' bookkeeping functions (:mod:`splitrl.rollout.fused`) compiled with
``torch.compile`` (as on CUDA, here with the CPU backend) against their eager versions, bit for bit,
over two batch sizes (the compiled versions are shape-dynamic) and with and without stop tokens."""

import pytest
import torch

from splitrl.rollout import fused

D, MAX_NEW = 2, 9


@pytest.fixture(scope="module")
def compiled():
    torch._dynamo.reset()
    return {
        n: torch.compile(getattr(fused, n), dynamic=True)
        for n in ("plain_commit", "spec_accept", "spec_commit", "draft_window", "plan_tensors")
    }


def _state(B, g):
    return dict(
        tokens=torch.randint(0, 50, (B,), generator=g),
        pos=torch.randint(3, 40, (B,), generator=g),
        counter=torch.randint(0, MAX_NEW, (B,), generator=g),
        done=torch.rand(B, generator=g) < 0.3,
        stopped=torch.zeros(B, dtype=torch.bool),
        drafted=torch.randint(0, 5, (B,), generator=g),
        accepted=torch.randint(0, 5, (B,), generator=g),
        reached_depth=torch.randint(0, 5, (B, D), generator=g),
        accepted_depth=torch.randint(0, 5, (B, D), generator=g),
    )


def _clone(st):
    return {k: v.clone() for k, v in st.items()}


@pytest.mark.parametrize("B", [5, 12])
@pytest.mark.parametrize("stops", [[], [3, 7]])
def test_compiled_step_bookkeeping_equals_eager(compiled, B, stops):
    g = torch.Generator().manual_seed(B + len(stops))
    stop_ids = torch.tensor(stops, dtype=torch.int64)
    # plain step
    st, y = _state(B, g), torch.randint(0, 10, (B,), generator=g)
    eager, comp = _clone(st), _clone(st)
    keys = ("tokens", "pos", "counter", "done", "stopped")
    fused.plain_commit(*(eager[k] for k in keys), y, stop_ids, MAX_NEW)
    compiled["plain_commit"](*(comp[k] for k in keys), y, stop_ids, MAX_NEW)
    for k in keys:
        assert torch.equal(eager[k], comp[k]), k
    assert not torch.equal(eager["counter"], st["counter"])  # the update did something
    # verify: drafts matching their targets for a random prefix
    targets = torch.randint(0, 10, (B, D + 1), generator=g)
    drafts = torch.where(torch.rand(B, D, generator=g) < 0.6, targets[:, :D], (targets[:, :D] + 1) % 10)
    out_e = fused.spec_accept(drafts, targets, st["counter"], st["done"], stop_ids, MAX_NEW)
    out_c = compiled["spec_accept"](drafts, targets, st["counter"], st["done"], stop_ids, MAX_NEW)
    for e, c in zip(out_e, out_c):
        assert torch.equal(e, c)
    assert len(set(out_e[0].tolist())) > 1  # several acceptance lengths in the batch
    eager, comp = _clone(st), _clone(st)
    keys = ("tokens", "pos", "counter", "done", "stopped", "drafted", "accepted", "reached_depth", "accepted_depth")
    fused.spec_commit(*(eager[k] for k in keys), targets, *out_e)
    compiled["spec_commit"](*(comp[k] for k in keys), targets, *out_e)
    for k in keys:
        assert torch.equal(eager[k], comp[k]), k
    # MTP draft window and an attention plan
    n_minus_1 = st["pos"] + out_e[0]
    for depth in (1, 2):
        e = fused.draft_window(st["pos"], out_e[0], n_minus_1, depth, D + 1, 63)
        c = compiled["draft_window"](st["pos"], out_e[0], n_minus_1, depth, D + 1, 63)
        assert all(torch.equal(x, z) for x, z in zip(e, c))
        rows = torch.arange(B)
        for position_major in (False, True):
            pe = fused.plan_tensors(e[1], e[0], e[2], rows, 2, 64, 48, position_major)
            pc = compiled["plan_tensors"](e[1], e[0], e[2], rows, 2, 64, 48, position_major)
            assert torch.equal(pe[0], pc[0]) and torch.equal(pe[1], pc[1])
            # the flash plan: the index only
            pe0 = fused.plan_tensors(e[1], e[0], e[2], rows, 2, 64, 0, position_major)
            pc0 = compiled["plan_tensors"](e[1], e[0], e[2], rows, 2, 64, 0, position_major)
            assert pe0[1] is None and pc0[1] is None and torch.equal(pe0[0], pc0[0]) and torch.equal(pe0[0], pe[0])


def test_kernels_compile_and_warm_up_without_falling_back(monkeypatch, caplog):
    """On CUDA the engine's kernels are compiled once per process and warmed up with small inputs
    (a compiler failure falls back to eager with a warning). Here the same start-up runs with the
    CPU backend: a warm-up call that does not fit a function's signature would make every engine
    fall back to eager kernels (a silent 2x-10x slowdown on the GPU), and this fails instead."""
    monkeypatch.setattr(fused, "_COMPILED", {})
    kernels = fused.Kernels(True, torch.device("cpu"), torch.float32)
    assert kernels.compiled, caplog.text
    assert all(getattr(kernels, n) is fused._COMPILED[n] for n in fused._NAMES)
