"""silu(gate) · up of a fused gate/up product in one Triton kernel: [T, 2F] → [T, F].

Legend: T tokens (rows of the product), F the MLP's intermediate size; the fused product's first F
features are the gate, the next F the up projection (:func:`splitrl.rollout.forward.fuse_projections`).

Why a kernel of our own: where the gate/up product runs on cuBLAS (prefills, and decode steps above
:data:`~splitrl.rollout.skinny_gemm.GATED_ROWS` rows) the compiled ``fused.silu_mul`` took the two
halves as strided views of the product and, compiled for dynamic shapes, read them at a fraction of
the memory bandwidth (bench/RESULTS.md). Here the row stride and F are known to the compiler, so
each program reads BLOCK_R × BLOCK_F of either half in 16-byte vectors and writes its outputs once.

Values: silu(g) · u = g / (1 + exp(−g)) · u in fp32 from the 16-bit inputs, rounded once to the
output dtype: the arithmetic of the compiled function (one fused kernel, no intermediate rounding)
and of the gated kernel's epilogue (:func:`splitrl.rollout.skinny_gemm.skinny_linear_silu_mul`).
The CPU and fp32 keep ``fused.silu_mul`` (:func:`applies`).

Triton is optional: :data:`AVAILABLE` says whether it imports (``TRITON_INTERPRET=1`` with Triton
installed runs the kernel on the CPU in tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU installs: the compiled / eager torch function is used
    AVAILABLE = False

BLOCK_R, BLOCK_F, WARPS = 1, 1024, 4  # rows and features a program, warps (the fastest of a sweep, bench/RESULTS.md)

if AVAILABLE:

    @triton.jit
    def _silu_mul_kernel(
        x_ptr, y_ptr, rows, s_x, F: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr
    ):  # fmt: skip
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        ok = (r < rows)[:, None] & (c < F)[None, :]
        src = x_ptr + r.to(tl.int64)[:, None] * s_x + c[None, :]  # int64: T · 2F passes 2**31 past ~350 k tokens
        g = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(src + F, mask=ok, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(y_ptr + r.to(tl.int64)[:, None] * F + c[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def applies(gate_up: torch.Tensor) -> bool:
    """Whether the decode forward passes this product output to :func:`silu_mul`: Triton, a CUDA
    tensor, a 16-bit dtype, a contiguous last dim (its switch is the forward's
    ``SPLITRL_SILU_MUL``). Tests run :func:`silu_mul` itself on CPU tensors under the interpreter."""
    return (
        AVAILABLE and gate_up.is_cuda and gate_up.dtype in (torch.bfloat16, torch.float16) and gate_up.stride(-1) == 1
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[..., :F]) · gate_up[..., F:].

    Args:
        gate_up: [..., 2F] (last dim contiguous, the leading dims one stride apart), fp16 / bf16 /
            fp32 (fp32 under the interpreter in tests), on CUDA or under ``TRITON_INTERPRET=1``.

    Returns:
        [..., F] contiguous, in gate_up's dtype.

    Raises:
        RuntimeError: Triton is not installed (check :data:`AVAILABLE` first).
        ValueError: the last dim is odd, empty or not contiguous, the leading dims cannot be read as
            one stride, the dtype is not fp16 / bf16 / fp32, or the tensor is not on CUDA outside
            the interpreter.
    """
    if not AVAILABLE:
        raise RuntimeError("silu_mul needs Triton (pip install triton); use fused.silu_mul")
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2 or gate_up.shape[-1] == 0 or not gate_up.is_floating_point():
        raise ValueError(
            f"silu_mul: gate_up must be a floating [..., 2F] tensor with F >= 1, got {tuple(gate_up.shape)} "
            f"{gate_up.dtype}"
        )
    if gate_up.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"silu_mul: gate_up must be fp16, bf16 or fp32 (it computes in fp32), got {gate_up.dtype}")
    two_f = gate_up.shape[-1]
    try:
        x = gate_up.view(-1, two_f)  # no copy: a product's output, or a view of rows of it
    except RuntimeError as err:
        raise ValueError(
            f"silu_mul: the leading dims of gate_up {tuple(gate_up.shape)} (strides {gate_up.stride()}) must "
            "flatten without a copy; pass a contiguous tensor"
        ) from err
    if x.stride(-1) != 1:
        raise ValueError(f"silu_mul: gate_up's last dim must be contiguous, got strides {gate_up.stride()}")
    if not gate_up.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"silu_mul: gate_up is on {gate_up.device}; the kernel needs a CUDA tensor (or TRITON_INTERPRET=1); "
            "on the CPU use fused.silu_mul"
        )
    rows, f = x.shape[0], two_f // 2
    y = torch.empty(*gate_up.shape[:-1], f, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(f, BLOCK_F))
        _silu_mul_kernel[grid](x, y, rows, x.stride(0), F=f, BLOCK_R=BLOCK_R, BLOCK_F=BLOCK_F, num_warps=WARPS)
    return y
