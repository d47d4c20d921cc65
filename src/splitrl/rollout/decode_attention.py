"""Attention of a decode step (Q >= 1 new tokens a row: Q = 1 plain, Q = 1 + D a verify) over a
position-major KV cache, in one Triton kernel that reads each key/value head of a row once.

Legend as in :mod:`splitrl.rollout.kv`: B rows (slots 0..B-1), Q queries a row, H query heads,
Hk key/value heads, G = H / Hk, M cache length, d head dim.

Why a kernel of our own: the flash varlen kernel reads a key/value head once per *query head*
(G times) and fills a 64/128-row query tile with Q rows; folded (one sequence per query position,
G heads as rows) it reads the prefix once per *query position* (Q times). Here one program owns
(row b, kv head) and all Q·G of its queries (query position i, head g as row i·G + g of one tile),
so the prefix is read once; ``python bench/bench_rollout.py --device cuda --attention`` times one
layer of both (figures in bench/RESULTS.md).

Row b's queries sit at positions p_b - Q + 1 .. p_b (``seqused[b]`` = p_b + 1) and query i reads the
entries j <= p_b - Q + 1 + i: the causal block of :meth:`splitrl.rollout.kv.StaticKVCache.plan`
with ``causal=True``. With per-query limits it reads any plan of that method (entries up to a limit,
plus the query's own): the MTP depths' draft windows, whose queries are not one causal block
(:mod:`splitrl.rollout.drafter`), which a masked SDPA call a depth ran before (its cost: bench/RESULTS.md).
The softmax is the online (streaming) one of FlashAttention (Dao et al.,
2022, Algorithm 1) in fp32; probabilities are rounded to the value dtype before the product with
the values, as the flash kernel does.

Triton is optional: :data:`AVAILABLE` says whether it imports (a CPU install has no Triton; set
``TRITON_INTERPRET=1`` with Triton installed to run the kernel on the CPU in tests).
"""

from __future__ import annotations

import torch

from splitrl.rollout import cuda_props, pdl

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU installs: the flash / masked paths are used
    AVAILABLE = False


if AVAILABLE:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, seqused_ptr, limits_ptr, own_ptr,
        sq_b, sq_q, sq_h,
        sk_s, sk_m, sk_h,
        so_b, so_q, so_h,
        scale_log2e,
        Q: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
        PER_QUERY: tl.constexpr, HEADS_FIRST: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr,
    ):  # fmt: skip
        if HEADS_FIRST:  # a row's kv heads in consecutive programs (:data:`HEADS_FIRST_PROGRAMS`)
            kvh = tl.program_id(0)
            b = tl.program_id(1)
        else:
            b = tl.program_id(0)
            kvh = tl.program_id(1)
        r = tl.arange(0, BLOCK_M)
        i = r // G  # query position within the row
        g = r % G
        row_ok = r < Q * G
        head = kvh * G + g
        dd = tl.arange(0, BLOCK_D)
        d_ok = dd < D
        # int64: a layer of 256 slots x 8k entries x 8 heads x 128 is past 2**31 elements
        kv_base = b.to(tl.int64) * sk_s + kvh * sk_h
        pdl.wait(USE_PDL, EARLY)  # q and this step's cache entries come from the previous kernel
        used = tl.load(seqused_ptr + b)
        # inclusive last entry each query reads; >= 0 so that a stale slot's row (used < Q, its output
        # discarded by the engine) never softmaxes an empty set, which would be NaN
        if PER_QUERY:
            own = tl.load(own_ptr + b * Q + i, mask=row_ok, other=-1)
            limit = tl.load(limits_ptr + b * Q + i, mask=row_ok, other=0)
            # a negative limit reads the own entry alone (as the mask does); only a query with
            # neither is given entry 0
            limit = tl.where(own >= 0, limit, tl.maximum(limit, 0))
        else:
            limit = tl.maximum(used - Q + i, 0)
            own = limit
        q = tl.load(
            q_ptr + b * sq_b + i[:, None] * sq_q + head[:, None] * sq_h + dd[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, tl.maximum(used, 1), BLOCK_N):  # used 0: one masked block, output 0
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < used
            offs = kv_base + j[:, None] * sk_m + dd[None, :]
            k = tl.load(k_ptr + offs, mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N], log2 units
            allowed = (j[None, :] <= limit[:, None]) | (j[None, :] == own[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offs, mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        pdl.signal(USE_PDL, EARLY)
        tl.store(
            out_ptr + b * so_b + i[:, None] * so_q + head[:, None] * so_h + dd[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


# The launch order of the (row, kv head) programs: from HEADS_FIRST_PROGRAMS programs, over a
# position-major cache, a row's kv heads are consecutive programs, which run together and read the
# adjacent head_dim segments of each cache position (a position's kv heads are contiguous there);
# else a kv head's rows. On an H200 at 256 rows x 8 kv heads, one query a row, 193 entries
# (bench/RESULTS.md): 57.0 µs against 58.3 a layer, plain decoding 1.010x; at 32 rows and at 1 row
# the same speed either way. Verify steps (Q > 1) of that many programs take it too, unmeasured.
HEADS_FIRST_PROGRAMS = 2048
_MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension, where the rows go in that order


def heads_first(rows: int, kv_heads: int, position_major: bool) -> bool:
    """Whether the kernel's programs are launched with a row's kv heads consecutive
    (:data:`HEADS_FIRST_PROGRAMS`) rather than a kv head's rows."""
    return position_major and rows * kv_heads >= HEADS_FIRST_PROGRAMS and rows <= _MAX_GRID_Y

# One program per (row, kv head) walks the row's entries alone: with few programs and long rows the
# flash kernel's split over the entries (splitkv) keeps more of the GPU busy (``bench_rollout.py
# --attention``; figures in bench/RESULTS.md): with one query a row and few programs the flash call wins
# on long rows; with many programs this kernel is faster at every length measured. A verify (Q > 1) is
# faster here at every size measured (the flash call then reads a row Q times or G times).
FEW_PROGRAMS = 128
LONG_ROW = 512


def preferred(rows: int, kv_heads: int, length: int, queries: int = 1) -> bool:
    """Whether this kernel (rather than the flash call) should run a decode step of ``rows`` rows
    with ``queries`` queries each, reading up to ``length`` entries (see :data:`FEW_PROGRAMS`)."""
    return queries > 1 or rows * kv_heads >= FEW_PROGRAMS or length <= LONG_ROW


# Programs (rows x kv heads) up to which a third pipeline stage pays: on an H200 at 192 entries a
# row (``bench/bench_skinny_gemm.py --attention``, bench/RESULTS.md) 3 stages of 64 entries took
# 9.2 µs at 32 rows against 10.7 with 2, and 4.8 against 5.0 at 1 row; at 96 and 256 rows (768,
# 2,048 programs) the choice moved the time by less than 2 %.
STAGES_3_PROGRAMS = 512


def tiles(block_d: int, programs: int = 0, shared_memory: int = 0) -> tuple[int, int, int]:
    """(BLOCK_N, num_stages, num_warps) for heads padded to ``block_d``, ``programs`` = rows x kv
    heads, on a device whose blocks may use ``shared_memory`` bytes. Shared memory holds K and V
    tiles of BLOCK_N x block_d per stage: 32 KiB at 64 x 128 in bf16. Two stages of 64 entries fit
    every sm80+ GPU at d <= 128; a third (96 KiB) is taken for few programs
    (:data:`STAGES_3_PROGRAMS`) where the device allows 128 KiB or more (sm80 / sm90; sm86 / sm89
    give ~99 KiB). At d = 256 two stages of 64 entries (128 KiB) exceed the sm86 / sm89 budget,
    so wide heads take 32 entries and one stage."""
    if block_d > 128:
        return 32, 1, 4
    if programs <= STAGES_3_PROGRAMS and shared_memory >= 128 * 1024:
        return 64, 3, 4
    return 64, 2, 4


def decode_attention(
    q_BQHd: torch.Tensor,
    k_SMHd: torch.Tensor,
    v_SMHd: torch.Tensor,
    seqused_B: torch.Tensor,
    scale: float,
    limits_BQ: torch.Tensor | None = None,
    own_BQ: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of Q consecutive queries a row over the row's cache prefix, or (with
    ``limits_BQ``) any queries with a limit each: the MTP depths' draft windows.

    Args:
        q_BQHd: [B, Q, H, d] queries of slots 0..B-1 (last dim contiguous), fp16 / bf16 / fp32.
        k_SMHd, v_SMHd: one layer of a position-major cache, [S, M, Hk, d] (S >= B), same dtype,
            with this forward's keys and values already written.
        seqused_B: int32 [B], p_b + 1 (the last query's position + 1), 1 <= seqused <= M
            (``StaticKVCache.plan`` clamps it so). With ``limits_BQ``: the entries the row's
            program walks (1 + the largest index any of its queries may read).
        scale: softmax scale (1/sqrt(d) for Qwen3).
        limits_BQ, own_BQ: int32 [B, Q], contiguous, both or neither: query (b, i) reads the
            entries j <= ``limits_BQ[b, i]`` and j = ``own_BQ[b, i]`` (its own entry; -1: none),
            the rule of :meth:`splitrl.rollout.kv.StaticKVCache.plan` for any mask; j < seqused.
        config: (BLOCK_N entries a tile, num_stages, num_warps) instead of :func:`tiles`' (benches).

    Returns:
        [B, Q, H * d] in the query dtype.

    Raises:
        RuntimeError: Triton is not installed (check :data:`AVAILABLE` first).
        ValueError: H is not a multiple of Hk, the last dims are not contiguous, the dtypes differ,
            ``seqused`` is not int32, or ``limits_BQ`` / ``own_BQ`` are not both int32 [B, Q].
    """
    if not AVAILABLE:
        raise RuntimeError("decode_attention needs Triton (pip install triton); use the flash or masked path")
    B, Q, H, d = q_BQHd.shape
    Hk = k_SMHd.shape[2]
    if H % Hk or q_BQHd.stride(-1) != 1 or k_SMHd.stride(-1) != 1 or v_SMHd.stride() != k_SMHd.stride():
        raise ValueError(
            f"decode_attention: H={H} must be a multiple of Hk={Hk}, and q / k / v must have a contiguous last dim "
            "(k and v the same strides)"
        )
    if not (q_BQHd.dtype == k_SMHd.dtype == v_SMHd.dtype) or seqused_B.dtype != torch.int32:
        raise ValueError(
            f"decode_attention: q, k, v must share a dtype (got {q_BQHd.dtype}, {k_SMHd.dtype}, {v_SMHd.dtype}) "
            f"and seqused must be int32 (got {seqused_B.dtype})"
        )
    per_query = limits_BQ is not None
    if per_query != (own_BQ is not None) or per_query and not all(
        t.dtype == torch.int32 and t.shape == (B, Q) and t.is_contiguous() for t in (limits_BQ, own_BQ)
    ):
        raise ValueError(f"decode_attention: limits_BQ and own_BQ must both be given as contiguous int32 [{B}, {Q}]")
    G = H // Hk
    out = torch.empty(B, Q, H, d, dtype=q_BQHd.dtype, device=q_BQHd.device)
    block_m = max(16, triton.next_power_of_2(Q * G))
    block_d = max(16, triton.next_power_of_2(d))
    on = pdl.active(q_BQHd, B * Q)
    block_n, stages, warps = config or tiles(block_d, B * Hk, cuda_props.shared_memory_optin(q_BQHd.device) if q_BQHd.is_cuda else 0)
    order = heads_first(B, Hk, k_SMHd.stride(2) == d)  # position-major: a position's heads adjacent
    _decode_attention_kernel[(Hk, B) if order else (B, Hk)](
        q_BQHd, k_SMHd, v_SMHd, out, seqused_B,
        limits_BQ if per_query else seqused_B, own_BQ if per_query else seqused_B,  # unread without PER_QUERY
        q_BQHd.stride(0), q_BQHd.stride(1), q_BQHd.stride(2),
        k_SMHd.stride(0), k_SMHd.stride(1), k_SMHd.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        scale * 1.4426950408889634,  # log2(e): the kernel works with exp2
        Q=Q, G=G, D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        # fp32 products stay fp32 (Triton's default for fp32 is TF32); only the interpreter tests pass
        # fp32 (a flash cache is fp16 / bf16), for which the setting has no effect
        PRECISION="ieee" if q_BQHd.dtype == torch.float32 else "tf32",
        PER_QUERY=per_query, HEADS_FIRST=order, USE_PDL=on, EARLY=pdl.early(on, B * Q), num_warps=warps, num_stages=stages,
        **pdl.options(on),
    )  # fmt: skip
    return out.view(B, Q, H * d)
