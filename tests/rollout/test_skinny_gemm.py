"""The skinny-product kernel of the decode step's linear layers (splitrl.rollout.skinny_gemm):
its tile plan (CPU), the dispatch of splitrl.rollout.forward.linear, and the kernel's products
against an fp32 reference (Triton's interpreter on the CPU where it runs; CUDA in bf16)."""

import math

import pytest
import torch
from _rollout_helpers import run_interpreted

from splitrl.rollout import forward as forward_mod
from splitrl.rollout import skinny_gemm as sg

needs_cuda_triton = pytest.mark.skipif(not (torch.cuda.is_available() and sg.AVAILABLE), reason="needs CUDA and Triton")
# the Qwen3-0.6B decode projections (N, K): q/k/v fused, o, gate/up fused, down
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]


@pytest.mark.parametrize("M", [1, 3, 16, 17, 32, 33, 64, 65, 96, 256])
@pytest.mark.parametrize("N,K", SHAPES + [(48, 96), (100, 1000)])
def test_the_plan_covers_every_row_and_feature_once(M, N, K):
    block_m, block_n, block_k, split, warps = sg.plan(M, N, K)
    # one tile of rows up to 64 (a power of two, >= 16, < 2M), tiles of 64 rows above
    if M <= 64:
        assert block_m >= max(16, M) and block_m & (block_m - 1) == 0 and block_m < 2 * max(16, M)
    else:
        assert block_m == 64
    assert block_n in (16, 32) and block_k in (128, 256) and warps == 4
    assert split in (1, 2, 4, 8)
    # each split is a whole number of BLOCK_K tiles, and together they cover K exactly
    assert split == 1 or K % (split * block_k) == 0
    programs = math.ceil(N / block_n) * split * math.ceil(M / block_m)
    # the plan raises the programs to the chip's multiprocessors where K allows another split
    assert programs >= sg.SMS_TO_FILL or split == 8 or K % (2 * split * block_k) != 0
    gm, gn, gk, gw, gs = sg.gated_plan(M, N // 2, K)
    assert gm == block_m and gn in (16, 32) and gk == 128 and gw == 4 and gs == sg.STAGES
    # Hopper, from GATED_WIDE_ROWS rows: 64-row tiles (warpgroup MMA), 32 features, 5 stages
    wide = sg.gated_plan(M, N // 2, K, warpgroup=True)
    assert wide == ((64, 32, 128, 4, 5) if M >= sg.GATED_WIDE_ROWS else (gm, gn, gk, gw, gs))


def test_the_gated_kernel_takes_the_wide_tiles_for_16_bit_rows_on_sm90_only(monkeypatch):
    """fp32 stages of the wide tiles would need 320 KiB (found in review); a bench's
    SPLITRL_GATED_TILES trial keeps the old plan's BLOCK_M (its tiles were sized for it)."""
    from types import SimpleNamespace

    def cuda_rows(dtype):  # what gated_tiles reads of a CUDA x
        return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), element_size=dtype.itemsize.__int__)

    monkeypatch.setattr(sg, "_warpgroup", lambda device: True)
    wide = (64, 32, 128, 4, 5)
    assert sg.gated_tiles(cuda_rows(torch.bfloat16), 32, 3072, 1024) == wide
    assert sg.gated_tiles(cuda_rows(torch.float16), 16, 3072, 1024) == wide
    assert sg.gated_tiles(cuda_rows(torch.bfloat16), 8, 3072, 1024) == sg.gated_plan(8, 3072, 1024)
    assert sg.gated_tiles(cuda_rows(torch.float32), 32, 3072, 1024) == sg.gated_plan(32, 3072, 1024)  # fp32
    assert sg.gated_tiles(torch.zeros(1, dtype=torch.bfloat16), 32, 3072, 1024) == sg.gated_plan(32, 3072, 1024)  # CPU
    monkeypatch.setattr(sg, "_GATED_TILES", (32, 128, 4, 5))
    assert sg.gated_tiles(cuda_rows(torch.bfloat16), 32, 3072, 1024) == (32, 32, 128, 4, 5)
    monkeypatch.setattr(sg, "_warpgroup", lambda device: False)
    monkeypatch.setattr(sg, "_GATED_TILES", ())
    assert sg.gated_tiles(cuda_rows(torch.bfloat16), 32, 3072, 1024) == sg.gated_plan(32, 3072, 1024)

def test_the_wide_gated_tiles_need_an_sm90_device_with_their_shared_memory(monkeypatch):
    """Only sm90 parts with room for the wide tiles' 160 KiB of stages take them; CPUs never."""
    from splitrl.rollout import cuda_props

    assert not sg.warpgroup_device(torch.device("cpu"))

    class Props:
        def __init__(self, major, optin):
            self.major, self.shared_memory_per_block_optin = major, optin

    if not torch.cuda.is_available():  # no CUDA: False, no error
        assert not sg.warpgroup_device("cuda:0") and not sg.warpgroup_device(0)
        assert not sg.warpgroup_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for major, optin, want in ((9, 227 * 1024, True), (8, 163 * 1024, False), (8, 99 * 1024, False),
                               (10, 227 * 1024, False), (9, 160 * 1024, False)):  # fmt: skip
        monkeypatch.setattr(cuda_props, "_PROPS", {})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, p=Props(major, optin): p)
        assert sg.warpgroup_device(torch.device("cuda", 0)) is want, (major, optin)
        assert sg.warpgroup_device("cuda:0") is want and sg.warpgroup_device(0) is want
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        assert sg.warpgroup_device(torch.device("cuda")) is want  # no index: the current device's


def test_linear_is_torch_linear_off_cuda_and_for_many_rows():
    torch.manual_seed(0)
    w, b = torch.randn(24, 16), torch.randn(24)
    for x in (torch.randn(2, 3, 16), torch.randn(70, 16)):
        assert torch.equal(forward_mod.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    lin = torch.nn.Linear(16, 24)
    x = torch.randn(5, 16)
    assert torch.equal(forward_mod._module_linear(lin, x), lin(x))


@pytest.mark.skipif(sg.AVAILABLE, reason="Triton is installed: the kernel runs")
def test_skinny_linear_without_triton_says_so():
    with pytest.raises(ValueError, match="needs Triton"):
        sg.skinny_linear(torch.randn(1, 8), torch.randn(8, 8))


_INTERPRETED = r"""
import torch
from splitrl.rollout import skinny_gemm as sg
torch.manual_seed(0)
worst = 0.0
for M, N, K, bias in [(1, 64, 512, False), (3, 48, 256, True), (20, 40, 1024, False), (64, 16, 512, True),
                      (5, 33, 300, True), (70, 24, 256, True)]:
    x, w = torch.randn(M, K), torch.randn(N, K)
    b = torch.randn(N) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    for split in (1, 2, 4):
        y = sg.skinny_linear(x, w, b, config=(min(64, max(16, sg.triton_next_power_of_2(M))), 16, 128, split, 4))
        assert y.shape == (M, N) and y.dtype == x.dtype
        worst = max(worst, float(((y.double() - ref).norm() / ref.norm()).nan_to_num(float("inf"))))
print(worst)
"""


@pytest.mark.skipif(not sg.AVAILABLE, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_the_kernel_under_the_interpreter_is_the_fp32_product():
    """fp32 on the CPU: K not a multiple of the tile (masked tail), split K, bias, 1..64 rows and
    70 (two tiles of rows, the second masked)."""
    assert float(run_interpreted(_INTERPRETED)[-1]) < 1e-6


_INTERPRETED_EPILOGUE = r"""
import torch
from splitrl.rollout import fused, skinny_gemm as sg
torch.manual_seed(0)
worst, no_residual = 0.0, 0.0
for M, N, K, bias in [(1, 64, 512, False), (3, 48, 256, True), (20, 40, 1024, False), (64, 100, 512, True)]:
    r, nw = torch.randn(M, N), 1 + 0.2 * torch.randn(N)
    b = torch.randn(N) if bias else None
    x, w = torch.randn(M, K), torch.randn(N, K) / K**0.5
    y = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    ref_h, ref_n = fused.add_rms_norm(y, r.double(), nw.double(), 1e-6)
    for split in (2, 4):
        cfg = (max(16, sg.triton_next_power_of_2(M)), 16, 128, split, 4)
        h, n = sg.skinny_linear_add_rms_norm(x, w, r, nw, 1e-6, b, config=cfg)
        assert h.shape == n.shape == (M, N) and h.dtype == n.dtype == x.dtype
        worst = max(worst, float((h.double() - ref_h).abs().max().nan_to_num(float("inf"))), float((n.double() - ref_n).abs().max().nan_to_num(float("inf"))))
        no_residual = max(no_residual, float((h.double() - y).abs().max()))  # the residual was added
print(worst, no_residual)
"""


@pytest.mark.skipif(not sg.AVAILABLE, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_the_add_norm_epilogue_under_the_interpreter():
    """fp32 on the CPU: the split partials summed, the residual added and the row normalized:
    (h, norm(h)) of the torch ops in fp64, 1..64 rows, split 2 and 4, bias, N not a power of two
    (masked lanes of the norm)."""
    worst, no_residual = map(float, run_interpreted(_INTERPRETED_EPILOGUE)[-2:])
    assert worst < 1e-5, worst
    assert no_residual > 1e-2, no_residual


def test_the_epilogue_refuses_what_it_does_not_serve_before_any_launch():
    """Checked before Triton is needed: these run on CPU installs too."""
    x, w = torch.randn(2, 256), torch.randn(16, 256)
    r, nw = torch.randn(2, 16), torch.ones(16)
    with pytest.raises(ValueError, match="does not split"):
        sg.skinny_linear_add_rms_norm(x, w, r, nw, 1e-6, config=(16, 16, 128, 1, 4))
    with pytest.raises(ValueError, match="residual must be"):
        sg.skinny_linear_add_rms_norm(x, w, r[:, :8], nw, 1e-6, config=(16, 16, 128, 2, 4))
    with pytest.raises(ValueError, match="norm_weight must be"):
        sg.skinny_linear_add_rms_norm(x, w, r, nw[:8], 1e-6, config=(16, 16, 128, 2, 4))
    with pytest.raises(ValueError, match="rows of x"):
        sg.skinny_linear_add_rms_norm(
            torch.randn(257, 256), w, torch.randn(257, 16), nw, 1e-6, config=(16, 16, 128, 2, 4)
        )
    with pytest.raises(ValueError, match=r"the config \(16, 16, 128, 1, 4\) does not split"):  # not plan()'s
        sg.skinny_linear_add_rms_norm(x, w, r, nw, 1e-6, config=(16, 16, 128, 1, 4))
    with pytest.raises(ValueError, match=r"strides \(1, 2\)"):  # the layout that was wrong is shown
        sg.skinny_linear_add_rms_norm(x, w, torch.randn(16, 2).t(), nw, 1e-6, config=(16, 16, 128, 2, 4))
    for eps in (-1.0, float("nan"), "1e-6", None):
        with pytest.raises(ValueError, match="eps must be a finite number"):
            sg.skinny_linear_add_rms_norm(x, w, r, nw, eps, config=(16, 16, 128, 2, 4))
    with pytest.raises(ValueError, match="bias must be a contiguous"):  # was read past its end
        sg.skinny_linear_add_rms_norm(x, w, r, nw, 1e-6, torch.randn(4), config=(16, 16, 128, 2, 4))
    if not sg.AVAILABLE:
        with pytest.raises(ValueError, match="needs Triton"):
            sg.skinny_linear_add_rms_norm(x, w, r, nw, 1e-6, config=(16, 16, 128, 2, 4))


def test_the_products_refuse_a_bad_bias_weight_or_device_before_any_launch(monkeypatch):
    """A bias of another length was read past its end (a new user's trial: garbage in the last
    columns under the interpreter); a 1-D weight, K = 0 or integer x reached Python or Triton
    internals; CPU tensors outside the interpreter failed inside Triton's driver."""
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    for bias in (torch.randn(24), torch.randn(40), torch.randn(1, 32), torch.randn(64)[::2], torch.ones(32).int()):
        with pytest.raises(ValueError, match="bias must be a contiguous"):
            sg.skinny_linear(x, w, bias)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        sg.skinny_linear_silu_mul(x, w, torch.randn(16))
    for cfg in ((1, 2, 3), (16, 16, 64, 0, 4), (16, 16, 100, 1, 4), (16.0, 16, 64, 1, 4), (16, 16, 64, 1, 4, 3, 1)):
        with pytest.raises(ValueError, match="config is"):  # were unpack, ZeroDivision or Triton errors
            sg.skinny_linear(x, w, config=cfg)
    with pytest.raises(ValueError, match=r"config is \(BLOCK_M, BLOCK_N, BLOCK_K, num_warps"):
        sg.skinny_linear_silu_mul(x, w, config=(16, 16, 64, 1, 4, 3))
    for xx, ww in ((x, torch.randn(64)), (torch.randn(2, 0), torch.randn(32, 0)), (x.int(), w.int())):
        with pytest.raises(ValueError, match="rows of x"):
            sg.skinny_linear(xx, ww)
    if sg.AVAILABLE:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        for fn in (sg.skinny_linear, sg.skinny_linear_silu_mul):
            with pytest.raises(ValueError, match="runs on CUDA tensors"):
                fn(x, w)


@needs_cuda_triton
@pytest.mark.parametrize("M", [1, 3, 8, 32, 64, 96, 256])
@pytest.mark.parametrize("N,K", SHAPES)
def test_bf16_products_match_fp32_as_closely_as_cublas(M, N, K):
    torch.manual_seed(M * 7 + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    err = {}
    for name, fn in (("ours", sg.skinny_linear), ("cublas", torch.nn.functional.linear)):
        y = fn(x, w, b)
        assert y.shape == (M, N) and y.dtype == torch.bfloat16
        err[name] = float((y.float() - ref).norm() / ref.norm())
    # both round one fp32 sum to bf16 (relative rounding 2^-9): errors near 1e-3, never far apart
    assert err["ours"] < 4e-3 and err["ours"] < 2 * err["cublas"] + 1e-3, err


def _deterministic_row_independent_and_the_same_in_a_graph(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x), after checking that a second call gives the same bits, that row 0's result does not
    depend on the other rows' values, and that a captured CUDA graph replays the same result."""
    y = fn(x)
    assert torch.equal(y, fn(x))
    other = x.clone()
    other[1:] = torch.randn_like(x[1:])
    assert torch.equal(fn(other)[0], y[0])  # row 0 does not see rows 1..
    out = torch.empty_like(y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fn(x))
    out.zero_()
    graph.replay()
    assert torch.equal(out, y)
    return y


@needs_cuda_triton
def test_rows_are_independent_deterministic_and_the_same_in_a_graph():
    torch.manual_seed(0)
    N, K = 1024, 3072  # split along K: the partial sums' order must be fixed
    assert sg.plan(8, N, K)[3] > 1
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    y = _deterministic_row_independent_and_the_same_in_a_graph(lambda t: sg.skinny_linear(t, w), x)
    # a strided row layout (a view of a wider tensor) reads the right elements
    wide = torch.randn(8, 2 * K, device="cuda", dtype=torch.bfloat16)
    wide[:, :K] = x
    assert torch.equal(sg.skinny_linear(wide[:, :K], w), y)
    with pytest.raises(ValueError, match="rows"):
        sg.skinny_linear(torch.randn(sg.MAX_ROWS + 1, K, device="cuda", dtype=torch.bfloat16), w)


def test_the_decode_forward_takes_the_kernel_only_for_the_narrow_products():
    """The H200 measurement behind sg.preferred: the kernel wins where it splits K (o_proj,
    down_proj of the 0.6B shape) and loses on the wide products (q/k/v, gate/up), at any M <= 64."""
    for M in (1, 3, 8, 32, 64):
        assert sg.preferred(M, 1024, 2048) and sg.preferred(M, 1024, 3072)  # o, down
        assert not sg.preferred(M, 4096, 1024) and not sg.preferred(M, 6144, 1024)  # qkv, gate/up
    assert not sg.preferred(65, 1024, 2048)


@needs_cuda_triton
@pytest.mark.parametrize("M", [1, 3, 32, 64, 96, 128])  # 256 rows: plan() does not split these
@pytest.mark.parametrize("N,K", [(1024, 2048), (1024, 3072)])  # o_proj, down_proj of the 0.6B shape
def test_bf16_epilogue_matches_fp32_as_closely_as_the_torch_path(M, N, K):
    """The fused product + add + norm against the torch path it replaces (the product, then
    add_rms_norm in bf16), both against fp32: as close, and deterministic."""
    from splitrl.rollout import fused

    torch.manual_seed(M + K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    nw = (1 + 0.2 * torch.randn(N, device="cuda")).to(torch.bfloat16)

    def torch_path(x, w, r, nw):
        return fused.add_rms_norm(torch.nn.functional.linear(x, w), r, nw, 1e-6)

    ref_h, ref_n = torch_path(x.float(), w.float(), r.float(), nw.float())
    ours = sg.skinny_linear_add_rms_norm(x, w, r, nw, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(ours, sg.skinny_linear_add_rms_norm(x, w, r, nw, 1e-6)))
    theirs = torch_path(x, w, r, nw)
    for got, base, ref in zip(ours, theirs, (ref_h, ref_n)):
        assert got.shape == (M, N) and got.dtype == torch.bfloat16
        err, base_err = (float((t.float() - ref).norm() / ref.norm()) for t in (got, base))
        assert err < 6e-3 and err < 2 * base_err + 1e-3, (err, base_err)


@needs_cuda_triton
def test_the_epilogue_in_a_cuda_graph_and_row_independent():
    torch.manual_seed(1)
    N, K = 1024, 3072
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    r = torch.randn(8, N, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(N, device="cuda", dtype=torch.bfloat16)
    h, n = sg.skinny_linear_add_rms_norm(x, w, r, nw, 1e-6)
    other = x.clone()
    other[1:] = torch.randn(7, K, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(sg.skinny_linear_add_rms_norm(other, w, r, nw, 1e-6)[1][0], n[0])
    out_h, out_n = torch.empty_like(h), torch.empty_like(n)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a, b = sg.skinny_linear_add_rms_norm(x, w, r, nw, 1e-6)
        out_h.copy_(a)
        out_n.copy_(b)
    out_h.zero_(), out_n.zero_()
    g.replay()
    assert torch.equal(out_h, h) and torch.equal(out_n, n)


_INTERPRETED_GATED = r"""
import torch
from splitrl.rollout import skinny_gemm as sg
torch.manual_seed(0)
worst = 0.0
for M, F, K, bias in [(1, 32, 512, False), (3, 24, 256, True), (20, 40, 300, False), (70, 16, 256, True)]:
    x, w = torch.randn(M, K), torch.randn(2 * F, K) / K**0.5
    b = torch.randn(2 * F) if bias else None
    g, u = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(g) * u
    bm = min(64, max(16, sg.triton_next_power_of_2(M)))
    for cfg in ((bm, 16, 128, 4), (bm, 32, 64, 4), (64, 32, 128, 4, 5)):  # the last: Hopper's wide tiles
        y = sg.skinny_linear_silu_mul(x, w, b, config=cfg)
        assert y.shape == (M, F) and y.dtype == x.dtype
        worst = max(worst, float((y.double() - ref).abs().max().nan_to_num(float("inf"))))
# leading dims and a strided row layout
x = torch.randn(2, 3, 2 * 128)[..., :128]
w = torch.randn(64, 128) / 128**0.5
g, u = torch.nn.functional.linear(x.double(), w.double()).chunk(2, dim=-1)
y = sg.skinny_linear_silu_mul(x, w)
assert y.shape == (2, 3, 32)
worst = max(worst, float((y.double() - torch.nn.functional.silu(g) * u).abs().max().nan_to_num(float("inf"))))
print(worst)
"""


@pytest.mark.skipif(not sg.AVAILABLE, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_the_gated_kernel_under_the_interpreter_is_silu_gate_times_up():
    """fp32 on the CPU: silu(gate) · up of the fused gate/up product (gate rows first) against the
    torch ops in fp64; K not a multiple of the tile, bias, 1..70 rows (two row tiles), leading dims."""
    assert float(run_interpreted(_INTERPRETED_GATED)[-1]) < 1e-5


def test_the_gated_kernel_refuses_what_it_does_not_serve_before_any_launch():
    with pytest.raises(ValueError, match="even number of rows"):
        sg.skinny_linear_silu_mul(torch.randn(2, 16), torch.randn(15, 16))
    with pytest.raises(ValueError, match="bias"):
        sg.skinny_linear_silu_mul(torch.randn(2, 16), torch.randn(16, 16), torch.randn(8))
    with pytest.raises(ValueError, match="rows of x"):
        sg.skinny_linear_silu_mul(torch.randn(sg.MAX_ROWS + 1, 16), torch.randn(16, 16))
    if not sg.AVAILABLE:
        with pytest.raises(ValueError, match="needs Triton"):
            sg.skinny_linear_silu_mul(torch.randn(2, 16), torch.randn(16, 16))


def test_the_decode_forward_takes_the_gated_kernel_up_to_its_rows():
    assert sg.gated_preferred(1) and sg.gated_preferred(sg.GATED_ROWS)
    assert not sg.gated_preferred(sg.GATED_ROWS + 1)
    w = torch.randn(32, 16)
    assert not forward_mod._gated(torch.randn(3, 16), w)  # CPU fp32: the torch ops


def test_a_raised_row_threshold_never_passes_the_kernels_row_limit(monkeypatch):
    """A bench may raise GATED_ROWS or PREFERRED_ROWS (bench_switches); a prefill's rows are its
    tokens, past the kernels' MAX_ROWS, which they refuse: those stay on cuBLAS."""
    monkeypatch.setattr(sg, "GATED_ROWS", 100_000)
    monkeypatch.setattr(sg, "PREFERRED_ROWS", 100_000)
    assert sg.gated_preferred(sg.MAX_ROWS)
    assert not sg.gated_preferred(sg.MAX_ROWS + 1)
    # 64 features of 8,192 inputs: plan() splits K at any rows, so only the row limit refuses 257
    assert sg.plan(sg.MAX_ROWS + 1, 64, 8192)[3] > 1
    assert sg.preferred(sg.MAX_ROWS, 64, 8192)
    assert not sg.preferred(sg.MAX_ROWS + 1, 64, 8192)


@needs_cuda_triton
@pytest.mark.parametrize("M", [1, 3, 16, 32, 64, 96, 256])
def test_bf16_gated_kernel_matches_fp32_as_closely_as_the_torch_path(M):
    """silu(gate) · up in one launch against cuBLAS's product + the compiled silu_mul, both
    against fp32 (the 0.6B shape's gate/up: F = 3072, K = 1024); deterministic, rows independent,
    the same in a CUDA graph. On sm90 from 16 rows these are the wide tiles (:func:`gated_plan`)."""
    from splitrl.rollout.fused import Kernels

    k = Kernels(True, torch.device("cuda"), torch.bfloat16)
    torch.manual_seed(M)
    F, K = 3072, 1024
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * F, K, device="cuda") / K**0.5).to(torch.bfloat16)
    g, u = (x.float() @ w.float().T).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(g) * u
    ours = sg.skinny_linear_silu_mul(x, w)
    theirs = k.silu_mul(*torch.nn.functional.linear(x, w).chunk(2, dim=-1))
    assert ours.shape == (M, F) and ours.dtype == torch.bfloat16
    err, base_err = (float((t.float() - ref).norm() / ref.norm()) for t in (ours, theirs))
    assert err < 6e-3 and err < 2 * base_err + 1e-3, (err, base_err)
    assert torch.equal(ours, _deterministic_row_independent_and_the_same_in_a_graph(
        lambda t: sg.skinny_linear_silu_mul(t, w), x
    ))  # fmt: skip


@needs_cuda_triton
@pytest.mark.parametrize("R", [4, 32])
def test_pdl_launches_compute_the_same_bits_in_a_cuda_graph(monkeypatch, R):
    """A chain of the decode layer's kernels (gate/up + silu · mul, down_proj + add + norm, o_proj
    alone, the attention) launched with programmatic dependent launch inside a CUDA graph gives
    the bits of the plain launches: each kernel's wait holds its reads of the previous result,
    whether it signals its successor as it starts (R = 4 rows: ``pdl.early``) or after its loop."""
    from splitrl.rollout import decode_attention as da
    from splitrl.rollout import pdl

    if not pdl.SUPPORTED or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm90+ and a Triton with grid dependency control")
    torch.manual_seed(3)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(R, 1024, device=dev, dtype=dt)
    wgu = (torch.randn(2 * 3072, 1024, device=dev) / 32).to(dt)
    wd = (torch.randn(1024, 3072, device=dev) / 55).to(dt)
    wo = (torch.randn(2048, 1024, device=dev) / 32).to(dt)
    r, nw = torch.randn(R, 1024, device=dev, dtype=dt), torch.ones(1024, device=dev, dtype=dt)
    k, v = torch.randn(2, R, 192, 8, 128, device=dev, dtype=dt).unbind(0)
    used = torch.full((R,), 192, dtype=torch.int32, device=dev)

    def chain():
        act = sg.skinny_linear_silu_mul(x, wgu)
        h, n = sg.skinny_linear_add_rms_norm(act, wd, r, nw, 1e-6)
        q = sg.skinny_linear(n, wo).view(R, 1, 16, 128)
        return h, da.decode_attention(q, k, v, used, 128**-0.5)

    monkeypatch.setattr(pdl, "ENABLED", False)
    ref = chain()
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "EARLY", True)
    assert pdl.active(x, R) and not pdl.active(x, pdl.MAX_ROWS + 1)
    assert pdl.early(True, R) == (R <= pdl.EARLY_ROWS)
    outs = [torch.empty_like(t) for t in ref]
    chain()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out, t in zip(outs, chain()):
            out.copy_(t)
    for _ in range(3):
        for out in outs:
            out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, ref))


def test_the_early_signal_is_for_launches_of_few_rows_only(monkeypatch):
    """splitrl.rollout.pdl.early: only a launch that takes PDL, of at most EARLY_ROWS rows (measured
    slower at 32), and only while switched on (SPLITRL_PDL_EARLY)."""
    from splitrl.rollout import pdl

    monkeypatch.setattr(pdl, "EARLY", True)
    assert pdl.early(True, 1) and pdl.early(True, pdl.EARLY_ROWS)
    assert not pdl.early(True, pdl.EARLY_ROWS + 1) and not pdl.early(False, 1)
    monkeypatch.setattr(pdl, "EARLY", False)
    assert not pdl.early(True, 1)


def test_pdl_is_for_small_cuda_launches_only(monkeypatch):
    """splitrl.rollout.pdl.active: never on CPU tensors (nor under the interpreter), never above
    MAX_ROWS rows (measured slower at batch 256), never when switched off."""
    from splitrl.rollout import pdl

    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.active(torch.zeros(1), 1)
    assert pdl.options(False) == {} and pdl.options(True) == {"launch_pdl": True}
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        assert not pdl.active(x, pdl.MAX_ROWS + 1)
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert not pdl.active(x, 1)
