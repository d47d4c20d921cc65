"""The linear layers of a decode step with few rows, in one Triton kernel: y = x Wᵀ (+ b).

Legend: M rows of x (decode: slots × queries a slot), K input features, N output features.

Why a kernel of our own: at M ≤ 64 a decode step's matrix products read their weights once and
do almost no arithmetic (2·M FLOP a weight byte pair), so their floor is the weight bytes over the
memory bandwidth. On an H200 the Qwen3-0.6B shape's four projections of a layer (31.5 MB of bf16
weights, 7.3 µs at 4.3 TB/s) took 30 µs on cuBLAS at M = 1 and 24 µs at M = 32
(``python bench/bench_skinny_gemm.py``, figures in bench/RESULTS.md): each product is a few MB,
and a launch of that size stays near 5 µs whatever its bytes. The worst case was a narrow one:
o_proj (N = 1024 features) at M = 1, 12.6 µs, where cuBLAS's tiles ran too few programs to keep
the memory system busy.

Here one program owns BLOCK_N output features and all M rows: it streams its BLOCK_N × K slab of
W once in BLOCK_K-wide tiles (``num_stages`` tiles in flight) and accumulates x·Wᵀ in fp32 on the
tensor cores (M padded to BLOCK_M ≥ 16 rows, the masked rows read as zeros). Too few output
features to fill the chip are split along K into SPLIT_K programs whose fp32 partial sums a
second kernel adds in a fixed order: no atomics, so a row's result is the same from run to run and
does not depend on the other rows' values. The decode forward uses it only for such narrow
products (:func:`preferred`); on the wide ones it was 5–11 % slower than cuBLAS.

What follows o_proj and down_proj in a decoder layer, the residual add and the next RMSNorm, can
run in the kernel that adds the split partial sums (:func:`skinny_linear_add_rms_norm`): one launch
a product fewer. (Forming down_proj's input silu(gate) · up inside its product too was tried and
slower than a separate kernel, bench/RESULTS.md: every program recomputed it for the same input tiles.)

Tiles. Below 64 rows a tile, Triton compiles ``tl.dot`` to ``mma.sync``; at 64 it emits Hopper's
warpgroup MMA (``wgmma``), whose operands come from shared memory. The split products keep
:func:`plan`'s small tiles (64-row tiles measured slower in the decode step), while the gated kernel
takes 64-row tiles with more stages from :data:`GATED_WIDE_ROWS` rows on sm90 (:func:`gated_plan`).

The result is rounded once, from the fp32 sum, to x's dtype (cuBLAS rounds the same fp32 sum, in
another order of the products): the two agree to the rounding of bf16 (tests/rollout/test_skinny_gemm.py).

Triton is optional: :data:`AVAILABLE` says whether it imports; :func:`skinny_linear` is used only
on CUDA (``TRITON_INTERPRET=1`` with Triton installed runs the kernel on the CPU in tests).
"""

from __future__ import annotations

import os

import torch

from splitrl.rollout import cuda_props, env, pdl

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU installs: torch.nn.functional.linear is used
    AVAILABLE = False

MAX_ROWS = 256  # rows (M) the kernels take (over 64 rows in tiles of 64)
PREFERRED_ROWS = 64  # rows up to which the decode forward takes the split products (:func:`preferred`)
GATED_ROWS = 64  # rows up to which it takes the gate/up product with silu · mul (:func:`gated_preferred`)
SMS_TO_FILL = 132  # H200 / H100 SXM multiprocessors: programs wanted per launch, at least
STAGES = 3  # weight tiles in flight per program (num_stages) unless a config says otherwise
# The gated kernel's tiles from this many rows on Hopper (:func:`gated_plan`, ``warpgroup``): 64
# rows a tile, 32 features of gate and of up a program, 5 stages. Below, and on other GPUs, the
# plan's tiles.
GATED_WIDE_ROWS = 16
_WIDE_SHARED_MEMORY = 5 * (64 * 128 + 2 * 32 * 128) * 2  # bytes: those tiles' stages (160 KiB)
# benches: SPLITRL_GATED_TILES="BLOCK_N,BLOCK_K,num_warps,num_stages" sets the gated kernel's tiles at every row count
_GATED_TILES = env.ints("SPLITRL_GATED_TILES", 4, "BLOCK_N,BLOCK_K,num_warps,num_stages")


if AVAILABLE:

    @triton.jit
    def _skinny_gemm_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr,
        M, N, K,
        sx_m, sw_n, sy_s, sy_m,
        K_PER_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr, EARLY: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        k_begin = split * K_PER_SPLIT
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        pdl.wait(USE_PDL, EARLY)  # x is the previous kernel's output (splitrl.rollout.pdl)
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            kk = k_begin + k0 + rk
            k_ok = kk < K
            x = tl.load(x_ptr + rm[:, None] * sx_m + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * sw_n + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        pdl.signal(USE_PDL, EARLY)
        if HAS_BIAS:
            if split == 0:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + split * sy_s + rm[:, None] * sy_m + rn[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(
        p_ptr, y_ptr, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        pdl.wait(USE_PDL, EARLY)
        acc = tl.load(p_ptr + i, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):  # fixed order: the same sum on every run
            acc += tl.load(p_ptr + s * total + i, mask=ok, other=0.0)
        pdl.signal(USE_PDL, EARLY)
        tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _sum_add_rms_norm_kernel(
        p_ptr, r_ptr, w_ptr, h_ptr, o_ptr,
        N, total, sr_m, sh_m, so_m, eps,
        SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr,
    ):  # fmt: skip
        # one program a row: y = the fixed-order sum of its partials (rounded), h = y + residual,
        # out = weight * rms_norm(h), each rounded where the torch ops of fused.add_rms_norm round
        m = tl.program_id(0)
        n = tl.arange(0, BLOCK)
        ok = n < N
        w = tl.load(w_ptr + n, mask=ok, other=0.0).to(tl.float32)  # a weight: no earlier kernel writes it
        pdl.wait(USE_PDL, EARLY)
        acc = tl.load(p_ptr + m * N + n, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(p_ptr + s * total + m * N + n, mask=ok, other=0.0)
        dtype = h_ptr.dtype.element_ty
        res = tl.load(r_ptr + m * sr_m + n, mask=ok, other=0.0).to(tl.float32)
        h = (acc.to(dtype).to(tl.float32) + res).to(dtype)
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, axis=0) / N
        normed = (hf * tl.math.rsqrt(var + eps)).to(dtype).to(tl.float32)
        pdl.signal(USE_PDL, EARLY)
        tl.store(h_ptr + m * sh_m + n, h, mask=ok)
        tl.store(o_ptr + m * so_m + n, (w * normed).to(dtype), mask=ok)


    @triton.jit
    def _gate_up_silu_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr,
        M, F, K,
        sx_m, sw_n, sy_m,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr, EARLY: tl.constexpr,
    ):  # fmt: skip
        # one program: BLOCK_N features f of gate (weight rows f) and of up (rows F + f) for
        # BLOCK_M rows, the whole of K; silu(gate) * up in the epilogue
        pid_n = tl.program_id(0)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < F
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        pdl.wait(USE_PDL, EARLY)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            x = tl.load(x_ptr + rm[:, None] * sx_m + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(w_ptr + rn[:, None] * sw_n + kk[None, :], mask=w_ok, other=0.0)
            wu = tl.load(w_ptr + (F + rn)[:, None] * sw_n + kk[None, :], mask=w_ok, other=0.0)
            acc_g = tl.dot(x, tl.trans(wg), acc_g)
            acc_u = tl.dot(x, tl.trans(wu), acc_u)
        pdl.signal(USE_PDL, EARLY)
        if HAS_BIAS:
            acc_g += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_ptr + F + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        dtype = y_ptr.dtype.element_ty
        # the products rounded as the fused product's output is; silu and the product in fp32,
        # rounded once (the compiled silu_mul's arithmetic)
        g = acc_g.to(dtype).to(tl.float32)
        u = acc_u.to(dtype).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        out = y_ptr + rm[:, None] * sy_m + rn[None, :]
        tl.store(out, y.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


def plan(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps) for an [M, K] × [N, K]ᵀ product of M ≥ 1 rows
    (positive ints; the kernels take at most :data:`MAX_ROWS` rows, :func:`preferred` checks it).

    BLOCK_M is M rounded up to a power of two (16 at least: the tensor cores' smallest tile), 64
    above 64 rows (tiles of 64 rows, one program each). BLOCK_N is 32 when N / 32 programs fill
    the chip, else 16; SPLIT_K (1, 2, 4 or 8, each split a multiple of BLOCK_K) raises the programs
    to ``SMS_TO_FILL`` or more where K allows it.
    """
    block_m = min(64, max(16, triton_next_power_of_2(M)))
    m_tiles = -(-M // block_m)
    block_n = 32 if N // 32 * m_tiles >= SMS_TO_FILL else 16
    block_k = 256 if block_m <= 32 else 128
    programs = -(-N // block_n) * m_tiles
    split = 1
    while programs * split < SMS_TO_FILL and split < 8 and K % (2 * split * block_k) == 0:
        split *= 2
    return block_m, block_n, block_k, split, 4


def gated_plan(M: int, F: int, K: int, warpgroup: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of :func:`skinny_linear_silu_mul` for M
    rows, F features of gate and of up, K inputs; no split along K (the epilogue needs the whole sum).

    ``warpgroup`` (an sm90 device with the shared memory: :func:`warpgroup_device`) and at least
    :data:`GATED_WIDE_ROWS` rows: tiles of 64 rows, which Triton compiles to Hopper's warpgroup
    MMA (``wgmma``, operands from shared memory; below 64 rows a tile it emits ``mma.sync``), 32
    features a program and 5 stages of weight tiles in flight. Measured in the engine on an H200
    (``bench/bench_switches.py``, bench/RESULTS.md, 2026-12-06): 1.04× plain decoding at batch 16
    and 32, 1.02× at 64, the same at 8, 0.94× at 1; 64-row tiles alone, or 32 features and 5
    stages at 32-row tiles, measured the same as the old tiles. Otherwise: BLOCK_M as
    :func:`plan`'s; BLOCK_N 16 (each program reads 2 × 16 weight rows: the count of
    :func:`plan`'s wide tiles) unless F / 32 programs fill the chip; :data:`STAGES` stages."""
    if warpgroup and M >= GATED_WIDE_ROWS:
        return 64, 32, 128, 4, 5
    block_m = min(64, max(16, triton_next_power_of_2(M)))
    m_tiles = -(-M // block_m)
    block_n = 32 if F // 32 * m_tiles >= SMS_TO_FILL else 16
    return block_m, block_n, 128, 4, STAGES


def gated_tiles(x: torch.Tensor, M: int, F: int, K: int) -> tuple[int, ...]:
    """The tiles :func:`skinny_linear_silu_mul` launches for x's M rows without a config:
    :func:`gated_plan`'s, wide on a :func:`warpgroup_device` for 16-bit x only (fp32 stages would
    need twice the shared memory); a bench's ``SPLITRL_GATED_TILES`` trial keeps the old plan's
    BLOCK_M and takes the rest from the variable."""
    if _GATED_TILES:
        return (gated_plan(M, F, K)[0], *_GATED_TILES)
    return gated_plan(M, F, K, x.is_cuda and x.element_size() == 2 and _warpgroup(x.device))


def warpgroup_device(device: torch.device | str | int) -> bool:
    """Whether ``device`` (a ``torch.device``, ``"cuda:0"``, or a CUDA index) is a CUDA sm90 GPU
    whose blocks may opt into the shared memory of :func:`gated_plan`'s wide tiles (H100 / H200:
    227 KiB); False off CUDA or without it. The device's properties are read once
    (:mod:`splitrl.rollout.cuda_props`)."""
    if not isinstance(device, torch.device):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and _warpgroup(device)


def _warpgroup(device: torch.device) -> bool:
    """:func:`warpgroup_device` of a device CUDA tensors live on (no availability check)."""
    return (
        cuda_props.sm_major(device) == 9 and cuda_props.shared_memory_optin(device) >= _WIDE_SHARED_MEMORY + 32 * 1024
    )


def preferred(M: int, N: int, K: int) -> bool:
    """Whether the decode forward takes this kernel for an [M, K] × [N, K]ᵀ product: at most
    :data:`PREFERRED_ROWS` rows and too few output features to fill the chip, so that :func:`plan`
    splits K. Measured on an H200 with the Qwen3-0.6B shapes (``bench/bench_skinny_gemm.py``,
    bench/RESULTS.md): there it matched or beat cuBLAS (o_proj at M = 1: 4.8 against 12.6 µs),
    while on the wide products (q/k/v, gate/up: one program per 16 or 32 features, no split) it
    was 5–11 % slower than cuBLAS, which keeps those. Never past :data:`MAX_ROWS`, the kernel's
    limit, however a bench sets PREFERRED_ROWS (as :func:`gated_preferred`)."""
    return M <= min(PREFERRED_ROWS, MAX_ROWS) and plan(M, N, K)[3] > 1


def gated_preferred(M: int) -> bool:
    """Whether the decode forward forms silu(gate) · up with :func:`skinny_linear_silu_mul` (one
    launch) rather than cuBLAS's gate/up product and the compiled silu_mul (two): at most
    :data:`GATED_ROWS` rows (bench/RESULTS.md), and never past :data:`MAX_ROWS`, the kernel's limit
    (a bench may raise GATED_ROWS; a prefill's rows are its tokens)."""
    return M <= min(GATED_ROWS, MAX_ROWS)


def triton_next_power_of_2(n: int) -> int:
    """The least power of two ≥ n (n ≥ 1)."""
    return 1 << max(0, (n - 1).bit_length())


def _check(x: torch.Tensor, weight: torch.Tensor, what: str, bias: torch.Tensor | None = None):
    """x as [M, K] with unit column stride; raises ValueError (module docs) before any launch: the
    shapes, dtypes and layouts of x, ``weight`` and ``bias`` (a float [N], read in fp32)."""
    ok = (
        x.dim() >= 1
        and x.shape[-1] >= 1
        and x.is_floating_point()
        and weight.dim() == 2
        and weight.shape[1] == x.shape[-1]
        and weight.dtype == x.dtype
        and weight.stride(1) == 1
        and x.numel() // x.shape[-1] <= MAX_ROWS
    )
    if not ok:
        raise ValueError(
            f"{what} takes ≤ {MAX_ROWS} rows of x [..., K] (a float tensor, K ≥ 1) and a weight [N, K] of x's dtype, "
            f"contiguous along K; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} "
            f"strides {weight.stride()}"
        )
    N = weight.shape[0]
    if bias is not None and (
        tuple(bias.shape) != (N,) or not bias.is_floating_point() or bias.device != x.device or bias.stride(0) != 1
    ):
        raise ValueError(
            f"{what}: bias must be a contiguous float [{N}] on {x.device}, or None; got {tuple(bias.shape)} "
            f"{bias.dtype} on {bias.device}, strides {bias.stride()}"
        )
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _check_config(config, names: tuple[str, ...], what: str) -> None:
    """A caller's tile ``config``: ints named by ``names`` (+ an optional num_stages), the block
    sizes powers of two ≥ 16, num_warps a power of two, the rest ≥ 1; raises ValueError saying
    what the config must be."""
    if config is None:
        return
    values = tuple(config)
    ok = len(values) in (len(names), len(names) + 1) and all(isinstance(v, int) and v >= 1 for v in values)
    ok = ok and all(v >= 16 and not v & (v - 1) for n, v in zip(names, values) if n.startswith("BLOCK"))
    ok = ok and all(not v & (v - 1) for n, v in zip(names, values) if n == "num_warps")
    if not ok:
        raise ValueError(
            f"{what}: config is ({', '.join(names)}[, num_stages]), positive ints with the BLOCK sizes powers of "
            f"two >= 16 and num_warps a power of two; got {config!r}"
        )


_check_config(_GATED_TILES or None, ("BLOCK_N", "BLOCK_K", "num_warps"), "SPLITRL_GATED_TILES")


_PRODUCT_CONFIG = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")  # a split product's config, then an optional num_stages


def _require_triton(what: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ValueError without Triton, or for tensors off CUDA outside Triton's interpreter."""
    if not AVAILABLE:
        raise ValueError(f"{what} needs Triton; use torch.nn.functional.linear")
    if not (x.is_cuda and weight.is_cuda) and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{what} runs on CUDA tensors (got x on {x.device}, weight on {weight.device}); on a CPU use "
            "torch.nn.functional.linear (tests: TRITON_INTERPRET=1 runs the kernel under Triton's interpreter)"
        )


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias, config) -> torch.Tensor:
    """The product kernel on x2 [M, K]; returns y [M, N] (SPLIT_K 1) or the fp32 partial sums
    [SPLIT_K, M, N]."""
    M = x2.shape[0]
    N, K = weight.shape
    block_m, block_n, block_k, split, warps, *rest = config or plan(M, N, K)
    stages = rest[0] if rest else STAGES
    k_per_split = -(-K // split)
    k_per_split = -(-k_per_split // block_k) * block_k
    if split == 1:
        y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
        y_stride_s = 0
    else:
        y = torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
        y_stride_s = y.stride(0)
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    use_pdl = pdl.active(x2, M)
    _skinny_gemm_kernel[grid](
        x2, weight, bias if bias is not None else weight, y,
        M, N, K,
        x2.stride(0), weight.stride(0), y_stride_s, N,
        K_PER_SPLIT=k_per_split, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_PDL=use_pdl, EARLY=pdl.early(use_pdl, M), num_warps=warps, num_stages=stages, **pdl.options(use_pdl),
    )  # fmt: skip
    return y


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for x with at most :data:`MAX_ROWS` rows.

    Args:
        x: [..., K], rows = the product of the leading dims (≤ MAX_ROWS), any float dtype; its
            last dim need not be contiguous with the rows (a row stride is passed).
        weight: [N, K], the dtype of x, contiguous along K.
        bias: [N] (any float dtype, read in fp32) or None.
        config: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps[, num_stages]) instead of
            :func:`plan`'s (benches).

    Returns:
        [..., N] in x's dtype, rounded once from the fp32 sum.

    Raises:
        ValueError: more than MAX_ROWS rows, x not float, a weight not [N, K] of x's dtype
            contiguous along K, a bias not a contiguous float [N] on x's device, Triton
            missing, or tensors off CUDA outside Triton's interpreter (before any launch).
    """
    *lead, K = x.shape
    x2 = _check(x, weight, "skinny_linear", bias)
    _check_config(config, _PRODUCT_CONFIG, "skinny_linear")
    _require_triton("skinny_linear", x, weight)
    M, N = x2.shape[0], weight.shape[0]
    y = _launch(x2, weight, bias, config)
    if y.dim() == 3:
        partials, y = y, torch.empty(M, N, dtype=x.dtype, device=x.device)
        on = pdl.active(x, M)
        _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](
            partials, y, M * N, SPLIT_K=partials.shape[0], BLOCK=1024, USE_PDL=on, EARLY=pdl.early(on, M),
            **pdl.options(on),
        )
    return y.view(*lead, N)


def skinny_linear_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
    config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode layer's product and the residual add + RMSNorm after it, in two launches:
    h = residual + x Wᵀ (+ b), returned with ``norm_weight`` · rms_norm(h): the values of
    ``fused.add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps)``.

    The split-K partial sums are added in :func:`skinny_linear`'s fixed order by the kernel that
    also adds the residual and normalizes (one program a row), so the add + RMSNorm launch of the
    torch path is gone. Rounded where the torch ops round: the product, h, and the normalized h
    before and after the weight; the variance in fp32 (RMSNorm: Zhang & Sennrich, 2019).

    Args:
        x: [..., K], at most :data:`MAX_ROWS` rows, bf16 / fp16 (any float dtype under Triton's
            interpreter).
        weight: [N, K], x's dtype, contiguous along K; only products :func:`plan` splits along K.
        residual: [..., N], x's dtype, the leading dims of x, contiguous along N.
        norm_weight: [N]; eps: the norm's epsilon.
        bias: [N] or None.
        config: a :func:`plan` tuple with SPLIT_K > 1 instead of its own (tests).

    Returns:
        (h, normed), both [..., N] in x's dtype, new tensors.

    Raises:
        ValueError: as :func:`skinny_linear`, and for a product that is not split along K, a
            residual of another shape or a norm weight of another size (before any launch).
    """
    *lead, K = x.shape
    x2 = _check(x, weight, "skinny_linear_add_rms_norm", bias)
    _check_config(config, _PRODUCT_CONFIG, "skinny_linear_add_rms_norm")
    M, N = x2.shape[0], weight.shape[0]
    cfg = config or plan(M, N, K)
    if cfg[3] == 1:
        source = f"the config {tuple(config)}" if config else f"plan({M}, {N}, {K})"
        raise ValueError(
            f"skinny_linear_add_rms_norm serves products split along K (SPLIT_K > 1); {source} does not split"
        )
    if tuple(residual.shape) != (*lead, N) or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(
            f"residual must be {(*lead, N)} {x.dtype}, contiguous along N; got {tuple(residual.shape)} "
            f"{residual.dtype}, strides {residual.stride()}"
        )
    if norm_weight.shape != (N,) or not norm_weight.is_floating_point():
        raise ValueError(f"norm_weight must be a float [{N}], got {tuple(norm_weight.shape)} {norm_weight.dtype}")
    if not (isinstance(eps, (int, float)) and 0 <= eps < float("inf")):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    _require_triton("skinny_linear_add_rms_norm", x, weight)
    partials = _launch(x2, weight, bias, cfg)
    r2 = residual.reshape(M, N)
    h = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block = triton_next_power_of_2(N)
    on = pdl.active(x, M)
    _sum_add_rms_norm_kernel[(M,)](
        partials, r2, norm_weight, h, out,
        N, M * N, r2.stride(0), N, N, float(eps),
        SPLIT_K=cfg[3], BLOCK=block, num_warps=4 if block <= 2048 else 8, USE_PDL=on, EARLY=pdl.early(on, M),
        **pdl.options(on),
    )  # fmt: skip
    return h.view(*lead, N), out.view(*lead, N)


def skinny_linear_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None
) -> torch.Tensor:
    """A SwiGLU MLP's input to down_proj in one launch: silu(gate) · up, where gate and up are
    the two halves of ``linear(x, weight, bias)`` (the fused gate/up weight of
    :func:`splitrl.rollout.forward.fuse_projections`: gate rows first).

    One program computes the same BLOCK_N features of gate and of up over the whole of K (fp32
    accumulators on the tensor cores), rounds each to x's dtype as the product's output is, and
    writes silu(gate) · up computed in fp32 and rounded once, the arithmetic of the compiled
    ``silu_mul`` it replaces (SwiGLU: Shazeer, 2020). The gate/up intermediate [M, 2F] is
    neither written nor read back.

    Args:
        x: [..., K], at most :data:`MAX_ROWS` rows, bf16 / fp16 (any float dtype under Triton's
            interpreter); its last dim contiguous with a row stride.
        weight: [2F, K], x's dtype, contiguous along K; rows 0..F-1 gate, F..2F-1 up.
        bias: [2F] or None.
        config: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps[, num_stages]) instead of :func:`gated_plan`'s
            (benches, tests).

    Returns:
        [..., F] in x's dtype, a new tensor.

    Raises:
        ValueError: as :func:`skinny_linear`, for an odd number of weight rows or a bias that is
            not [2F] (before any launch), or Triton missing.
    """
    *lead, K = x.shape
    x2 = _check(x, weight, "skinny_linear_silu_mul", bias)
    _check_config(config, ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"), "skinny_linear_silu_mul")
    if weight.shape[0] % 2:
        raise ValueError(
            "skinny_linear_silu_mul takes the fused gate/up weight [2F, K] (an even number of rows) and a bias "
            f"[2F] or None; got weight {tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}"
        )
    _require_triton("skinny_linear_silu_mul", x, weight)
    M, F = x2.shape[0], weight.shape[0] // 2
    block_m, block_n, block_k, warps, *rest = config or gated_tiles(x, M, F, K)
    stages = rest[0] if rest else STAGES
    y = torch.empty(M, F, dtype=x.dtype, device=x.device)
    on = pdl.active(x, M)
    _gate_up_silu_kernel[(triton.cdiv(F, block_n), triton.cdiv(M, block_m))](
        x2, weight, bias if bias is not None else weight, y,
        M, F, K,
        x2.stride(0), weight.stride(0), F,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_PDL=on, EARLY=pdl.early(on, M), num_warps=warps, num_stages=stages, **pdl.options(on),
    )  # fmt: skip
    return y.view(*lead, F)
