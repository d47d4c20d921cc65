"""The backbone decode's flash path (each row read up to its own length) against the masked SDPA
path and an fp32 recomputation, in and out of a CUDA graph. CUDA only: the flash varlen kernel
has no CPU build (the CPU runs the masked path, which the engine tests check against a full
forward per token)."""

import pytest
import torch
from _rollout_helpers import run_interpreted, run_python

from splitrl.rollout import decode_attention as decode_mod
from splitrl.rollout import kv as kv_mod
from splitrl.rollout.kv import StaticKVCache

needs_flash = pytest.mark.skipif(
    not (torch.cuda.is_available() and kv_mod.FLASH_DECODE), reason="needs CUDA and the flash varlen op"
)

S, M, HK, H, D_HEAD = 6, 320, 2, 8, 128


def _caches():
    torch.manual_seed(0)
    flash = StaticKVCache(2, S, HK, M, D_HEAD, torch.bfloat16, "cuda", flash=True)
    masked = StaticKVCache(2, S, HK, M, D_HEAD, torch.bfloat16, "cuda", flash=False)
    assert flash.flash and not masked.flash
    assert flash.k.shape == (2, S, M, HK, D_HEAD) and masked.k.shape == (2, S, HK, M, D_HEAD)
    flash.k.normal_()
    flash.v.normal_()
    masked.k.copy_(flash.k.transpose(2, 3))  # [N, S, M, Hk, d] -> [N, S, Hk, M, d]
    masked.v.copy_(flash.v.transpose(2, 3))
    return flash, masked


def _reference(cache: StaticKVCache, layer: int, q, last_pos, scale):
    """fp32 attention of row b's query i at position p_b - Q + 1 + i over indices <= its position."""
    B, Q, Hq, d = q.shape
    G = Hq // HK
    out = torch.empty(B, Q, Hq * d, dtype=torch.float32, device=q.device)
    for b in range(B):
        for i in range(Q):
            p = int(last_pos[b]) - Q + 1 + i
            k = cache.k[layer, b, : p + 1].float().repeat_interleave(G, dim=1)  # [p+1, Hq, d]
            v = cache.v[layer, b, : p + 1].float().repeat_interleave(G, dim=1)
            w = torch.einsum("hd,thd->ht", q[b, i].float(), k) * scale
            out[b, i] = torch.einsum("ht,thd->hd", w.softmax(-1), v).reshape(-1)
    return out


@needs_flash
@pytest.mark.parametrize("Q", [1, 3])
@pytest.mark.parametrize("fold_min_q", [1, 2, 1 << 30])
@pytest.mark.parametrize("kernel", ["flash", "triton"])
def test_flash_decode_reads_each_row_to_its_own_length(monkeypatch, Q, fold_min_q, kernel):
    if kernel == "triton" and not decode_mod.AVAILABLE:
        pytest.skip("no Triton")
    if kernel == "triton" and fold_min_q != 2:
        pytest.skip("the fold setting is the flash call's; the Triton kernel has none")
    monkeypatch.setattr(kv_mod, "FLASH_FOLD_MIN_Q", fold_min_q)  # folded G query heads, or the kernel's own
    monkeypatch.setattr(kv_mod, "DECODE_KERNEL", kernel)
    flash, masked = _caches()
    B, L = 5, 288
    last = torch.tensor([4, 287, 130, 17, 200], device="cuda")  # ragged: 5 to 288 entries
    pos = last[:, None] - (Q - 1) + torch.arange(Q, device="cuda")
    q = torch.randn(B, Q, H, D_HEAD, dtype=torch.bfloat16, device="cuda")
    scale = D_HEAD**-0.5
    plan_f = flash.plan(pos, pos, pos, L, causal=True)
    plan_m = masked.plan(pos, pos, pos, L, causal=True)
    assert plan_f.seqused is not None and plan_f.mask is None and plan_m.seqused is None
    out_f = flash.attend(1, q, plan_f, scale).float()
    out_m = masked.attend(1, q, plan_m, scale).float()
    ref = _reference(flash, 1, q, last, scale)
    # bf16 inputs, fp32 softmax in both kernels: the two paths differ by output rounding only
    assert (out_f - ref).abs().max().item() < 2e-2
    assert (out_m - ref).abs().max().item() < 2e-2
    assert (out_f - out_m).abs().max().item() < 2e-2
    # the reference is sensitive to the row lengths: reading every row to L (a masked plan) differs
    wrong = masked.plan(pos, pos, torch.full_like(pos, L - 1), L)
    assert (masked.attend(1, q, wrong, scale).float() - ref).abs().max().item() > 0.1


@needs_flash
@pytest.mark.parametrize("Q", [1, 3])
@pytest.mark.parametrize("kernel", ["flash", "triton"])
def test_flash_decode_replays_in_a_cuda_graph_with_new_lengths(monkeypatch, Q, kernel):
    if kernel == "triton" and not decode_mod.AVAILABLE:
        pytest.skip("no Triton")
    monkeypatch.setattr(kv_mod, "DECODE_KERNEL", kernel)
    flash, _ = _caches()
    B, L = 4, 256
    pos = torch.tensor([10, 40, 90, 200], device="cuda")[:, None] + torch.arange(Q, device="cuda")
    q = torch.randn(B, Q, H, D_HEAD, dtype=torch.bfloat16, device="cuda")
    scale = D_HEAD**-0.5

    def step():
        return flash.attend(0, q, flash.plan(pos, pos, pos, L, causal=True), scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    pos.copy_(torch.tensor([250, 3, 128, 64], device="cuda")[:, None] + torch.arange(Q, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference(flash, 0, q, pos[:, -1], scale)
    assert (out.float() - ref).abs().max().item() < 2e-2


# ------------------------------------------------------------------ the layouts, on any device


def _pair(dtype=torch.float64):
    """A head-major and a position-major cache (CPU) with the same contents."""
    torch.manual_seed(1)
    head = StaticKVCache(2, S, HK, 40, 8, dtype, "cpu", flash=False)
    pos = StaticKVCache(2, S, HK, 40, 8, dtype, "cpu", flash=False, position_major=True)
    assert head.k.shape == (2, S, HK, 40, 8) and pos.k.shape == (2, S, 40, HK, 8)
    head.k.normal_()
    head.v.normal_()
    pos.k.copy_(head.k.transpose(2, 3))
    pos.v.copy_(head.v.transpose(2, 3))
    return head, pos


def _same(head, pos):
    return torch.equal(head.k, pos.k.transpose(2, 3)) and torch.equal(head.v, pos.v.transpose(2, 3))


def test_both_layouts_write_move_and_attend_alike():
    """Every operation of the cache gives the same entries and outputs in both layouts (the
    position-major one is what the flash kernel reads on CUDA; here its index arithmetic is
    checked on the CPU, through the masked path)."""
    head, pos = _pair()
    g = torch.Generator().manual_seed(2)
    # a prefill of slots 3 and 1
    k = torch.randn(2, 7, HK, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 7, HK, 8, generator=g, dtype=torch.float64)
    for c in (head, pos):
        c.write_prefix(1, torch.tensor([3, 1]), k, v)
    assert _same(head, pos)
    # a decode write + attend of slots 0..2, and of given slots (the MTP queries' case)
    for slots in (None, torch.tensor([4, 0, 2])):
        B, Q = 3, 2
        write = torch.tensor([[9, 10], [5, 39], [20, 21]])  # 39: the scratch entry
        limit = torch.tensor([[8, 9], [4, 4], [19, 20]])
        kq = torch.randn(B, Q, HK, 8, generator=g, dtype=torch.float64)
        q = torch.randn(B, Q, 4, 8, generator=g, dtype=torch.float64)
        outs = []
        for c in (head, pos):
            plan = c.plan(write, write, limit, 24, slots)
            c.write(0, plan, kq, -kq)
            outs.append(c.attend(0, q, plan, 0.3))
        assert _same(head, pos)
        assert torch.equal(outs[0], outs[1])
        assert not torch.equal(head.k[0, 0], torch.zeros_like(head.k[0, 0]))
    for c in (head, pos):
        c.move(torch.tensor([4, 3]), torch.tensor([0, 5]))
    assert _same(head, pos)


def test_the_mtp_cache_is_never_a_flash_cache(monkeypatch):
    """The MTP depths' queries read through masks (not a causal block at the end of a row), so
    their cache must not take the flash layout on CUDA: a first version built it with the default
    and read it through a transposed view on every draft."""
    from _rollout_helpers import make_model

    from splitrl.rollout import GenerationConfig, RolloutEngine
    from splitrl.rollout import runner as runner_mod

    built = []

    class Recording(StaticKVCache):
        def __init__(self, num_layers, *args, **kwargs):
            built.append((num_layers, kwargs.get("flash")))
            super().__init__(num_layers, *args, **kwargs)

    monkeypatch.setattr(runner_mod, "StaticKVCache", Recording)
    model = make_model(vocab=32, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=4, batch_size=2), "cpu")
    engine.generate([[1, 2]], [0])
    layers = model.config.num_hidden_layers
    assert (layers, None) in built  # the backbone's: flash where it runs
    assert (2, False) in built  # the MTP depths'


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, seqused_k):
    """The flash varlen kernel's semantics in fp64 (each sequence alone; causal aligned to the end)."""
    out = torch.zeros_like(q)
    G = q.shape[1] // k.shape[1]
    for s in range(len(seqused_k)):
        q0, q1, k0 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s])
        n = int(seqused_k[s])
        assert q1 - q0 <= max_q and n <= max_k
        ks = k[k0 : k0 + n].repeat_interleave(G, dim=1)
        vs = v[k0 : k0 + n].repeat_interleave(G, dim=1)
        w = torch.einsum("qhd,khd->hqk", q[q0:q1], ks) * scale
        if causal:
            Tq = q1 - q0
            allowed = torch.arange(n)[None, :] <= torch.arange(Tq)[:, None] + (n - Tq)
            w = w.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", w.softmax(-1), vs)
    return out


@pytest.mark.parametrize("Q", [1, 3])
@pytest.mark.parametrize("fold_min_q", [1, 2, 1 << 30])
def test_flash_plans_read_what_the_masked_path_reads(monkeypatch, Q, fold_min_q):
    """The flash path's index arithmetic, on the CPU with the kernel's semantics in its place: the
    plain call (the kernel folds Q = 1 itself) and the folded one (B*Q sequences of G query heads,
    each reading its own causal prefix of the row; the verify forward's Q > 1) give the masked
    path's output. Guards: a fold that transposes heads and queries the wrong way, a sequence's
    length off by one (a draft seeing the token after it), rows mixed up."""
    from splitrl.rollout import kv

    monkeypatch.setattr(kv, "flash_varlen", _varlen_reference)
    monkeypatch.setattr(kv, "FLASH_FOLD_MIN_Q", fold_min_q)
    monkeypatch.setattr(kv, "DECODE_KERNEL", "flash")  # the Triton kernel: its own tests below
    head, pos = _pair()
    pos.flash = True  # position-major, read through the (emulated) kernel
    Hq, B, L = 4, 4, 24
    last = torch.tensor([5, 23, 11, 2])
    write = last[:, None] - (Q - 1) + torch.arange(Q)
    g = torch.Generator().manual_seed(3)
    kq = torch.randn(B, Q, HK, 8, generator=g, dtype=torch.float64)
    q = torch.randn(B, Q, Hq, 8, generator=g, dtype=torch.float64)
    outs = []
    for c in (head, pos):
        plan = c.plan(write, write, write, L, causal=True)
        c.write(1, plan, kq, -kq)
        outs.append(c.attend(1, q, plan, 0.3))
    assert pos.plan(write, write, write, L, causal=True).seqused is not None
    assert torch.allclose(outs[0], outs[1], atol=1e-12, rtol=0)
    # the check can fail: one entry more for every query changes the output
    plan = pos.plan(write + 1, write + 1, write + 1, L, causal=True)
    assert not torch.allclose(outs[0], pos.attend(1, q, plan, 0.3), atol=1e-6)


@pytest.mark.parametrize(
    "mode, min_q",
    [("verify", 2), ("all", 1), ("none", 1 << 30), (" ALL ", 1), ("", 2), ("folded", None)],
)
def test_the_fold_mode_is_read_or_refused(mode, min_q):
    """Kind: bad input taken silently. A misspelt SPLITRL_FLASH_FOLD ran the default fold under
    the name the bench user gave it; now the import says which values exist. Case and spaces do
    not matter, and an empty value means unset (a new user found ``ALL`` and ``''`` refused)."""
    res = run_python("from splitrl.rollout import kv; print(kv.FLASH_FOLD_MIN_Q)", SPLITRL_FLASH_FOLD=mode)
    if min_q is None:
        assert res.returncode != 0 and "SPLITRL_FLASH_FOLD='folded': use one of verify, all, none" in res.stderr
    else:
        assert res.returncode == 0, res.stderr
        assert int(res.stdout.split()[-1]) == min_q


_INTERPRETED = r"""
import torch
from splitrl.rollout import kv
from splitrl.rollout.kv import StaticKVCache
assert kv.DECODE_KERNEL == "triton"
torch.manual_seed(0)
worst, shifted = 0.0, 0.0
for Q, Hq, Hk in ((1, 4, 2), (2, 4, 2), (3, 4, 1), (3, 2, 2)):
    head = StaticKVCache(1, 5, Hk, 150, 16, torch.float32, "cpu", flash=False)
    pos = StaticKVCache(1, 5, Hk, 150, 16, torch.float32, "cpu", flash=False, position_major=True)
    head.k.normal_(); head.v.normal_()
    pos.k.copy_(head.k.transpose(2, 3)); pos.v.copy_(head.v.transpose(2, 3))
    pos.flash = True  # position-major, read by the kernel (interpreted)
    last = torch.tensor([2, 149, 70, 63])  # rows of 3 to 150 entries, across 64-entry blocks
    write = last[:, None] - (Q - 1) + torch.arange(Q)
    q = torch.randn(4, Q, Hq, 16)
    kq = torch.randn(4, Q, Hk, 16)
    outs = []
    for c in (head, pos):
        plan = c.plan(write, write, write, 150, causal=True)
        c.write(0, plan, kq, -kq)
        outs.append(c.attend(0, q, plan, 0.25))
    worst = max(worst, float((outs[0] - outs[1]).abs().max().nan_to_num(float("inf"))))
    plan = pos.plan(write + 1, write + 1, write + 1, 150, causal=True)  # one entry more each
    shifted = max(shifted, float((outs[0] - pos.attend(0, q, plan, 0.25)).abs().max()))
print(worst, shifted)
"""


def _run_interpreted(code: str) -> list[str]:
    return run_interpreted(code, SPLITRL_DECODE_ATTENTION="triton")


@pytest.mark.skipif(not decode_mod.AVAILABLE, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_the_triton_decode_kernel_reads_what_the_masked_path_reads():
    """The decode kernel (Q*G queries of a row and key/value head in one tile, online softmax over
    64-entry blocks), run by Triton's interpreter in fp32 on the CPU, against the masked SDPA path:
    ragged rows across block edges, Q = 1..3, G = 1, 2, 4. Guards: a query reading the entry after
    its own (the shifted plan must differ), heads grouped the wrong way, a block edge dropped."""
    worst, shifted = map(float, _run_interpreted(_INTERPRETED)[-2:])
    assert worst < 1e-5, worst
    assert shifted > 1e-3, shifted


@pytest.mark.parametrize("mode", ["flash", " FLASH ", "", "cuda"])
def test_the_decode_kernel_mode_is_read_or_refused(mode):
    """Kind: bad input taken silently. A misspelt SPLITRL_DECODE_ATTENTION must not measure the
    default under the name the bench user gave it; case, spaces and an empty value (unset) are
    not mistakes."""
    res = run_python("from splitrl.rollout import kv; print(kv.DECODE_KERNEL)", SPLITRL_DECODE_ATTENTION=mode)
    if mode == "cuda":
        assert res.returncode != 0 and "SPLITRL_DECODE_ATTENTION='cuda': use one of triton, flash" in res.stderr
    else:
        assert res.returncode == 0, res.stderr
        default = "triton" if decode_mod.AVAILABLE else "flash"
        assert res.stdout.split()[-1] == ("flash" if mode.strip() else default)


def test_few_long_rows_go_to_the_flash_call(monkeypatch):
    """With few (row, kv head) programs and long rows the flash call's split over the entries keeps
    more of the GPU busy: the Triton kernel is chosen only where ``decode_attention.preferred``
    says so (on the CPU, with the flash call emulated and the kernel replaced by a recorder)."""
    from splitrl.rollout import kv

    calls = []
    monkeypatch.setattr(kv, "flash_varlen", _varlen_reference)
    monkeypatch.setattr(kv, "DECODE_KERNEL", "triton")
    monkeypatch.setattr(decode_mod, "decode_attention", lambda q, *a: calls.append(q.shape[0]) or q.flatten(2))
    monkeypatch.setattr(decode_mod, "LONG_ROW", 16)
    monkeypatch.setattr(decode_mod, "FEW_PROGRAMS", 4 * HK)
    _, pos = _pair()
    pos.flash = True
    q = torch.zeros(4, 2, 4, 8, dtype=torch.float64)
    # short rows / few long rows / enough programs / a verify (2 queries a row)
    for B, L, Q in ((1, 16, 1), (1, 24, 1), (4, 24, 1), (1, 24, 2)):
        write = torch.arange(L - Q, L).expand(B, Q)
        pos.attend(0, q[:B, :Q], pos.plan(write, write, write, L, causal=True), 0.3)
    assert calls == [1, 4, 1]
    monkeypatch.undo()
    assert decode_mod.preferred(1, 8, 512) and not decode_mod.preferred(1, 8, 513)
    assert decode_mod.preferred(16, 8, 9000) and decode_mod.preferred(1, 8, 9000, queries=3)


@needs_flash
@pytest.mark.skipif(not decode_mod.AVAILABLE, reason="no Triton")
def test_the_triton_kernel_addresses_caches_past_two_billion_entries():
    """A cache layer of 300 slots x 8,200 entries x 8 heads x 128 has 2.5e9 elements: slot offsets
    past 2**31 overflowed int32 arithmetic (an illegal memory access at batch 256 x 8,192 in the
    bench) before the kernel computed them in int64."""
    S_big, M_big, Hk = 300, 8200, 8
    k = torch.zeros(S_big, M_big, Hk, D_HEAD, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    k[-1, :5].normal_()
    v[-1, :5].normal_()
    used = torch.full((S_big,), 5, dtype=torch.int32, device="cuda")
    q = torch.randn(S_big, 2, 2 * Hk, D_HEAD, dtype=torch.bfloat16, device="cuda")
    out = decode_mod.decode_attention(q, k, v, used, D_HEAD**-0.5)
    torch.cuda.synchronize()
    # the last slot: query i reads entries 0..3+i
    for i in range(2):
        kk = k[-1, : 4 + i].float().repeat_interleave(2, dim=1)
        vv = v[-1, : 4 + i].float().repeat_interleave(2, dim=1)
        w = (torch.einsum("hd,thd->ht", q[-1, i].float(), kk) * D_HEAD**-0.5).softmax(-1)
        ref = torch.einsum("ht,thd->hd", w, vv).reshape(-1)
        assert (out[-1, i].float() - ref).abs().max().item() < 2e-2
    del k, v
    torch.cuda.empty_cache()


_ENGINE_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, {helpers!r})
from _rollout_helpers import make_model, random_prompts
from splitrl.rollout import GenerationConfig, RolloutEngine, kv

model = make_model(vocab=64, depths=2)
prompts = random_prompts(5, 64, (1, 70), seed=3)  # rows across 64-entry blocks
seeds = list(range(5))
cfg = GenerationConfig(temperature=0.9, top_p=0.95, max_new_tokens=12, batch_size=3, stop_token_ids=[7])
torch.set_num_threads(1)

def run(spec):
    engine = RolloutEngine(model, cfg.model_copy(update={{"speculative": spec}}), "cpu")
    engine.speculative_switch_off = False
    return engine.generate(prompts, seeds)

masked = [run(False), run(True)]
# the backbone's cache becomes position-major and is read by the Triton kernel (interpreted)
kv.FLASH_DECODE = True
kv._flash_runs = lambda device, dtype, head_dim: True
# and the MTP depths' draft windows by its per-query limits
kv.query_kernel_default = lambda device, head_dim: True
assert kv.DECODE_KERNEL == "triton"
kernel = [run(False), run(True)]
tok = all(a.response_ids == b.response_ids for x, y in zip(masked, kernel) for a, b in zip(x, y))
spec = all(a.response_ids == b.response_ids for a, b in zip(*kernel))
lp = max(max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) for x, y in zip(masked, kernel) for a, b in zip(x, y))
# the same drafts: every sample accepts as many
drafts = [r.accepted_tokens for r in masked[1]] == [r.accepted_tokens for r in kernel[1]]
drafted = sum(r.drafted_tokens for r in kernel[1])
print(tok, spec, drafts and drafted > 20, lp)
"""


@pytest.mark.skipif(not decode_mod.AVAILABLE, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_the_engine_on_the_triton_kernel_emits_what_the_masked_path_emits():
    """The engine end to end (refills, a stop token, top-p, plain and speculative) with its
    backbone cache read by the Triton kernel and the MTP draft windows by its per-query limits,
    interpreted in fp32 on the CPU: the same tokens as the masked path and logprobs within fp32
    rounding, speculative == plain, and the same drafts (each sample's accepted count). Guards the
    integration (slot rows, seqused, the fused-QKV query strides, the head-major MTP cache read
    through strides), which the kernel's own tests do not reach."""
    import os

    helpers = os.path.dirname(os.path.abspath(__file__))
    out = _run_interpreted(_ENGINE_INTERPRETED.format(helpers=helpers))
    tokens, spec, drafts, worst = out[-4:]
    assert tokens == "True" and spec == "True" and drafts == "True", out
    assert float(worst) < 1e-4, worst


def test_a_failing_triton_kernel_falls_back_to_the_flash_call(monkeypatch, caplog):
    """Kind: a GPU or shape Triton cannot compile for (e.g. shared memory). Outside a capture the
    step is served by the flash call, and every later one, with a warning that names the error and
    the setting; the output is the flash call's (emulated here on the CPU)."""
    from splitrl.rollout import kv

    def broken(*args):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(kv, "flash_varlen", _varlen_reference)
    monkeypatch.setattr(kv, "DECODE_KERNEL", "triton")
    monkeypatch.setattr(decode_mod, "decode_attention", broken)
    _, pos = _pair()
    pos.flash = True
    write = torch.tensor([[20, 21, 22]])
    q = torch.randn(1, 3, 4, 8, dtype=torch.float64)
    plan = pos.plan(write, write, write, 24, causal=True)
    with caplog.at_level("WARNING", logger="splitrl.rollout.kv"):
        out = pos.attend(0, q, plan, 0.3)
    assert kv.DECODE_KERNEL == "flash"
    assert "out of resources" in caplog.text and "SPLITRL_DECODE_ATTENTION=flash" in caplog.text
    monkeypatch.setattr(kv, "DECODE_KERNEL", "flash")
    assert torch.equal(out, pos.attend(0, q, plan, 0.3))


def _draft_window_plan(L: int, scratch: int):
    """(write, limit) [B, 4] of draft windows like the drafter's (three consecutive entries from
    p0, the later ones invalid in some rows, written at ``scratch``) plus a query two positions on
    whose limit leaves a gap before its own entry (depth 3's shape); in the first row the query's
    limit is negative (depth k's query of a prompt shorter than k - 1: it reads its own entry
    alone). The plan's positions are the write indices, as in the drafter."""
    p0 = torch.tensor([10, 63, 64, 120, 150], device="cuda")  # across 64-entry block edges
    accepted = torch.tensor([2, 0, 1, 2, 0], device="cuda")
    i = torch.arange(3, device="cuda")
    pos = p0[:, None] + i
    write = torch.where(i <= accepted[:, None], pos, scratch)
    query = (p0 + accepted + 2)[:, None]
    write = torch.cat([write, query], 1)
    limit = torch.cat([pos, query - 2], 1)
    limit[0, 3] = -1
    assert int(write[write != scratch].max()) < L < scratch
    return write, limit


@pytest.mark.skipif(not (torch.cuda.is_available() and decode_mod.AVAILABLE), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("position_major", [False, True])
def test_the_per_query_kernel_reads_what_the_masked_path_reads(monkeypatch, dtype, position_major):
    """The MTP draft windows (each query reads the entries up to its limit plus its own, not a causal
    block) through the Triton kernel's per-query limits against the masked SDPA path, on both cache
    layouts: the same output up to rounding (fp32: 1e-5). Guards: a plan without the query's own
    entry past the gap differs, so the own-entry rule is tested, not just the limits."""
    monkeypatch.setattr(kv_mod, "DECODE_KERNEL", "triton")
    torch.manual_seed(0)
    Mx, L = 200, 160
    kern = StaticKVCache(
        1, S, HK, Mx, D_HEAD, dtype, "cuda", flash=False, position_major=position_major, query_kernel=True
    )
    masked = StaticKVCache(1, S, HK, Mx, D_HEAD, dtype, "cuda", flash=False, position_major=position_major)
    kern.kv.normal_()
    masked.kv.copy_(kern.kv)
    write, limit = _draft_window_plan(L, kern.scratch)
    q = torch.randn(write.shape[0], write.shape[1], H, D_HEAD, dtype=dtype, device="cuda")
    plan_k = kern.plan(write, write, limit, L)
    plan_m = masked.plan(write, write, limit, L)
    assert plan_k.limits is not None and plan_k.mask is None and plan_m.mask is not None
    scale = D_HEAD**-0.5
    out_k = kern.attend(0, q, plan_k, scale).float()
    out_m = masked.attend(0, q, plan_m, scale).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out_k - out_m).abs().max().item() < tol
    # without its own entry (-1: as if outside the read), the gapped query reads something else
    no_own = kern.plan(write, torch.full_like(write, Mx), limit, L)
    off = kern.attend(0, q, no_own, scale).float()
    assert (off[:, 3] - out_m[:, 3]).abs().max().item() > 1e-3
    assert (off[:, :3] - out_m[:, :3]).abs().max().item() < tol  # the window entries read up to themselves


@pytest.mark.skipif(not (torch.cuda.is_available() and decode_mod.AVAILABLE), reason="needs CUDA and Triton")
def test_the_engine_drafts_the_same_with_the_per_query_kernel(monkeypatch):
    """Speculative decoding in fp32 on CUDA with the MTP depths' attention on the Triton kernel
    (per-query limits) and on the masked path: the same tokens (always: the drafts never change
    them) and the same drafts, seen as the same accepted count of every sample."""
    from _rollout_helpers import make_model, random_prompts

    from splitrl.rollout import GenerationConfig, RolloutEngine

    monkeypatch.setattr(kv_mod, "DECODE_KERNEL", "triton")  # whatever SPLITRL_DECODE_ATTENTION says
    model = make_model(vocab=64, depths=2, seed=3).to("cuda")
    cfg = GenerationConfig(speculative=True, temperature=0.9, max_new_tokens=40, stop_token_ids=[1], batch_size=4)
    prompts = random_prompts(7, 64, (1, 90), seed=5)  # MTP rows across 64-entry blocks

    def run(query_kernel: bool):
        monkeypatch.setattr(kv_mod, "query_kernel_default", lambda device, head_dim: query_kernel)
        engine = RolloutEngine(model, cfg, "cuda")
        engine.speculative_switch_off = False
        out = engine.generate(prompts, list(range(7)))
        assert engine.runner.mtp_cache.query_kernel is query_kernel
        return out

    kernel, masked = run(True), run(False)
    assert [r.response_ids for r in kernel] == [r.response_ids for r in masked]
    assert sum(r.drafted_tokens for r in kernel) > 50
    assert [r.accepted_tokens for r in kernel] == [r.accepted_tokens for r in masked]


_INTERPRETED_PER_QUERY = r"""
import torch
from splitrl.rollout import kv
from splitrl.rollout.kv import StaticKVCache
assert kv.DECODE_KERNEL == "triton"
torch.manual_seed(0)
worst, no_own = 0.0, float('inf')
for position_major in (False, True):
    caches = [StaticKVCache(1, 6, 2, 200, 16, torch.float32, "cpu", flash=False, position_major=position_major,
                            query_kernel=kernel) for kernel in (True, False)]
    caches[0].kv.normal_()
    caches[1].kv.copy_(caches[0].kv)
    p0, accepted, i = torch.tensor([10, 63, 64, 120, 150]), torch.tensor([2, 0, 1, 2, 0]), torch.arange(3)
    pos = p0[:, None] + i
    write = torch.where(i <= accepted[:, None], pos, 199)
    query = (p0 + accepted + 2)[:, None]
    write, limit = torch.cat([write, query], 1), torch.cat([pos, query - 2], 1)
    limit[0, 3] = -1  # reads its own entry alone
    q = torch.randn(5, 4, 4, 16)
    plans = [c.plan(write, write, limit, 160) for c in caches]
    assert plans[0].limits is not None and plans[1].mask is not None
    out = [c.attend(0, q, p, 0.25) for c, p in zip(caches, plans)]
    worst = max(worst, float((out[0] - out[1]).abs().max().nan_to_num(float("inf"))))
    off = caches[0].attend(0, q, caches[0].plan(write, torch.full_like(write, 200), limit, 160), 0.25)
    no_own = min(no_own, float((off[:, 3] - out[1][:, 3]).abs().amax(-1).min().nan_to_num(0.0)))
print(worst, no_own)
"""


@pytest.mark.skipif(not decode_mod.AVAILABLE, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_the_per_query_kernel_interpreted_reads_what_the_masked_path_reads():
    """The kernel's per-query limits (the MTP draft windows: invalid entries written at scratch, a
    query whose limit leaves a gap before its own entry, one whose limit is negative) run by
    Triton's interpreter in fp32 against the masked SDPA path, on both cache layouts. Guard: the
    gapped queries without their own entry read something else (in every row)."""
    worst, no_own = map(float, _run_interpreted(_INTERPRETED_PER_QUERY)[-2:])
    assert worst < 1e-5, worst
    assert no_own > 1e-3, no_own


_INTERPRETED_ORDER = r"""
import torch
from splitrl.rollout import decode_attention as da
torch.manual_seed(0)
k, v = torch.randn(5, 150, 2, 16), torch.randn(5, 150, 2, 16)
used = torch.tensor([1, 64, 65, 150, 100], dtype=torch.int32)
diff, heads = 0.0, 0.0
for Q, H in ((1, 4), (3, 2)):
    q = torch.randn(5, Q, H, 16)
    da.HEADS_FIRST_PROGRAMS = 1 << 30
    rows_first = da.decode_attention(q, k, v, used, 0.25)
    da.HEADS_FIRST_PROGRAMS = 1
    heads_first = da.decode_attention(q, k, v, used, 0.25)
    diff = max(diff, float((rows_first - heads_first).abs().max().nan_to_num(float("inf"))))
    # guard: the two kv heads' outputs differ, so a program writing the other head's rows would show
    heads = max(heads, float((heads_first[..., : H // 2 * 16] - heads_first[..., H // 2 * 16 :]).abs().max()))
print(diff, heads)
"""


@pytest.mark.skipif(not decode_mod.AVAILABLE, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_the_decode_kernel_launch_order_does_not_change_its_output():
    """``HEADS_FIRST_PROGRAMS``: the programs launched with a row's kv heads consecutive give the
    output of the (row, kv head) order bit for bit (each program's work is the same), run by Triton's
    interpreter: rows of 1..150 entries, Q = 1 and 3."""
    diff, heads = map(float, _run_interpreted(_INTERPRETED_ORDER)[-2:])
    assert diff == 0.0, diff
    assert heads > 1e-3, heads


def test_the_decode_kernel_launch_order_rule():
    """``heads_first``: a row's kv heads consecutive from HEADS_FIRST_PROGRAMS programs, over a
    position-major cache only, and never with more rows than the grid's second dimension takes."""
    P = decode_mod.HEADS_FIRST_PROGRAMS
    assert decode_mod.heads_first(P // 8, 8, True)
    assert not decode_mod.heads_first(P // 8 - 1, 8, True)
    assert not decode_mod.heads_first(P // 8, 8, False)  # the head-major MTP cache
    assert not decode_mod.heads_first(70_000, 8, True)  # CUDA's 65,535 limit of the grid's y


@pytest.mark.skipif(not decode_mod.AVAILABLE, reason="needs Triton (the launcher's code runs, the kernel is recorded)")
def test_the_launcher_takes_the_order_the_rule_gives(monkeypatch):
    """The grid and the kernel's HEADS_FIRST as ``heads_first`` says, around the threshold and on a
    head-major cache read through its strides (the kernel itself replaced by a recorder)."""
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, kw["HEADS_FIRST"]))

    monkeypatch.setattr(decode_mod, "_decode_attention_kernel", Recorder())
    rows = decode_mod.HEADS_FIRST_PROGRAMS // 8
    for B, position_major in ((rows - 1, True), (rows, True), (rows, False)):
        q = torch.zeros(B, 1, 16, 128)
        shape = (B, 4, 8, 128) if position_major else (B, 8, 4, 128)
        k = torch.zeros(shape) if position_major else torch.zeros(shape).transpose(1, 2)
        decode_mod.decode_attention(q, k, k, torch.ones(B, dtype=torch.int32), 0.1)
    assert seen == [((rows - 1, 8), False), ((8, rows), True), ((rows, 8), False)]


@pytest.mark.skipif(not (torch.cuda.is_available() and decode_mod.AVAILABLE), reason="needs CUDA and Triton")
@pytest.mark.parametrize("Q", [1, 3])
def test_the_decode_kernel_launch_order_does_not_change_its_output_on_the_gpu(monkeypatch, Q):
    """The same on the GPU in bf16 in a position-major cache, 6 rows x 2 kv heads: both launch
    orders give the same output bit for bit, and it matches the fp32 reference."""
    flash, _ = _caches()
    rows = 6
    last = torch.tensor([3, 63, 64, 200, 129, 318], device="cuda")
    q = torch.randn(rows, Q, H, D_HEAD, device="cuda", dtype=torch.bfloat16)
    used = (last + 1).to(torch.int32)
    outs = []
    for threshold in (1 << 30, 1):
        monkeypatch.setattr(decode_mod, "HEADS_FIRST_PROGRAMS", threshold)
        outs.append(decode_mod.decode_attention(q, flash.k[1], flash.v[1], used, D_HEAD**-0.5))
    assert torch.equal(outs[0], outs[1])
    ref = _reference(flash, 1, q, last, D_HEAD**-0.5)
    assert (outs[1].float() - ref).abs().max().item() < 2e-2


def test_a_failing_per_query_kernel_falls_back_to_the_masked_path(monkeypatch, caplog):
    """Kind: a GPU or shape Triton cannot compile for, on the MTP draft windows. Outside a capture
    the forward is served by the masked path, its mask built from the plan's rule (the same output
    as a cache without the kernel), with the warning; later plans are masked plans from the start.
    CPU: the kernel is replaced by one that raises."""

    def broken(*args):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(kv_mod, "DECODE_KERNEL", "triton")
    monkeypatch.setattr(decode_mod, "decode_attention", broken)
    torch.manual_seed(0)
    kern = StaticKVCache(1, 5, 2, 40, 8, torch.float64, "cpu", flash=False, query_kernel=True)
    masked = StaticKVCache(1, 5, 2, 40, 8, torch.float64, "cpu", flash=False)
    kern.kv.normal_()
    masked.kv.copy_(kern.kv)
    write = torch.tensor([[3, 4, 39, 6], [20, 21, 22, 23]])  # an invalid entry at scratch, a gapped query
    limit = torch.tensor([[3, 4, 5, 4], [20, 21, 22, 21]])
    q = torch.randn(2, 4, 4, 8, dtype=torch.float64)
    plan = kern.plan(write, write, limit, 32)
    assert plan.limits is not None and plan.mask is None
    with caplog.at_level("WARNING", logger="splitrl.rollout.kv"):
        out = kern.attend(0, q, plan, 0.3)
    assert "masked SDPA path for the MTP" in caplog.text
    torch.testing.assert_close(out, masked.attend(0, q, masked.plan(write, write, limit, 32), 0.3), atol=1e-12, rtol=0)
    assert kv_mod.DECODE_KERNEL == "flash" and kern.plan(write, write, limit, 32).limits is None


def test_the_decode_kernel_takes_a_third_stage_only_for_few_programs_and_enough_shared_memory():
    """The tile rule measured on an H200 (decode_attention.tiles): 3 stages of 64 entries (96 KiB
    of K/V tiles at d = 128) for few programs on devices that give a block >= 128 KiB; 2 stages
    for many programs or sm86 / sm89-sized budgets; wide heads 32 entries, one stage."""
    h200 = 227 * 1024
    assert decode_mod.tiles(128, 8, h200) == (64, 3, 4)  # batch 1, 8 kv heads
    assert decode_mod.tiles(128, decode_mod.STAGES_3_PROGRAMS, h200) == (64, 3, 4)
    assert decode_mod.tiles(128, decode_mod.STAGES_3_PROGRAMS + 1, h200) == (64, 2, 4)
    assert decode_mod.tiles(128, 8, 99 * 1024) == (64, 2, 4)  # sm86 / sm89
    assert decode_mod.tiles(64, 8, 0) == (64, 2, 4)
    assert decode_mod.tiles(256, 8, h200) == (32, 1, 4)


@pytest.mark.parametrize("slots", [[0, 2, 5], [1, 4, 6, 6]])
def test_a_prefill_plan_writes_and_reads_what_write_prefix_and_causal_attention_do(monkeypatch, slots):
    """The CUDA prefill's cache path (``StaticKVCache.prefill_plan`` / ``attend_prefill``: the rotary
    kernel writes keys and values at the plan's rows, the flash kernel reads them in place), on the
    CPU with the kernel's semantics in its place: writing at ``flat_index`` fills the entries
    ``write_prefix`` fills, and the attention equals ``causal_attention`` over the projections' own
    keys and values (grouped heads, no repeat). The second case pads with the last slot twice, as a
    padded refill does (its rows write the same values). Guards: a plan offset by a slot or a head,
    a sequence reading another slot's entries or past the prompt."""
    from splitrl.rollout import kv

    monkeypatch.setattr(kv, "flash_varlen", _varlen_reference)
    g = torch.Generator().manual_seed(3)
    n, P, Hq, d = len(slots), 9, 4, 8
    cache = StaticKVCache(2, 7, HK, 40, d, torch.float64, "cpu", flash=False, position_major=True)
    ref = StaticKVCache(2, 7, HK, 40, d, torch.float64, "cpu", flash=False, position_major=True)
    k = torch.randn(n, P, HK, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, P, HK, d, generator=g, dtype=torch.float64)
    if slots[-1] == slots[-2]:  # padded rows repeat their inputs
        k[-1], v[-1] = k[-2], v[-2]
    q = torch.randn(n, P, Hq, d, generator=g, dtype=torch.float64)
    sl = torch.tensor(slots)
    plan = cache.prefill_plan(sl, P)
    assert plan.flat_index.shape == (n * P * HK,)
    cache.kv[0, 1].view(-1, d)[plan.flat_index] = k.reshape(-1, d)  # what the rotary kernel writes
    cache.kv[1, 1].view(-1, d)[plan.flat_index] = v.reshape(-1, d)
    ref.write_prefix(1, sl, k, v)
    assert torch.equal(cache.kv, ref.kv)
    out = cache.attend_prefill(1, q, plan, 0.3)
    torch.testing.assert_close(out, kv.causal_attention(q, k, v, 0.3), rtol=1e-12, atol=1e-12)


_PREFILL_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, {helpers!r})
from _rollout_helpers import make_model
from test_flash_decode import _varlen_reference
from splitrl.rollout import forward, kv
from splitrl.rollout.forward import DecoderForward
from splitrl.rollout.kv import StaticKVCache

torch.set_num_threads(1)
kv.flash_varlen = _varlen_reference  # the flash kernel's semantics (no CPU build)
for family in ("qwen3", "qwen2", "llama"):
    model = make_model(vocab=40, depths=1, hidden_size=64, intermediate_size=64, family=family, seed=2)
    fwd = DecoderForward(model)
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    fwd.sync_rope_table(48)
    old, new = (StaticKVCache(c.num_hidden_layers, 8, c.num_key_value_heads, 48, d, torch.float32, "cpu",
                              flash=False, position_major=True) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    old.kv.normal_(generator=g)
    new.kv.copy_(old.kv)
    lens, slots = [5, 9, 3, 5, 5], torch.tensor([1, 3, 4, 7, 7])  # two padded rows on the last slot
    ids = torch.randint(0, 40, (5, 12), generator=g)
    ids[3:] = ids[0]  # a padded refill repeats its first row
    ref = fwd.backbone_prefill(ids, slots, old)  # the torch path: prefix writes, SDPA
    # the CUDA path on the CPU: the rotary kernel (interpreted) and the flash semantics over the cache
    fwd._prefill_plan = lambda h, s, cache: cache.prefill_plan(s, h.shape[1])
    out = fwd.backbone_prefill(ids, slots, new, slots_ascending=True)
    hidden = max(float((out[i, :n] - ref[i, :n]).abs().max()) for i, n in enumerate(lens))
    print(family, hidden, float((old.kv - new.kv).abs().max()))
"""


def test_the_cuda_prefill_path_interpreted_equals_the_torch_path():
    """A backbone prefill on the CUDA path (q/k norms, rotary and the cache write in the rotary
    kernel, interpreted; the flash kernel's semantics over the cache, in place) against the torch
    path, fp32 on the CPU, for Qwen3 (q/k norms), Qwen2 (biases) and Llama: ragged prompts right-padded
    to 12, slots out of the first rows, two padded rows on the last slot: the hidden states of the
    real tokens and every cache entry agree within fp32 rounding. Guards the rotary kernel's cos/sin
    strides over the prompt positions and the plan's rows (the CUDA tests run the compiled kernels)."""
    import os

    helpers = os.path.dirname(os.path.abspath(__file__))
    out = _run_interpreted(_PREFILL_INTERPRETED.format(helpers=helpers))
    assert [out[i] for i in (-9, -6, -3)] == ["qwen3", "qwen2", "llama"], out
    for i in (-8, -7, -5, -4, -2, -1):
        assert float(out[i]) < 1e-4, out
