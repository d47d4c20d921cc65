"""Elementwise pieces of the decoder forward and the sampler, written once in plain torch (the CPU
path, and the reference) and compiled into a few fused kernels on CUDA (fewer launches per decode
step).

Each forward function is the exact op sequence of the transformers module it replaces (the RMSNorm
in fp32 of the registry's families, ``apply_rotary_pos_emb``, SiLU-gated MLP product). The sampler
(:func:`~splitrl.rollout.sampling.draw`) is integer hashing plus a few reductions: eagerly it is
~100 tiny kernels per decode step, which at batch 1 cost more than a decoder layer; compiled, a
handful. Its integer part is exact either way. The decode steps' bookkeeping (a step's state
update, a verify's acceptance, the MTP draft window's cache indices, an attention plan's write index
and mask) is integer and boolean work of a few dozen tiny ops per step; compiled, each is one or
two kernels, which is what a batch-1 decode step pays for (its kernel count, not its bytes).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from splitrl.compile_lock import serialized
from splitrl.rollout.sampling import draw, draw_with_logprobs  # noqa: F401 - read through globals() below

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


def split_heads(qkv: torch.Tensor, nq: int, nk: int, d: int):
    """The fused q/k/v projection's output [B, M, nq + 2 nk] as (q, k, v) [B, M, heads, d] views."""
    B, M, _ = qkv.shape
    q, k, v = qkv.split([nq, nk, nk], dim=-1)
    return q.reshape(B, M, -1, d), k.reshape(B, M, -1, d), v.reshape(B, M, -1, d)


def qkv_norm_rope(qkv, nq: int, nk: int, d: int, q_weight, k_weight, eps: float, cos, sin):
    """:func:`qk_norm_rope` on the output of the fused q/k/v projection [B, M, nq + 2 nk], split into
    heads of ``d``; returns (q [B, M, nq / d, d], kv [2, B, M, nk / d, d]): keys and values in one
    contiguous tensor, so that the cache takes both in one write
    (:meth:`~splitrl.rollout.kv.StaticKVCache.write_kv`; compiled, the stacking shares the kernel of
    k's norm and rotary, which read the same buffer)."""
    q, k, v = split_heads(qkv, nq, nk, d)
    q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
    return q, torch.stack((k, v))


def qkv_rope(qkv, nq: int, nk: int, d: int, cos, sin):
    """:func:`qkv_norm_rope` without the per-head norms (Llama, Qwen2)."""
    q, k, v = split_heads(qkv, nq, nk, d)
    q, k = qk_rope(q, k, cos, sin)
    return q, torch.stack((k, v))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def embed_rms_norm(ids, emb_weight, weight, eps: float):
    """(E, rms_norm(E)), E = emb_weight[ids]: a decode forward's embeddings and its first layer's input norm."""
    h = F.embedding(ids, emb_weight)
    return h, rms_norm(h, weight, eps)


def mtp_input(
    embeds, hidden_parts: list, e_weight, e_eps: float, h_weight, h_eps: float, emb_weight=None
) -> torch.Tensor:
    """An MTP depth's input before ``fc``: cat[enorm(E), hnorm(h)] [B, Q, 2H], h = the ``hidden_parts``
    ([B, Qi, H]) concatenated along positions; E = ``embeds`` [B, Q, H], or with ``emb_weight``
    [V, H] the embedding of the token ids ``embeds`` (a list of int64 [B, Qi], concatenated)."""
    if emb_weight is not None:
        ids = torch.cat(embeds, dim=1) if len(embeds) > 1 else embeds[0]
        embeds = F.embedding(ids, emb_weight)
    h = torch.cat(hidden_parts, dim=1) if len(hidden_parts) > 1 else hidden_parts[0]
    return torch.cat([rms_norm(embeds, e_weight, e_eps), rms_norm(h, h_weight, h_eps)], dim=-1)


def verify_inputs(tokens, drafts_BD, pos, counter):
    """A verify's token ids [B, D+1] (x_n, then the drafts), their positions and response indices."""
    steps = torch.arange(drafts_BD.shape[1] + 1, device=pos.device)
    return torch.cat([tokens[:, None], drafts_BD], dim=1), pos[:, None] + steps, counter[:, None] + steps


def output_index(start, width: int, Q: int):
    """Flat indices [B*Q] of entries start[b] .. start[b]+Q-1 of rows 0..B-1 of a [*, width] buffer."""
    rows = torch.arange(start.shape[0], device=start.device)[:, None] * width
    return (rows + start[:, None] + torch.arange(Q, device=start.device)).reshape(-1)


def stop_mask(tokens: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """bool, the shape of ``tokens``: the token is one of ``stop_ids`` [n] (n may be 0)."""
    return (tokens[..., None] == stop_ids).any(-1)


def plain_commit(tokens, pos, counter, done, stopped, y, stop_ids, max_new: int) -> None:
    """A plain decode step's state update, in place on the [B] slot tensors (int64, bool): live rows
    take their sampled token ``y``, advance one position and finish on a stop token or at
    ``max_new`` tokens; done rows keep everything."""
    live = ~done
    stop = stop_mask(y, stop_ids)
    n = counter + 1
    fin = live & (stop | (n >= max_new))
    stopped |= live & stop
    counter.copy_(torch.where(live, n, counter))
    tokens.copy_(torch.where(live, y, tokens))
    pos.copy_(torch.where(live, pos + 1, pos))
    done |= fin


def spec_accept(drafts_BD, targets_BW, counter, done, stop_ids, max_new: int):
    """What a verify emits (W = D + 1 target tokens per row, ``targets_BW[:, i]`` at response index
    counter + i): a = leading drafts equal to their target, then the targets up to a (the
    correction or bonus token), cut after the first stop token and at ``max_new``.

    Returns (a [B], new counter n [B], stopped [B] (a stop token was emitted), finished [B]); done
    rows have stopped = finished = False.
    """
    D = drafts_BD.shape[1]
    steps = torch.arange(D + 1, device=targets_BW.device)
    a = (drafts_BD == targets_BW[:, :D]).long().cumprod(dim=1).sum(dim=1)
    stop = stop_mask(targets_BW, stop_ids) & (steps <= a[:, None])
    first_stop = torch.where(stop, steps, D + 1).amin(dim=1)
    live = ~done
    emit = torch.minimum(a + 1, max_new - counter)
    stopped = live & (first_stop < emit)
    emit = torch.minimum(emit, first_stop + 1)
    n = counter + emit
    return a, n, stopped, live & (stopped | (n >= max_new))


def spec_commit(
    tokens, pos, counter, done, stopped_state, drafted, accepted, reached_depth, accepted_depth,
    targets_BW, a, n, stopped, fin,
) -> None:  # fmt: skip
    """A verify's state update (in place), after :func:`spec_accept`: live rows count D drafted and
    a accepted tokens (per depth: reached, accepted), take target a as their last token and move
    a + 1 positions; done rows keep everything."""
    live = ~done
    live_l = live.long()
    D = reached_depth.shape[1]
    depth = torch.arange(D, device=a.device)
    drafted += live_l * D
    accepted += live_l * a
    reached_depth += live_l[:, None] * (a[:, None] >= depth).long()
    accepted_depth += live_l[:, None] * (a[:, None] > depth).long()
    stopped_state |= stopped
    counter.copy_(torch.where(live, n, counter))
    tokens.copy_(torch.where(live, targets_BW.gather(1, a[:, None]).squeeze(1), tokens))
    pos.copy_(torch.where(live, pos + a + 1, pos))
    done |= fin


def draft_window(p0, accepted, query_pos, depth: int, width: int, scratch: int):
    """Cache indices of MTP depth ``depth``'s entries after a verify (see :mod:`splitrl.rollout.
    drafter`): the window p0-(depth-1)+i, i < ``width``, written where valid (i <= accepted,
    position >= 0) else at ``scratch``, each reading up to itself; for depth >= 2 one more entry,
    the query at ``query_pos`` [B] (None: p0 + accepted), reading up to query_pos-(depth-1). Returns
    (positions, write indices, limits), int64 [B, width (+1)]."""
    i = torch.arange(width, device=p0.device)
    pos = p0[:, None] - (depth - 1) + i
    valid = (i <= accepted[:, None]) & (pos >= 0)
    pos = pos.clamp(min=0)
    write = torch.where(valid, pos, scratch)
    limit = pos
    if depth >= 2:
        q = (p0 + accepted if query_pos is None else query_pos)[:, None]
        pos, write, limit = torch.cat([pos, q], 1), torch.cat([write, q], 1), torch.cat([limit, q - (depth - 1)], 1)
    return pos, write, limit


def plan_tensors(
    write_pos_BQ, positions_BQ, limit_BQ, rows_B, kv_heads: int, max_len: int, length: int, position_major: bool
):
    """(flat write index int64 [B*Q*Hk], additive mask fp32 [B, 1, 1, Q, length]) of
    :meth:`splitrl.rollout.kv.StaticKVCache.plan`, for a cache layer [S, M, Hk, d]
    (``position_major``) or [S, Hk, M, d]; ``length`` 0: the index only (mask None)."""
    heads = torch.arange(kv_heads, device=write_pos_BQ.device)
    if position_major:
        flat = ((rows_B[:, None, None] * max_len + write_pos_BQ[:, :, None]) * kv_heads + heads).reshape(-1)
    else:
        flat = ((rows_B[:, None, None] * kv_heads + heads) * max_len + write_pos_BQ[:, :, None]).reshape(-1)
    if length == 0:
        return flat, None
    j = torch.arange(length, device=write_pos_BQ.device)
    allowed = (j <= limit_BQ[..., None]) | (j == positions_BQ[..., None])  # [B, Q, L]
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(~allowed, float("-inf"))
    return flat, mask[:, None, None]


def query_limits(positions_BQ, limit_BQ, length: int):
    """The per-query rule of :func:`plan_tensors` as the Triton decode kernel reads it: (limits,
    own, ends), int32 [B, Q], [B, Q], [B]. Query (b, q) reads j <= limits and j = own (-1 when its
    own index is outside the ``length`` read, as the mask has it); ends = 1 + the largest index a
    query of the row reads, clamped to [1, length]."""
    own = torch.where(positions_BQ < length, positions_BQ, -1)
    limits = limit_BQ.clamp(max=length - 1)
    ends = (torch.maximum(limits, own).amax(1) + 1).clamp(1, length)
    return limits.to(torch.int32), own.to(torch.int32), ends.to(torch.int32)


_NAMES = (
    "rms_norm", "add_rms_norm", "rope", "qk_norm_rope", "qk_rope", "qkv_norm_rope", "qkv_rope", "silu_mul",
    "draw", "draw_with_logprobs", "plain_commit", "spec_accept", "spec_commit", "draft_window", "plan_tensors",
    "query_limits",
    "embed_rms_norm", "mtp_input", "verify_inputs", "output_index",
)  # fmt: skip
_COMPILED: dict[str, object] = {}


def _warm_up(fns: dict, device, dtype) -> None:
    """One call of each compiled function on tiny inputs: a compiler failure shows here, at start-up."""
    x = torch.randn(2, 3, 8, device=device, dtype=dtype)
    w = torch.ones(8, device=device, dtype=dtype)
    fns["rms_norm"](x, w, 1e-6)
    fns["add_rms_norm"](x, x, w, 1e-6)
    fns["rope"](x[:, :, None], x, x)
    fns["qk_norm_rope"](x[:, :, None], x[:, :, None], w, w, 1e-6, x, x)
    fns["qk_rope"](x[:, :, None], x[:, :, None], x, x)
    fns["silu_mul"](x, x)
    qkv = torch.randn(2, 3, 32, device=device, dtype=dtype)
    fns["qkv_norm_rope"](qkv, 16, 8, 8, w, w, 1e-6, x, x)
    fns["qkv_rope"](qkv, 16, 8, 8, x, x)
    emb = torch.randn(5, 8, device=device, dtype=dtype)
    ids = torch.zeros(2, 3, dtype=torch.int64, device=device)
    fns["embed_rms_norm"](ids, emb, w, 1e-6)
    fns["mtp_input"](x, [x], w, 1e-6, w, 1e-6)
    fns["mtp_input"]([ids[:, :2], ids[:, :1]], [x[:, :1], x[:, :2]], w, 1e-6, w, 1e-6, emb)
    # the step bookkeeping too, so that a compiler failure falls back here rather than
    # raising inside a decode call (other shapes compile at their first use)
    i = torch.zeros(2, dtype=torch.int64, device=device)
    b = torch.zeros(2, dtype=torch.bool, device=device)
    drafts, targets, stops = i[:, None].repeat(1, 2), i[:, None].repeat(1, 3), i[:1] + 5
    fns["plain_commit"](i.clone(), i.clone(), i.clone(), b.clone(), b.clone(), i, stops, 8)
    accepted = fns["spec_accept"](drafts, targets, i, b, stops, 8)
    fns["spec_commit"](i.clone(), i.clone(), i.clone(), b.clone(), b.clone(), i.clone(), i.clone(),
                       drafts.clone(), drafts.clone(), targets, *accepted)  # fmt: skip
    pos, write, limit = fns["draft_window"](i + 4, i, i + 4, 2, 3, 15)
    fns["draft_window"](i + 4, i, None, 2, 3, 15)
    fns["plan_tensors"](write, pos, limit, i, 2, 16, 8, False)
    fns["query_limits"](pos, limit, 8)
    fns["verify_inputs"](i, drafts, i, i)
    fns["output_index"](i, 8, 3)


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
                # under inference mode, as generate runs them: Dynamo guards on the grad mode, and a
                # warm-up with gradients on made every function compile again at its first real call
                with torch.inference_mode():
                    _warm_up(fns, device, dtype)
                # the samplers compile at their first call (one graph per vocabulary size)
                _COMPILED.update(fns)
            except Exception as err:  # noqa: BLE001 - any compiler failure: fall back to eager
                log.warning("torch.compile of the decode kernels failed (%s); running them eagerly", err)
                compiled = False
        self.compiled = compiled
        for name in _NAMES:
            setattr(self, name, _COMPILED[name] if compiled else globals()[name])
