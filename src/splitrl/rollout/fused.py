"""Elementwise pieces of the decoder forward and the sampler, written once in plain torch (the CPU
path, and the reference) and compiled into a few fused kernels on CUDA (fewer launches per decode
step).

Each forward function is the exact op sequence of the transformers module it replaces (Qwen3 /
Llama RMSNorm in fp32, ``apply_rotary_pos_emb``, SiLU-gated MLP product). The sampler
(:func:`~splitrl.rollout.sampling.draw`) is integer hashing plus a few reductions: eagerly it is
~100 tiny kernels per decode step, which at batch 1 cost more than a decoder layer; compiled, a
handful. Its integer part is exact either way.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from splitrl.compile_lock import serialized
from splitrl.rollout.sampling import draw, draw_with_logprobs

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, rms_norm(x + residual))."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


def rope(x_BMHd: torch.Tensor, cos_BMd: torch.Tensor, sin_BMd: torch.Tensor) -> torch.Tensor:
    half = x_BMHd.shape[-1] // 2
    rotated = torch.cat((-x_BMHd[..., half:], x_BMHd[..., :half]), dim=-1)
    return x_BMHd * cos_BMd[:, :, None] + rotated * sin_BMd[:, :, None]


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, cos, sin):
    """Qwen3's per-head RMSNorm of queries and keys, then the rotary embedding of both."""
    return rope(rms_norm(q, q_weight, eps), cos, sin), rope(rms_norm(k, k_weight, eps), cos, sin)


def qk_rope(q, k, cos, sin):
    return rope(q, cos, sin), rope(k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_NAMES = ("rms_norm", "add_rms_norm", "rope", "qk_norm_rope", "qk_rope", "silu_mul", "draw", "draw_with_logprobs")
_COMPILED: dict[str, object] = {}


class Kernels:
    """The functions above, compiled with ``torch.compile`` when ``compiled`` (CUDA), else eager.

    Compiled versions are shared by every engine of the process (one compilation per shape
    family). If compiling fails (no Triton, an unsupported setup), the eager versions are used and
    a warning says so: results are the same, only slower.
    """

    def __init__(self, compiled: bool, device: torch.device | None = None, dtype: torch.dtype = torch.float32):
        if compiled and not _COMPILED:
            try:
                # one compilation per dtype / rank / size-1 specialization; dozens in a process
                for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
                    if hasattr(torch._dynamo.config, knob):
                        setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 512))
                # the samplers' vocabulary size must stay static (inductor cannot split its
                # block arithmetic symbolically); their row count becomes dynamic at the second shape
                fns = {
                    n: serialized(torch.compile(globals()[n], dynamic=None if n.startswith("draw") else True))
                    for n in _NAMES
                }
                x = torch.randn(2, 3, 8, device=device, dtype=dtype)
                w = torch.ones(8, device=device, dtype=dtype)
                fns["rms_norm"](x, w, 1e-6)
                fns["add_rms_norm"](x, x, w, 1e-6)
                fns["rope"](x[:, :, None], x, x)
                fns["qk_norm_rope"](x[:, :, None], x[:, :, None], w, w, 1e-6, x, x)
                fns["qk_rope"](x[:, :, None], x[:, :, None], x, x)
                fns["silu_mul"](x, x)
                # the samplers compile at their first call (one graph per vocabulary size)
                _COMPILED.update(fns)
            except Exception as err:  # noqa: BLE001 - any compiler failure: fall back to eager
                log.warning("torch.compile of the decode kernels failed (%s); running them eagerly", err)
                compiled = False
        self.compiled = compiled
        for name in _NAMES:
            setattr(self, name, _COMPILED[name] if compiled else globals()[name])
