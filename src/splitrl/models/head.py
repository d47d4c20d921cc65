"""The output head without the full logits: target logprobs and the MTP distillation term.

Legend: N = flattened positions, H = hidden size, V = vocabulary, C = positions per chunk.

The output head is one autograd node that walks the positions in chunks of C: the forward keeps
only per-position statistics (logprob, entropy, log-normalizer, argmax hit), and the backward
recomputes each chunk's logits [C, V] and turns them straight into the logits' gradient. At no
time does more than one chunk of logits exist, and no per-chunk autograd graph is recorded, so a
150 k-token vocabulary trains on long rows without an [N, V] fp32 tensor.

Per position, with z = (h · Wᵀ) / T upcast to fp32 and p = softmax(z):

    logprob(t) = z_t − logsumexp(z)
    entropy    = −Σ_v p_v log p_v
    ∂logprob(t)/∂z_v = [v = t] − p_v
    ∂entropy/∂z_v    = −p_v (log p_v + entropy)

(the entropy gradient is the standard one of −Σ p log p under z ↦ softmax(z)). Logits are
computed in the compute dtype (bf16 under autocast, exactly as ``F.linear`` under autocast does) and
upcast to fp32 before any reduction; the weight gradient is accumulated in fp32 across chunks.

On CUDA the per-chunk elementwise work (softmax statistics in the forward, the logits' gradient
in the backward) is compiled into fused kernels when :func:`set_fused_kernels` is on; the CPU
path runs the same functions eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitrl.compile_lock import serialized

_USE_COMPILED = {"enabled": True}


def set_fused_kernels(enabled: bool) -> None:
    """Compile the per-chunk softmax statistics and gradients on CUDA (default on; CPU never compiles)."""
    _USE_COMPILED["enabled"] = bool(enabled)


def _stats(z_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float, with_entropy: bool):
    z = z_CV.to(torch.promote_types(z_CV.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, targets_C[:, None]).squeeze(-1) - lse
    if with_entropy:
        logp = z - lse[:, None]
        ent = -(logp.exp() * logp).sum(-1)
    else:
        ent = torch.zeros_like(lse)
    hit = (z.argmax(-1) == targets_C).float()
    return lp, ent, hit, lse


def _grad_logits(
    z_CV: torch.Tensor,
    targets_C: torch.Tensor,
    lse_C: torch.Tensor,
    ent_C: torch.Tensor,
    g_lp_C: torch.Tensor,
    g_ent_C: torch.Tensor,
    temperature: float,
    with_entropy: bool,
):
    z = z_CV.to(torch.promote_types(z_CV.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    logp = z - lse_C[:, None]
    p = logp.exp()
    if with_entropy:
        g = -p * (g_lp_C[:, None] + g_ent_C[:, None] * (logp + ent_C[:, None]))
    else:
        g = -p * g_lp_C[:, None]
    onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == targets_C[:, None]
    g = g + onehot * g_lp_C[:, None]
    if temperature != 1.0:
        g = g / temperature  # dz/dlogits = 1/T
    return g.to(z_CV.dtype)


def _distill_stats(zs_CV: torch.Tensor, zt_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float):
    f32 = torch.promote_types(zs_CV.dtype, torch.float32)
    zs = zs_CV.to(f32) / temperature
    zt = zt_CV.to(f32) / temperature
    lse_s = torch.logsumexp(zs, dim=-1)
    lse_t = torch.logsumexp(zt, dim=-1)
    logp = zt - lse_t[:, None]
    kl = (logp.exp() * (logp - (zs - lse_s[:, None]))).sum(-1)
    hit = (zs.argmax(-1) == targets_C).float()
    return kl, hit, lse_s, lse_t


def _distill_grad(zs_CV, zt_CV, lse_s_C, lse_t_C, g_kl_C, temperature: float):
    f32 = torch.promote_types(zs_CV.dtype, torch.float32)
    q = (zs_CV.to(f32) / temperature - lse_s_C[:, None]).exp()
    p = (zt_CV.to(f32) / temperature - lse_t_C[:, None]).exp()
    return ((q - p) * (g_kl_C[:, None] / temperature)).to(zs_CV.dtype)


_COMPILED: dict[str, object] = {}


def _kernel(name: str, device: torch.device):
    fn = {"stats": _stats, "grad": _grad_logits, "distill_stats": _distill_stats, "distill_grad": _distill_grad}[name]
    if device.type != "cuda" or not _USE_COMPILED["enabled"]:
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = serialized(torch.compile(fn, dynamic=True))
    return _COMPILED[name]


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature, with_entropy, chunk_size, compute_dtype):
        h = hidden_NH.to(compute_dtype)
        w = weight_VH.to(compute_dtype)
        N = h.shape[0]
        f32 = dict(dtype=torch.promote_types(compute_dtype, torch.float32), device=h.device)
        lp, ent, hit, lse = (torch.empty(N, **f32) for _ in range(4))
        stats = _kernel("stats", h.device)
        for s in range(0, N, chunk_size):
            e = min(N, s + chunk_size)
            z = F.linear(h[s:e], w)
            lp[s:e], ent[s:e], hit[s:e], lse[s:e] = stats(z, targets_N[s:e], temperature, with_entropy)
        ctx.save_for_backward(h, w, targets_N, lse, ent)
        ctx.cfg = (temperature, with_entropy, chunk_size, hidden_NH.dtype, weight_VH.dtype)
        ctx.mark_non_differentiable(hit)
        return lp, ent, hit

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_hit):
        h, w, targets, lse, ent = ctx.saved_tensors
        temperature, with_entropy, chunk_size, h_dtype, w_dtype = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N = h.shape[0]
        acc = lse.dtype  # fp32 (fp64 when computing in fp64)
        g_lp = torch.zeros(N, dtype=acc, device=h.device) if g_lp is None else g_lp.to(acc)
        g_ent = torch.zeros(N, dtype=acc, device=h.device) if g_ent is None else g_ent.to(acc)
        dh = torch.empty(N, h.shape[1], dtype=h_dtype, device=h.device) if need_h else None
        dw = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        grad = _kernel("grad", h.device)
        for s in range(0, N, chunk_size):
            e = min(N, s + chunk_size)
            z = F.linear(h[s:e], w)
            gz = grad(z, targets[s:e], lse[s:e], ent[s:e], g_lp[s:e], g_ent[s:e], temperature, with_entropy)
            if need_h:
                dh[s:e] = gz @ w
            if need_w:
                dw += (gz.t() @ h[s:e]).to(acc)
        return dh, (dw.to(w_dtype) if need_w else None), None, None, None, None, None


def _head_settings(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, temperature: float, chunk_size: int | None):
    """(device type, compute dtype, chunk size) of a chunked head call: logits in the autocast dtype
    when autocast is on, else in the inputs' promoted dtype; 4096 positions a chunk on CUDA, 2048
    elsewhere unless given. Raises ValueError for ``temperature`` <= 0."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define logprobs, got {temperature}")
    dev = hidden_NH.device.type
    if torch.is_autocast_enabled(dev):
        compute_dtype = torch.get_autocast_dtype(dev)
    else:
        compute_dtype = torch.promote_types(hidden_NH.dtype, weight_VH.dtype)
    return dev, compute_dtype, chunk_size or (4096 if dev == "cuda" else 2048)


def target_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob of each target under softmax(hidden @ weightᵀ / temperature).

    Args:
        hidden_NH: [N, H] hidden states (any float dtype).
        weight_VH: [V, H] output-head weight.
        targets_N: [N] int64 target ids in [0, V).
        temperature: sampling temperature T (DESIGN §5: logprobs are of logits / T).
        with_entropy: also return the entropy of each distribution (differentiable).
        chunk_size: positions per chunk (default: 4096 on CUDA, 2048 elsewhere). Only memory and
            the summation order of the weight gradient depend on it.

    Returns:
        (logprobs [N] fp32, entropy [N] fp32 (zeros unless ``with_entropy``),
        hit [N] fp32 — 1.0 where argmax == target, not differentiable). Logits are computed in the
        autocast dtype when autocast is on, else in ``hidden_NH``'s dtype, and reduced in fp32.

    Raises:
        ValueError: ``temperature`` <= 0.
    """
    dev, compute_dtype, chunk_size = _head_settings(hidden_NH, weight_VH, temperature, chunk_size)
    with torch.autocast(dev, enabled=False):
        return _ChunkedHead.apply(
            hidden_NH, weight_VH, targets_N, float(temperature), with_entropy, chunk_size, compute_dtype
        )


class _ChunkedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_NH, teacher_NH, weight_VH, targets_N, temperature, chunk_size, compute_dtype):
        hs = student_NH.to(compute_dtype)
        ht = teacher_NH.detach().to(compute_dtype)
        w = weight_VH.to(compute_dtype)
        N = hs.shape[0]
        f32 = dict(dtype=torch.promote_types(compute_dtype, torch.float32), device=hs.device)
        kl, hit, lse_s, lse_t = (torch.empty(N, **f32) for _ in range(4))
        stats = _kernel("distill_stats", hs.device)
        for s in range(0, N, chunk_size):
            e = min(N, s + chunk_size)
            kl[s:e], hit[s:e], lse_s[s:e], lse_t[s:e] = stats(
                F.linear(hs[s:e], w), F.linear(ht[s:e], w), targets_N[s:e], temperature
            )
        ctx.save_for_backward(hs, ht, w, lse_s, lse_t)
        ctx.cfg = (temperature, chunk_size, student_NH.dtype, weight_VH.dtype)
        ctx.mark_non_differentiable(hit)
        return kl, hit

    @staticmethod
    def backward(ctx, g_kl, _g_hit):
        hs, ht, w, lse_s, lse_t = ctx.saved_tensors
        temperature, chunk_size, h_dtype, w_dtype = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        N = hs.shape[0]
        acc = lse_s.dtype
        g_kl = torch.zeros(N, dtype=acc, device=hs.device) if g_kl is None else g_kl.to(acc)
        dh = torch.empty(N, hs.shape[1], dtype=h_dtype, device=hs.device) if need_h else None
        dw = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        grad = _kernel("distill_grad", hs.device)
        for s in range(0, N, chunk_size):
            e = min(N, s + chunk_size)
            gz = grad(F.linear(hs[s:e], w), F.linear(ht[s:e], w), lse_s[s:e], lse_t[s:e], g_kl[s:e], temperature)
            if need_h:
                dh[s:e] = gz @ w
            if need_w:
                dw += (gz.t() @ hs[s:e]).to(acc)
        return dh, None, (dw.to(w_dtype) if need_w else None), None, None, None, None


def distill_kl(
    student_NH: torch.Tensor,
    teacher_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p̄ ‖ q) per position, the MTP distillation term of DESIGN §3.

    With z_s = student · Wᵀ / T, z_t = teacher · Wᵀ / T (fp32 reductions), q = softmax(z_s) and
    p̄ = softmax(z_t) treated as a constant (the teacher gets no gradient, whatever its
    ``requires_grad``):

        KL(t)      = Σ_v p̄_v (log p̄_v − log q_v)
        ∂KL/∂z_s,v = q_v − p̄_v               (so ∂KL/∂logits = (q − p̄) / T)

    T is the rollout temperature: speculative acceptance compares the draft's and the policy's
    distributions at T. Like :func:`target_logprobs`, only one chunk of logits (student and
    teacher) exists at a time; the backward recomputes both.

    Args:
        student_NH: [N, H] the MTP depth's hidden states h^k (after its final norm).
        teacher_NH: [N, H] the backbone's h⁰ at the target's predicting position (t + k).
        weight_VH: [V, H] the output head (its gradient comes from the student side only).
        targets_N: [N] int64 sampled target ids, for the teacher-forced hit (argmax of q).
        temperature: T > 0.
        chunk_size: positions per chunk (default: 4096 on CUDA, 2048 elsewhere).

    Returns:
        (kl [N] fp32, differentiable w.r.t. ``student_NH`` and ``weight_VH``;
        hit [N] fp32, 1.0 where argmax q == target, not differentiable).

    Raises:
        ValueError: ``temperature`` <= 0.
    """
    dev, compute_dtype, chunk_size = _head_settings(student_NH, weight_VH, temperature, chunk_size)
    with torch.autocast(dev, enabled=False):
        return _ChunkedDistill.apply(
            student_NH, teacher_NH, weight_VH, targets_N, float(temperature), chunk_size, compute_dtype
        )
