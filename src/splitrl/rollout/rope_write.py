"""The start of a decode layer's attention in one Triton kernel: split the fused q/k/v projection
into heads, apply the per-head RMSNorm of queries and keys (Qwen3's q_norm / k_norm, where the
family has them), the rotary embedding, and write keys and values into the KV cache.

Legend as in :mod:`splitrl.rollout.kv`: B rows, Q new tokens a row (T = B·Q tokens), Hq query
heads, Hk key/value heads, d head dim.

Why a kernel of our own: on the torch path this is the compiled ``qkv_norm_rope`` (its q and k
parts, and the stacking of k with v) and then one ``index_copy_`` of keys and values into the cache
(:meth:`~splitrl.rollout.kv.StaticKVCache.write_kv`): at least two launches a layer, each a few
microseconds for a few kB at batch 1, and at batch 256 an index copy of ~1 MB a layer whose
stacked source the first kernel had to write first. Here one program a (token, head) — or a
(token, group of heads) from :data:`GROUP_FROM_TOKENS` tokens, where one-head programs of a single
warp would run in more waves than their work needs — reads its heads of the projection once and
writes its result where it goes: query heads to a [T, Hq, d] tensor,
key and value heads to the cache rows that the forward's
:class:`~splitrl.rollout.kv.AttentionPlan` names (``flat_index``, in the cache's own layout).

Values: the ops of :func:`splitrl.rollout.fused.qkv_norm_rope` (transformers' ``Qwen3RMSNorm`` and
``apply_rotary_pos_emb``), each rounded to the compute dtype where the eager torch op rounds: the
normalized head before and after its weight, each of the rotary embedding's two products and their
sum; the variance in fp32. On bf16 / fp16 CUDA only (the CPU and fp32 keep the torch functions,
which the exactness tests check bit for bit).

Triton is optional: :data:`AVAILABLE` says whether it imports (``TRITON_INTERPRET=1`` with Triton
installed runs the kernel on the CPU in tests).
"""

from __future__ import annotations

import math

import torch

from splitrl.rollout import pdl

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU installs: the torch functions are used
    AVAILABLE = False

GROUP_FROM_TOKENS = 64  # tokens (B·Q) from which a program handles several heads (:func:`heads_per_program`)
MAX_HEADS_PER_PROGRAM = 8  # heads a program handles at most

if AVAILABLE:

    @triton.jit
    def _norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, i, ok, eps, HALF: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
        """Heads [HB, d] at x_ptr [HB, 1] (i: [1, BLOCK] lanes of a half): (first halves, second
        halves) after the per-head norm and the rotary embedding."""
        dtype = x_ptr.dtype.element_ty
        x1 = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
        if NORM:
            r = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
            w1 = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
            x1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        c1 = tl.load(cos_ptr + i, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + i, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + HALF + i, mask=ok, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        o1 = ((x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)).to(dtype)
        return o1, o2

    @triton.jit
    def _norm_rope_write_kernel(
        qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, index_ptr,
        s_qkv, Q, s_cos_b, s_cos_q, s_sin_b, s_sin_q, v_offset, eps,
        HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
        HB: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)  # token b·Q + q; int64: t · features passes 2**31 past ~350 k tokens
        # HB heads: query heads 0..HQ-1, then key heads (each with its value head); HB divides HQ
        # and HK, so a program's heads are all queries or all keys
        h = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]  # [HB, 1]
        i = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
        ok = (i < HALF) & (h >= 0)  # [HB, BLOCK]
        # a tiny kernel: its successor may start as soon as every program has waited (or started: "Early")
        pdl.wait(USE_PDL, EARLY)
        pdl.signal(USE_PDL, EARLY)
        src = qkv_ptr + t * s_qkv + h * D
        cos = cos_ptr + (t // Q) * s_cos_b + (t % Q) * s_cos_q
        sin = sin_ptr + (t // Q) * s_sin_b + (t % Q) * s_sin_q
        if tl.program_id(1) * HB < HQ:
            o1, o2 = _norm_rope(src, qw_ptr, cos, sin, i, ok, eps, HALF, D, NORM)
            dst = q_ptr + (t * HQ + h) * D
            tl.store(dst + i, o1, mask=ok)
            tl.store(dst + HALF + i, o2, mask=ok)
        else:
            o1, o2 = _norm_rope(src, kw_ptr, cos, sin, i, ok, eps, HALF, D, NORM)
            row = tl.load(index_ptr + t * HK + (h - HQ)).to(tl.int64)  # [HB, 1]
            dst = kv_ptr + row * D
            tl.store(dst + i, o1, mask=ok)
            tl.store(dst + HALF + i, o2, mask=ok)
            vsrc = src + HK * D  # the value head sits HK heads after its key head
            v1 = tl.load(vsrc + i, mask=ok, other=0.0)
            v2 = tl.load(vsrc + HALF + i, mask=ok, other=0.0)
            tl.store(dst + v_offset + i, v1, mask=ok)
            tl.store(dst + v_offset + HALF + i, v2, mask=ok)


def heads_per_program(tokens: int, hq: int, hk: int) -> int:
    """Heads one program of the kernel handles for ``tokens`` tokens of hq query and hk key/value
    heads: 1 below :data:`GROUP_FROM_TOKENS` tokens (many programs, each as short as it gets),
    else the largest power of two that divides both hq and hk, at most :data:`MAX_HEADS_PER_PROGRAM`
    (rounded down to a power of two; at 256 tokens of the Qwen3-0.6B heads one-head programs are
    6,144 programs of a single warp: more waves than work)."""
    if tokens < GROUP_FROM_TOKENS:
        return 1
    g = math.gcd(hq, hk)
    cap = 1 << (max(1, MAX_HEADS_PER_PROGRAM).bit_length() - 1)  # a power of two (tl.arange needs one)
    return min(g & -g, cap)


def norm_rope_write(
    qkv: torch.Tensor,
    nq: int,
    nk: int,
    d: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_layer: torch.Tensor,
    flat_index: torch.Tensor,
) -> torch.Tensor:
    """Queries of a decode forward (or of a prefill: Q the padded prompt length), its keys and values
    written to the cache (module docstring).

    Args:
        qkv: [B, Q, nq + 2·nk], the fused q/k/v projection's output (bf16 / fp16), contiguous along
            its last dim; nq = Hq·d and nk = Hk·d features.
        q_weight, k_weight: [d] per-head RMSNorm weights, or both None (no per-head norm: Llama, Qwen2).
        eps: the norms' epsilon.
        cos, sin: [B, Q, d] in qkv's dtype, each row contiguous, any strides over B and Q (views of
            the rotary table, and a prefill's positions 0..Q-1 expanded over B, are fine).
        kv_layer: one layer of :attr:`StaticKVCache.kv`, ``kv[:, layer]``: [2, S, M, Hk, d] or
            [2, S, Hk, M, d], keys then values, each half contiguous.
        flat_index: int64 [B·Q·Hk], the plan's cache rows (of a half viewed as [-1, d]) of entry
            (b, q, kv head), in that order.

    Returns:
        q [B, Q, Hq, d] in qkv's dtype (a new tensor); keys and values are in ``kv_layer``.

    Raises:
        ValueError: Triton missing, mismatched shapes, dtypes or layouts (before any launch).
    """
    B, Q, F = qkv.shape
    hq, hk = nq // d, nk // d
    norm = q_weight is not None
    problems = []
    if F != nq + 2 * nk or nq % d or nk % d or d % 2:
        problems.append(f"qkv's last dim {F} is not nq + 2·nk = {nq} + 2·{nk} of heads of d = {d} (even)")
    if qkv.stride(-1) != 1 or qkv.stride(0) != Q * qkv.stride(1):
        problems.append("qkv must be contiguous along its features and its (B, Q) rows evenly spaced")
    if norm != (k_weight is not None) or (norm and (q_weight.shape != (d,) or k_weight.shape != (d,))):
        problems.append("q_weight and k_weight must both be [d] or both be None")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (B, Q, d) or t.dtype != qkv.dtype or t.stride(-1) != 1:
            problems.append(f"{name} must be [B, Q, d] = {(B, Q, d)} {qkv.dtype} with contiguous rows")
    if (
        kv_layer.dim() != 5
        or kv_layer.shape[0] != 2
        or kv_layer.shape[-1] != d
        or kv_layer.dtype != qkv.dtype
        or not kv_layer[0].is_contiguous()
    ):
        problems.append(f"kv_layer must be [2, S, ·, ·, d = {d}] in {qkv.dtype} with contiguous halves")
    elif hk not in kv_layer.shape[2:4]:
        problems.append(f"kv_layer {tuple(kv_layer.shape)} has no dimension of Hk = {hk} heads")
    if flat_index.shape != (B * Q * hk,) or flat_index.dtype != torch.int64:
        problems.append(f"flat_index must be int64 [B·Q·Hk] = [{B * Q * hk}]")
    if problems:
        raise ValueError("norm_rope_write: " + "; ".join(problems))
    if not AVAILABLE:
        raise ValueError("norm_rope_write needs Triton; use fused.qkv_norm_rope and StaticKVCache.write_kv")
    q = torch.empty(B, Q, hq, d, dtype=qkv.dtype, device=qkv.device)
    half = d // 2
    weight = q_weight if norm else qkv  # an unused pointer where there is no norm
    on = pdl.active(qkv, B * Q)
    hb = heads_per_program(B * Q, hq, hk)
    _norm_rope_write_kernel[(B * Q, (hq + hk) // hb)](
        qkv, weight, k_weight if norm else qkv, cos, sin, q, kv_layer, flat_index,
        qkv.stride(1), Q, cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), kv_layer.stride(0), float(eps),
        HQ=hq, HK=hk, D=d, HALF=half, BLOCK=triton.next_power_of_2(half), HB=hb, NORM=norm, USE_PDL=on,
        EARLY=pdl.early(on, B * Q), num_warps=max(1, min(4, hb * half // 128)),
        **pdl.options(on),
    )  # fmt: skip
    return q
