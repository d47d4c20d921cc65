"""Per-sample causal attention on packed rows without a dense [S, S] mask.

Legend: B = rows, S = positions, Hq / Hkv = query / key-value heads, Dh = head dim.

A packed row holds several samples back to back (``segment_ids`` [B, S]: 0, 1, ...; -1 =
padding). Each position attends causally within its own sample only. On CUDA this is a
FlexAttention ``BlockMask`` built directly from the sample boundaries at the granularity of
128 × 128 tiles (no [S, S] tensor is ever formed), run by the compiled flex kernel: tiles across
two samples are skipped, tiles strictly inside one sample below the diagonal run unmasked, and only
the tiles that straddle a boundary or the diagonal evaluate the per-element rule

    allowed(q, k) = doc[q] == doc[k]  and  k <= q

Padding gets a document id of its own (after the last sample), so a padding position attends to
earlier padding only; its outputs are never read. Real positions see exactly what the dense mask
of ``policy.build_attention_mask`` lets them see, so the CPU path (dense mask) and the CUDA path
compute the same function.

The Hugging Face layers pick their attention function by name from ``config._attn_implementation``;
importing this module registers a version of ``sdpa`` that runs the flex kernel when it is handed
a ``BlockMask`` and is the stock SDPA function for everything else (tensor masks, ``None``, KV
caches), so rollouts and checkpoints are unaffected.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from splitrl.compile_lock import serialized

BLOCK = 128

log = logging.getLogger(__name__)


def document_ids(segment_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] non-decreasing document ids: the sample number, padding after the last sample."""
    big = segment_ids_BS.shape[1] + 1
    return torch.where(segment_ids_BS >= 0, segment_ids_BS, torch.full_like(segment_ids_BS, big))


def document_block_mask(segment_ids_BS: torch.Tensor) -> BlockMask:
    """Per-sample causal ``BlockMask`` of packed rows (see the module docstring).

    Args:
        segment_ids_BS: [B, S] int64 sample number within each row, -1 = padding. Samples must be
            laid out contiguously (as the microbatch builder does): ids are non-decreasing over
            the real positions, padding only at the row end.

    Returns:
        A ``BlockMask`` for B rows, broadcast over heads, with tile size 128.
    """
    doc = document_ids(segment_ids_BS)
    B, S = doc.shape
    nb = (S + BLOCK - 1) // BLOCK
    pad = nb * BLOCK - S
    # padded tail positions take a document id that no real position has
    tail = torch.nn.functional.pad(doc, (0, pad), value=S + 2).view(B, nb, BLOCK)
    lo, hi = tail.min(-1).values, tail.max(-1).values  # [B, nb] (ids are non-decreasing)
    q_lo, q_hi = lo[:, :, None], hi[:, :, None]
    k_lo, k_hi = lo[:, None, :], hi[:, None, :]
    idx = torch.arange(nb, device=doc.device)
    below = idx[None, :, None] >= idx[None, None, :]  # kv tile j <= q tile i
    strictly_below = idx[None, :, None] > idx[None, None, :]
    overlap = (k_hi >= q_lo) & (k_lo <= q_hi)
    any_ = below & overlap
    full = strictly_below & (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    partial = any_ & ~full

    def to_blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = m.sum(-1).to(torch.int32)[:, None]  # [B, 1, nb]
        # tile indices of the set entries first (stable: ascending tile index)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
        return num, order

    kv_num, kv_idx = to_blocks(partial)
    full_num, full_idx = to_blocks(full)
    doc_flat = doc

    def mask_mod(b, h, q, kv):
        return (doc_flat[b, q] == doc_flat[b, kv]) & (kv <= q)

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(S, S)
    )


def packed_attention_mask(segment_ids_BS: torch.Tensor, backend: str = "flex") -> BlockMask:
    """The mask handed to the Hugging Face layers for packed rows on CUDA.

    Args:
        segment_ids_BS: [B, S] as in :func:`document_block_mask`.
        backend: ``flex`` (FlexAttention on the block mask) or ``varlen`` (the flash
            variable-length kernel, ``torch.nn.attention.varlen``, on the sample boundaries).

    Returns:
        The block mask; for ``varlen`` it also carries the boundaries (``splitrl_varlen``), read
        once per microbatch on the host (one device-to-host copy) and shared by every layer.
    """
    bm = document_block_mask(segment_ids_BS)
    if backend == "varlen":
        doc = document_ids(segment_ids_BS)
        B, S = doc.shape
        starts = torch.ones_like(doc, dtype=torch.bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        offsets = torch.arange(B, device=doc.device)[:, None] * S + torch.arange(S, device=doc.device)
        cu = torch.cat([offsets[starts], torch.tensor([B * S], device=doc.device)]).to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
        bm.splitrl_varlen = (cu, max_len)
    elif backend != "flex":
        raise ValueError(f"packed attention backend must be 'flex' or 'varlen', got {backend!r}")
    return bm


def _varlen(query, key, value, cu: torch.Tensor, max_len: int, scaling: float | None):
    from torch.nn.attention.varlen import varlen_attn

    B, Hq, S, Dh = query.shape
    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if "is_causal" in params:  # torch 2.10 / 2.11
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if key.shape[1] != Hq:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            key = key.repeat_interleave(Hq // key.shape[1], dim=1)
            value = value.repeat_interleave(Hq // value.shape[1], dim=1)
    if scaling is not None and "scale" in params:
        kw["scale"] = scaling
    elif scaling is not None and abs(scaling - Dh**-0.5) > 1e-12:
        raise ValueError("this torch's varlen_attn has no scale argument; use the flex backend")

    def flat(x):
        return x.transpose(1, 2).reshape(B * S, x.shape[1], Dh)

    out = varlen_attn(flat(query), flat(key), flat(value), cu, cu, max_len, max_len, **kw)
    return out.view(B, S, Hq, Dh)


_FLEX_FALLBACK: set[tuple[torch.dtype, int]] = set()  # (dtype, head dim) the flex compiler refused


@functools.cache
def _compiled_flex():
    # the flex kernel exists only compiled; eager flex_attention is a slow dense reference
    return serialized(torch.compile(flex_attention, dynamic=True))


def _flex(query, key, value, block_mask: BlockMask, scale: float | None):
    """The compiled flex kernel on CUDA; eager flex (the dense reference: same result, slower) on
    CPU and for inputs the flex compiler has no kernel for (fp32 on an H200 with torch 2.11: "No
    choices exist for backend"), with one warning."""
    gqa = query.shape[1] != key.shape[1]
    key_ = (query.dtype, query.shape[-1])
    if query.is_cuda and key_ not in _FLEX_FALLBACK:
        try:
            return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
        except Exception as err:  # noqa: BLE001 - only compiler failures fall back, see below
            if not type(err).__module__.startswith(("torch._inductor", "torch._dynamo")):
                raise
            _FLEX_FALLBACK.add(key_)
            log.warning(
                "the flex attention compiler has no kernel for %s with head dim %d (%s); packed rows run the "
                "eager flex reference (same result, slower); bf16 compute (train.precision: bf16) has one",
                query.dtype,
                query.shape[-1],
                str(err).strip().splitlines()[0][:200],
            )
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def flex_or_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """The transformers attention signature: q [B, Hq, S, Dh], k/v [B, Hkv, S, Dh] -> ([B, S, Hq, Dh], None).

    A ``BlockMask`` runs the compiled flex kernel; any other mask goes to the stock SDPA function.
    """
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError(
            "attention dropout is not supported with packed rows on the flex path; set attention_dropout=0"
        )
    varlen = getattr(attention_mask, "splitrl_varlen", None)
    # the flash varlen kernel exists for fp16 / bf16 only: other dtypes take the flex path (the
    # varlen mask is a BlockMask too)
    if varlen is not None and query.dtype in (torch.float16, torch.bfloat16):
        return _varlen(query, key, value, *varlen, scaling), None
    out = _flex(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


# ``sdpa`` keeps its meaning for every tensor mask; it only gains the BlockMask case
AttentionInterface.register("sdpa", flex_or_sdpa_attention)
