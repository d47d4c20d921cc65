"""The decode step's q/k norm + rotary + KV write kernel (splitrl.rollout.rope_write) against the
torch functions it replaces (fused.qkv_norm_rope / qkv_rope, then StaticKVCache.write_kv): Triton's
interpreter in fp32 on the CPU where it runs, CUDA in bf16; its input checks everywhere."""

import os

import pytest
import torch
from _rollout_helpers import run_interpreted

from splitrl.rollout import fused, rope_write
from splitrl.rollout.kv import StaticKVCache

needs_cuda_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and rope_write.AVAILABLE), reason="needs CUDA and Triton"
)


def case(dt, device, norm, pm, B, Q, Hq, Hk, d, seed=0):
    """(q, the torch path's q, the cache after the kernel, the cache after the torch path) of one
    decode forward: ``dt``, per-head ``norm``, a position-major (``pm``) or head-major cache, B rows
    in shuffled slots, Q queries a row ending at random positions."""
    torch.manual_seed(seed)
    M, S = 24, B + 2
    caches = [StaticKVCache(2, S, Hk, M, d, dt, device, flash=False, position_major=pm) for _ in range(2)]
    caches[0].kv.normal_()
    caches[1].kv.copy_(caches[0].kv)
    qkv = torch.randn(B, Q, (Hq + 2 * Hk) * d, device=device).to(dt)
    qw, kw = (1 + 0.2 * torch.randn(2, d, device=device)).to(dt) if norm else (None, None)
    angle = torch.arange(M, device=device)[:, None] * 0.3 / (1 + torch.arange(d, device=device))
    table = torch.stack([torch.cos(angle), torch.sin(angle)], 1).to(dt)
    last = torch.randint(Q - 1, M - 1, (B,), device=device)
    pos = last[:, None] - (Q - 1) + torch.arange(Q, device=device)
    cos, sin = table[pos].unbind(2)  # views with a row stride of 2d, as the engine's table gives
    slots = torch.randperm(S, device=device)[:B]
    plan = caches[0].plan(pos, pos, pos, M, slots)
    q = rope_write.norm_rope_write(qkv, Hq * d, Hk * d, d, qw, kw, 1e-6, cos, sin, caches[0].kv[:, 1], plan.flat_index)
    if norm:
        ref_q, kv = fused.qkv_norm_rope(qkv, Hq * d, Hk * d, d, qw, kw, 1e-6, cos, sin)
    else:
        ref_q, kv = fused.qkv_rope(qkv, Hq * d, Hk * d, d, cos, sin)
    caches[1].write_kv(1, plan, kv)
    return q, ref_q, caches[0].kv, caches[1].kv


_INTERPRETED = r"""
import os, sys, torch
sys.path.insert(0, os.environ["SPLITRL_TEST_DIR"])
from test_rope_write import case
from splitrl.rollout import rope_write
worst, untouched, swapped = 0.0, True, 0.0
for group_from in (10**9, 1):  # one head a program; heads grouped (2 or 4 a program here)
    rope_write.GROUP_FROM_TOKENS = group_from
    for norm, pm in ((True, False), (True, True), (False, False), (False, True)):
        for B, Q, Hq, Hk, d in ((1, 1, 4, 2, 16), (3, 2, 4, 2, 16), (2, 3, 2, 2, 12), (2, 1, 8, 4, 16)):
            q, ref_q, kv, ref_kv = case(torch.float32, "cpu", norm, pm, B, Q, Hq, Hk, d)
            worst = max(worst, float((q - ref_q).abs().max().nan_to_num(float("inf"))), float((kv - ref_kv).abs().max().nan_to_num(float("inf"))))
            untouched &= bool(torch.equal(kv[:, 0], ref_kv[:, 0]))  # layer 0: not written
            swapped = max(swapped, float((kv[0] - ref_kv[1]).abs().max()))
print(worst, int(untouched), swapped)
"""


@pytest.mark.skipif(not rope_write.AVAILABLE, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_the_kernel_under_the_interpreter_is_the_torch_path():
    """fp32 on the CPU: both cache layouts, with and without per-head norms, 1..3 queries a row,
    rows in other slots, a head dim whose half is not a power of two (masked lanes), one head a
    program and 2 or 4: queries and every cache entry as the torch functions give them; keys and
    values not swapped."""
    here = os.path.dirname(os.path.abspath(__file__))
    worst, untouched, swapped = map(float, run_interpreted(_INTERPRETED, SPLITRL_TEST_DIR=here)[-3:])
    assert worst < 1e-5, worst
    assert untouched == 1
    assert swapped > 0.1


def test_the_kernel_refuses_bad_inputs_before_any_launch():
    """Checked before Triton is needed: these run on CPU installs too."""
    d, B, Q = 16, 2, 1
    cache = StaticKVCache(3, 3, 2, 8, d, torch.float32, "cpu", flash=False)  # 3 layers: kv[0] is not [2, ...]
    qkv, cs = torch.randn(B, Q, 8 * d), torch.randn(B, Q, d)
    idx = torch.zeros(B * Q * 2, dtype=torch.int64)
    w = torch.ones(d)
    args = dict(nq=4 * d, nk=2 * d, d=d, q_weight=w, k_weight=w, eps=1e-6, cos=cs, sin=cs, kv_layer=cache.kv[:, 0])
    bad = [
        (dict(args, nq=3 * d), "nq \\+ 2·nk"),
        (dict(args, k_weight=None), "both be \\[d\\] or both be None"),
        (dict(args, cos=cs[..., :8]), "cos must be"),
        (dict(args, sin=cs.half()), "sin must be"),
        (dict(args, kv_layer=cache.kv[0]), "kv_layer must be"),
    ]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            rope_write.norm_rope_write(qkv, flat_index=idx, **kw)
    with pytest.raises(ValueError, match="flat_index must be"):
        rope_write.norm_rope_write(qkv, flat_index=idx[:1], **args)
    with pytest.raises(ValueError, match="contiguous along its features"):
        rope_write.norm_rope_write(torch.randn(B, Q, 16 * d)[..., ::2], flat_index=idx, **args)
    if not rope_write.AVAILABLE:
        with pytest.raises(ValueError, match="needs Triton"):
            rope_write.norm_rope_write(qkv, flat_index=idx, **args)


@needs_cuda_triton
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("pm", [True, False])
@pytest.mark.parametrize("B,Q", [(1, 1), (32, 1), (8, 3), (256, 1), (64, 3)])
def test_bf16_on_cuda_rounds_as_the_torch_path(norm, pm, B, Q):
    """The eager torch ops round each product and sum to bf16 and the kernel rounds at the same
    points: its error against the fp32 values is no larger than theirs (on the H200 it was smaller,
    0.0025-0.0039 against 0.0028-0.0042, with 84-88 % of the elements bit-identical to theirs)."""
    q, ref_q, kv, ref_kv = case(torch.bfloat16, "cuda", norm, pm, B, Q, 16, 8, 128)
    q32, _, kv32, _ = case(torch.float32, "cuda", norm, pm, B, Q, 16, 8, 128)  # the same draws in fp32
    for got, ref, exact in ((q, ref_q, q32), (kv, ref_kv, kv32)):
        err, base_err = (float((t.float() - exact).norm() / exact.norm()) for t in (got, ref))
        assert err < 6e-3 and err < 1.25 * base_err + 1e-4, (err, base_err)


@needs_cuda_triton
def test_in_a_cuda_graph():
    q, _, kv, ref_kv = case(torch.bfloat16, "cuda", True, True, 4, 1, 16, 8, 128)
    assert q.shape == (4, 1, 16, 128)
    torch.manual_seed(0)
    d = 128
    cache = StaticKVCache(1, 4, 8, 16, d, torch.bfloat16, "cuda", flash=False, position_major=True)
    qkv = torch.randn(4, 1, 32 * d, device="cuda", dtype=torch.bfloat16)
    cs = torch.randn(4, 1, d, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([[3], [5], [0], [15]], device="cuda")
    plan = cache.plan(pos, pos, pos, 16)
    eager = rope_write.norm_rope_write(qkv, 16 * d, 8 * d, d, w, w, 1e-6, cs, cs, cache.kv[:, 0], plan.flat_index)
    expected = cache.kv.clone()
    cache.kv.zero_()
    out = torch.empty_like(eager)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(
            rope_write.norm_rope_write(qkv, 16 * d, 8 * d, d, w, w, 1e-6, cs, cs, cache.kv[:, 0], plan.flat_index)
        )
    g.replay()
    assert torch.equal(out, eager) and torch.equal(cache.kv, expected)


def test_heads_a_program_divide_both_head_counts_as_a_power_of_two(monkeypatch):
    """One head a program below GROUP_FROM_TOKENS tokens; from there the largest power of two that
    divides Hq and Hk (a program's heads are all queries or all keys, and Triton's ranges are
    powers of two), at most MAX_HEADS_PER_PROGRAM rounded down to a power of two."""
    hpp = rope_write.heads_per_program
    monkeypatch.setattr(rope_write, "GROUP_FROM_TOKENS", 64)
    monkeypatch.setattr(rope_write, "MAX_HEADS_PER_PROGRAM", 8)
    assert hpp(63, 16, 8) == 1 and hpp(64, 16, 8) == 8  # Qwen3-0.6B
    assert hpp(256, 14, 2) == 2 and hpp(256, 12, 4) == 4 and hpp(256, 9, 3) == 1 and hpp(256, 32, 32) == 8
    for cap, want in ((6, 4), (1, 1), (0, 1)):
        monkeypatch.setattr(rope_write, "MAX_HEADS_PER_PROGRAM", cap)
        assert hpp(256, 16, 8) == want


@needs_cuda_triton
def test_a_prefill_past_two_billion_projection_elements():
    """350,000 tokens of the Qwen3-0.6B projection (6,144 features: 2.15e9 elements): the last
    token's offsets pass 2**31, which int32 arithmetic wrapped (a prefill of 128 rows x 2,736
    tokens reaches it) before the kernel computed them in int64. Its query and its cache entries
    as the torch path gives them."""
    T, hq, hk, d = 350_000, 16, 8, 128
    torch.manual_seed(0)
    qkv = torch.zeros(1, T, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    qkv[0, -1].normal_()
    cs = torch.randn(1, T, d, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.2 * torch.randn(d, device="cuda")).to(torch.bfloat16)
    cache = StaticKVCache(1, 2, hk, 8, d, torch.bfloat16, "cuda", flash=False, position_major=True)
    index = torch.arange(T * hk, device="cuda") % hk + hk  # every token on rows hk..2hk-1 ...
    index[-hk:] = torch.arange(hk, device="cuda")  # ... but the last, on rows 0..hk-1
    q = rope_write.norm_rope_write(qkv, hq * d, hk * d, d, w, w, 1e-6, cs, cs, cache.kv[:, 0], index)
    ref_q, ref_kv = fused.qkv_norm_rope(qkv[:, -1:], hq * d, hk * d, d, w, w, 1e-6, cs[:, -1:], cs[:, -1:])
    # bf16 rounding of two computations (one step is 0.03 at |x| = 4; 2 % allows a few); a wrapped offset reads a zero row
    torch.testing.assert_close(q[0, -1].float(), ref_q[0, 0].float(), atol=2e-2, rtol=2e-2)
    got_kv = cache.kv[:, 0].reshape(2, -1, d)[:, :hk]  # rows 0..hk-1 of each half
    torch.testing.assert_close(got_kv.float(), ref_kv.reshape(2, hk, d).float(), atol=2e-2, rtol=2e-2)
    del qkv, q
    torch.cuda.empty_cache()
