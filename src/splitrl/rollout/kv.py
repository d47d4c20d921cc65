"""Preallocated per-slot KV caches and the attention that reads them.

Legend: S = slots (rows the engine can hold), N = layers, Hk = key/value heads, M = cache length,
d = head dim, B = rows of a forward (slots 0..B-1), Q = new tokens per row, L = cache prefix read.

A slot's entry for position p lives at index p: no padding, no compaction. Two layouts: a cache
read by the flash kernel (below) is [N, S, M, Hk, d] (position-major within a slot), so that a
layer's cache is also a flat [S*M, Hk, d] sequence of tokens in which slot s starts at token s*M,
the layout the flash variable-length kernel reads; any other cache is [N, S, Hk, M, d]
(head-major), which the masked path reads as [B, Hk, L, d] without a copy (over a position-major
cache it reads a transposed view, which SDPA may copy first).

Two attention paths read it. The general one (any mask: the MTP depths' queries, CPU, fp32) is one
``scaled_dot_product_attention`` call over the first L indices of every row with an additive mask,
so every row pays for L, the longest row of the step. The backbone's decode step has a simple mask,
each row's Q queries at consecutive positions ending at p reading indices <= their own (a causal
block at the end of a row of length p+1); on CUDA in fp16/bf16 it runs the flash varlen kernel
with ``seqused_k`` = p+1 per row (:data:`FLASH_DECODE`), which reads each row only up to its own
length; where Triton imports, our own kernel reads the same, faster in all but one case measured
(:data:`DECODE_KERNEL`, :mod:`splitrl.rollout.decode_attention`). With continuous batching the
rows of a step have very different lengths (refilled rows are short, old rows long): the masked
path read them all up to the longest.

A query at position p attends to the indices j <= limit (its committed context, ``limit`` = p
for the backbone) and to its own index. Entries past the context may hold stale values (rejected
drafts, a finished row's leftovers): they are never read before being rewritten, because every
position is written by the forward that first makes it part of a context. Writes that must not land anywhere (invalid draft
window entries) go to the last index, ``scratch``, which no context reaches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitrl.rollout import decode_attention as _decode
from splitrl.rollout import env
from splitrl.rollout.fused import plan_tensors, query_limits

log = logging.getLogger(__name__)


def _flash_decode_available() -> bool:
    """The aten flash varlen op takes ``seqused_k`` (torch 2.11 and 2.13 do) and this build has the
    flash kernels (CUDA, not ROCm)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return (
        op is not None
        and "seqused_k" in str(op.default._schema)
        and torch.version.hip is None
        and getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    )


# Backbone decode steps on CUDA (fp16 / bf16, sm80+, head dim a multiple of 8 up to 256) read each
# row up to its own length with the flash varlen kernel; SPLITRL_FLASH_DECODE=0 keeps the masked
# SDPA path everywhere.
FLASH_DECODE = env.flag("SPLITRL_FLASH_DECODE") and _flash_decode_available()


# On the flash call (SPLITRL_DECODE_ATTENTION=flash, or few long one-query rows, below), a verify
# forward's Q > 1 queries a row are folded so that each key/value head is read once for its G query
# heads (see StaticKVCache._attend_flash). The kernel folds Q = 1 itself. SPLITRL_FLASH_FOLD:
# "verify" (Q > 1, default), "all" (Q >= 1) or "none"; the bench compares them. With the Triton
# kernel (the default on CUDA) a verify never reaches the flash call, so this has no effect there.
_FOLD_MODES = {"verify": 2, "all": 1, "none": 1 << 30}
FLASH_FOLD_MIN_Q = _FOLD_MODES[env.choice("SPLITRL_FLASH_FOLD", tuple(_FOLD_MODES), "verify")]

# Decode attention on a flash cache: "triton" runs our kernel (:mod:`splitrl.rollout.decode_attention`:
# each key/value head of a row read once for all Q*G of its queries; faster than the flash call
# (bench/RESULTS.md) except for few long one-query rows, which stay on it: ``decode_attention.preferred``;
# the default where Triton imports), "flash" the flash varlen call below. Read from
# SPLITRL_DECODE_ATTENTION; the bench compares them. The choice changes bf16 rounding, as the GEMMs'
# shapes (batch bucket, verify vs plain) already do: tokens are bit-identical across batches and
# speculation in fp32 (tested), in bf16 up to such rounding.
DECODE_KERNEL = env.choice("SPLITRL_DECODE_ATTENTION", ("triton", "flash"), "triton" if _decode.AVAILABLE else "flash")
if DECODE_KERNEL == "triton" and not _decode.AVAILABLE:
    raise ValueError("SPLITRL_DECODE_ATTENTION=triton but Triton does not import here; pip install triton or use flash")


def _disable_decode_kernel(err: Exception) -> None:
    """The Triton kernel failed to compile or launch (outside a CUDA-graph capture): the flash call
    serves every decode step of the process from now on, with a warning that says why."""
    global DECODE_KERNEL
    DECODE_KERNEL = "flash"
    log.warning(
        "the Triton decode-attention kernel failed (%r); using the flash varlen call for decode attention "
        "and the masked SDPA path for the MTP depths' draft windows (SPLITRL_DECODE_ATTENTION=flash chooses "
        "them from the start)",
        err,
    )


def _flash_runs(device, dtype: torch.dtype, head_dim: int) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if head_dim > 256 or head_dim % 8:  # other head dims would be padded: a copy of the cache per call
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def query_kernel_default(device, head_dim: int) -> bool:
    """Whether the engine's MTP cache reads its plans (not a causal block) with the Triton kernel's
    per-query limits: on CUDA where :data:`DECODE_KERNEL` is "triton" (tests patch this to run it
    under Triton's interpreter, or to compare with the masked path)."""
    return DECODE_KERNEL == "triton" and torch.device(device).type == "cuda" and head_dim <= 256


@dataclass
class AttentionPlan:
    """Write indices and the additive mask of one forward (see :meth:`StaticKVCache.plan`).

    Attributes:
        flat_index: int64 [B*Q*Hk] rows of the cache layer (in its own layout) viewed as [-1, d].
        mask: fp32 [B, 1, 1, Q, L], 0 where allowed, -inf elsewhere; None on the flash path and on the
            per-query kernel path (built there only if the kernel fails).
        length: L, the cache prefix read.
        slots: the rows' slots, or None for slots 0..B-1.
        seqused: int32 [B], the rows' lengths (last query position + 1) on the flash path, the
            entries each row's program walks on the per-query kernel path, else None.
        limits, own: int32 [B, Q] on the per-query kernel path (:func:`~splitrl.rollout.fused.
            query_limits`), else None.
        rule: (write, positions, limit, rows) of the plan on the per-query kernel path, from which
            the mask is built if the kernel fails (the masked path then serves the forward).
    """

    flat_index: torch.Tensor
    mask: torch.Tensor | None
    length: int
    slots: torch.Tensor | None
    seqused: torch.Tensor | None = None
    limits: torch.Tensor | None = None
    own: torch.Tensor | None = None
    rule: tuple | None = None
    _grouped: dict[tuple, object] = field(default_factory=dict)

    def grouped_mask(self, G: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask repeated for G query heads per key/value head, [B, 1, G*Q, L] in ``dtype``
        (0 and -inf are exact in every float dtype); built once per plan (the first layer) and
        shared by the others."""
        key = (G, dtype)
        if key not in self._grouped:
            assert self.mask is not None, "a flash plan has no mask"
            B, _, _, Q, L = self.mask.shape
            self._grouped[key] = self.mask.expand(B, 1, G, Q, L).reshape(B, 1, G * Q, L).to(dtype)
        return self._grouped[key]

    def row_sequences(self, Q: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The flash plan's rows as the kernel's sequences, (cu_seqlens_q, cu_seqlens_k) int32
        [B+1]: row b's Q queries start at b*Q, its cache at b*``max_len``; built once per plan
        (the first layer) and shared (a folded plan never builds them)."""
        key = ("rows", Q)
        if key not in self._grouped:
            assert self.seqused is not None, "only a flash plan has kernel sequences"
            n = torch.arange(self.seqused.shape[0] + 1, dtype=torch.int32, device=self.seqused.device)
            self._grouped[key] = (n * Q, n * max_len)
        return self._grouped[key]

    def folded(self, Q: int, G: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flash plan as B*Q sequences of G queries each, (cu_seqlens_q [B*Q+1], cu_seqlens_k
        [B*Q+1], seqused_k [B*Q]) int32: sequence (b, i) holds query i of row b for the G query
        heads of one key/value head and reads row b's first p_b - Q + 2 + i entries (its causal
        prefix), so no mask is needed; built once per plan (the first layer) and shared."""
        key = ("folded", Q, G)
        if key not in self._grouped:
            assert self.seqused is not None, "only a flash plan folds"
            device = self.seqused.device
            B = self.seqused.shape[0]
            n = torch.arange(B * Q + 1, dtype=torch.int32, device=device)
            i = torch.arange(Q, dtype=torch.int32, device=device)
            lengths = (self.seqused[:, None] - (Q - 1) + i).clamp(min=1).reshape(-1).to(torch.int32)
            # sequences of one row share its cache: their key ranges overlap, which the kernel allows
            # (with seqused_k it reads [cu_seqlens_k[s], cu_seqlens_k[s] + seqused_k[s]) only)
            self._grouped[key] = (n * G, (n // Q) * max_len, lengths)
        return self._grouped[key]


@dataclass
class PrefillPlan:
    """Where a prefill's entries go and the flash sequences that read them (see
    :meth:`StaticKVCache.prefill_plan`).

    Attributes:
        flat_index: int64 [B*M*Hk] rows of the cache layer (a half viewed as [-1, d]) of entry (b, m, kv head).
        length: M, the padded prompt length.
        cu_q, cu_k: int32 [B+1], the rows' query offsets (b*M) and cache offsets (slot*max_len).
        seqused: int32 [B], M for every row (the causal mask hides the padding from real tokens).
    """

    flat_index: torch.Tensor
    length: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    seqused: torch.Tensor


class StaticKVCache:
    """Keys and values of ``num_layers`` attention layers for ``slots`` rows of ``max_len`` positions.

    Args:
        num_layers, slots, kv_heads, max_len, head_dim: the shape [N, S, M, Hk, d] (flash) or
            [N, S, Hk, M, d].
        dtype, device: of the tensors (the model's compute dtype).
        flash: read causal plans with the flash varlen kernel where it runs (default
            :data:`FLASH_DECODE`; CUDA sm80+, fp16 / bf16, head dim a multiple of 8 up to 256).
            A flash cache is position-major, which the kernel needs.
        position_major: the layout, when not chosen by ``flash`` (tests build a position-major
            cache on the CPU; the masked path reads either).
        query_kernel: read plans that are not a causal block (rows 0..B-1) with the Triton kernel's
            per-query limits instead of the masked path, while :data:`DECODE_KERNEL` is "triton"
            (the engine's MTP cache, where :func:`query_kernel_default` says so).

    Attributes:
        kv: [2, N, S, M, Hk, d] or [2, N, S, Hk, M, d], keys then values in one tensor
            (:meth:`write_kv` writes both with one copy).
        k, v: ``kv[0]``, ``kv[1]``: views; modify them in place, never rebind them (CUDA graphs
            and :meth:`write_kv` hold the storage of ``kv``).
    """

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype,
        device,
        flash: bool | None = None,
        position_major: bool | None = None,
        query_kernel: bool = False,
    ) -> None:
        self.flash = bool((FLASH_DECODE if flash is None else flash) and _flash_runs(device, dtype, head_dim))
        if position_major is not None and self.flash and not position_major:
            raise ValueError("a flash cache is position-major")
        self.position_major = self.flash if position_major is None else position_major
        if self.position_major:
            shape = (num_layers, slots, max_len, kv_heads, head_dim)
        else:
            shape = (num_layers, slots, kv_heads, max_len, head_dim)
        # keys and values in one allocation: a decode step writes both with one index_copy_ a
        # layer (write_kv), half the launches of two (their cost: bench/RESULTS.md)
        self.kv = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.k, self.v = self.kv[0], self.kv[1]
        # plans with any mask (the MTP draft windows) read by the Triton kernel with per-query limits
        # rather than a masked SDPA call (CUDA; the kernel takes either layout through its strides)
        self.query_kernel = bool(query_kernel)
        self.slots, self.max_len, self.kv_heads = slots, max_len, kv_heads

    @property
    def scratch(self) -> int:
        return self.max_len - 1

    def write_prefix(self, layer: int, slot_ids: torch.Tensor, k_BMHd: torch.Tensor, v_BMHd: torch.Tensor) -> None:
        """Positions 0..M'-1 of the slots ``slot_ids`` [B] (a prefill)."""
        M = k_BMHd.shape[1]
        if self.position_major:
            self.k[layer, :, :M].index_copy_(0, slot_ids, k_BMHd)
            self.v[layer, :, :M].index_copy_(0, slot_ids, v_BMHd)
        else:
            self.k[layer, :, :, :M].index_copy_(0, slot_ids, k_BMHd.transpose(1, 2))
            self.v[layer, :, :, :M].index_copy_(0, slot_ids, v_BMHd.transpose(1, 2))

    def plan(
        self,
        write_pos_BQ: torch.Tensor,
        positions_BQ: torch.Tensor,
        limit_BQ: torch.Tensor,
        length: int,
        slots_B: torch.Tensor | None = None,
        causal: bool = False,
        kernels=None,
    ) -> AttentionPlan:
        """Where a forward's Q entries per row go and what each may read (shared by all layers).

        Entry (b, q) is written to slot b (or ``slots_B[b]``) at index ``write_pos_BQ[b, q]``; as a
        query it reads the first ``length`` indices j with j <= ``limit_BQ[b, q]`` or
        j = ``positions_BQ[b, q]`` (its own entry). At least one index must be allowed (``limit``
        >= 0, or the own entry within ``length``).

        ``causal=True`` is the caller's promise that the three index tensors are equal and each row's
        are consecutive (p-Q+1..p, p < ``length``), rows being slots 0..B-1: the backbone's decode.
        Such a plan runs on the flash path where the cache has one (:attr:`flash`). Any other plan of
        rows 0..B-1 (``slots_B`` None) runs on the Triton kernel's per-query limits where the cache
        was built with ``query_kernel`` (the MTP depths' draft windows), else on the masked path.
        ``kernels``: a :class:`~splitrl.rollout.fused.Kernels` whose (compiled) ``plan_tensors``
        builds the index and mask.
        """
        B = write_pos_BQ.shape[0]
        rows = torch.arange(B, device=write_pos_BQ.device) if slots_B is None else slots_B
        flash = causal and self.flash and slots_B is None
        per_query = not flash and slots_B is None and self.query_kernel and DECODE_KERNEL == "triton"
        fn = plan_tensors if kernels is None else kernels.plan_tensors
        flat, mask = fn(
            write_pos_BQ, positions_BQ, limit_BQ, rows, self.kv_heads, self.max_len,
            0 if flash or per_query else length, self.position_major,
        )  # fmt: skip
        if per_query:
            limits, own, ends = (query_limits if kernels is None else kernels.query_limits)(
                positions_BQ, limit_BQ, length
            )
            rule = (write_pos_BQ, positions_BQ, limit_BQ, rows)
            return AttentionPlan(flat, None, length, None, ends, limits, own, rule)
        if flash:
            # clamped: a slot of the bucket that holds no row may carry a stale position
            seqused = (limit_BQ[:, -1] + 1).clamp(1, length).to(torch.int32)
            return AttentionPlan(flat, None, length, None, seqused)
        return AttentionPlan(flat, mask, length, slots_B)

    def prefill_plan(self, slots_B: torch.Tensor, M: int) -> PrefillPlan:
        """The cache rows and flash sequences of a prefill of positions 0..M-1 into the slots
        ``slots_B`` (ascending; a position-major cache: :attr:`flash`), shared by all layers."""
        device = slots_B.device
        heads = torch.arange(self.kv_heads, device=device)
        start = slots_B * self.max_len
        flat = (((start[:, None] + torch.arange(M, device=device)) * self.kv_heads)[..., None] + heads).reshape(-1)
        n = slots_B.shape[0]
        cu_q = torch.arange(n + 1, device=device, dtype=torch.int32) * M
        # row b's entries start at its slot's first token in the flat [S*max_len, Hk, d] view; the
        # sequence count's closing offset is past the last slot
        cu_k = torch.cat([start, start[-1:] + self.max_len]).to(torch.int32)
        seqused = torch.full((n,), M, dtype=torch.int32, device=device)
        return PrefillPlan(flat, M, cu_q, cu_k, seqused)

    def attend_prefill(self, layer: int, q_BMHd: torch.Tensor, plan: PrefillPlan, scale: float) -> torch.Tensor:
        """Causal attention of a prefill's queries [B, M, H, d] over the entries its forward wrote to
        this layer (:meth:`prefill_plan`), read in place by the flash varlen kernel (grouped heads
        natively: no repeated copy of the keys and values). Right-padded prompts never read their
        padding (causal). Returns [B, M, H * d]."""
        B, M, H, d = q_BMHd.shape
        Hk = self.kv_heads
        k, v = self.k[layer].view(-1, Hk, d), self.v[layer].view(-1, Hk, d)
        out = flash_varlen(q_BMHd.reshape(B * M, H, d), k, v, plan.cu_q, plan.cu_k, M, M, True, scale, plan.seqused)
        return out.view(B, M, H * d)

    def write(self, layer: int, plan: AttentionPlan, k_BQHd: torch.Tensor, v_BQHd: torch.Tensor) -> None:
        """Store a forward's keys and values where ``plan`` says (graph-safe: one index_copy_ each)."""
        d = k_BQHd.shape[-1]
        self.k[layer].view(-1, d).index_copy_(0, plan.flat_index, k_BQHd.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, plan.flat_index, v_BQHd.reshape(-1, d))

    def write_kv(self, layer: int, plan: AttentionPlan, kv_2BQHd: torch.Tensor) -> None:
        """:meth:`write` of keys and values stacked in one contiguous tensor [2, B, Q, Hk, d]: one
        index_copy_ for both (the same entries as :meth:`write`)."""
        d = kv_2BQHd.shape[-1]
        self.kv[:, layer].view(2, -1, d).index_copy_(1, plan.flat_index, kv_2BQHd.view(2, -1, d))

    def attend(self, layer: int, q_BQHd: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
        """Attention of the queries of slots 0..B-1 (or ``plan.slots``, then with a copy) over
        their first ``plan.length`` entries, masked as :meth:`plan` says.

        Heads are grouped as in transformers' ``repeat_kv`` (query head h reads kv head h // G); the
        G query heads of a kv head are folded into the query dimension, so one
        ``scaled_dot_product_attention`` call (one fused kernel on CUDA, softmax in fp32) reads
        each key and value once, without repeating them.

        A flash plan (``plan.seqused`` set) runs the flash varlen kernel instead: row b's Q queries are
        a causal block at the end of its first ``seqused[b]`` entries, read in place; or our Triton
        kernel, which reads the same (:data:`DECODE_KERNEL`).

        Returns:
            [B, Q, H * d] in the query's dtype.
        """
        B, Q, H, d = q_BQHd.shape
        length = plan.length
        if plan.limits is not None:
            out = self._attend_per_query(layer, q_BQHd, plan, scale)
            if out is not None:
                return out
        elif plan.seqused is not None:
            return self._attend_flash(layer, q_BQHd, plan, scale)
        rows = slice(0, B) if plan.slots is None else plan.slots  # slots: a copy of those rows
        if self.position_major:
            k = self.k[layer][rows, :length].transpose(1, 2)  # [B, Hk, L, d]
            v = self.v[layer][rows, :length].transpose(1, 2)
        else:
            k = self.k[layer][rows, :, :length]  # [B, Hk, L, d], a view for slots 0..B-1
            v = self.v[layer][rows, :, :length]
        Hk = k.shape[1]
        G = H // Hk
        q = q_BQHd.view(B, Q, Hk, G, d).permute(0, 2, 3, 1, 4).reshape(B, Hk, G * Q, d)
        if plan.mask is None:  # a per-query plan whose kernel failed: build the mask once (all layers)
            plan.mask = plan_tensors(*plan.rule, self.kv_heads, self.max_len, length, self.position_major)[1]
        mask = plan.grouped_mask(G, q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, Hk, G*Q, d]
        return out.view(B, Hk, G, Q, d).permute(0, 3, 1, 2, 4).reshape(B, Q, H * d)

    def _attend_per_query(
        self, layer: int, q_BQHd: torch.Tensor, plan: AttentionPlan, scale: float
    ) -> torch.Tensor | None:
        """The Triton kernel on a per-query plan; None if it failed outside a CUDA-graph capture
        (the caller's masked path serves this and every later forward, with a warning)."""
        if DECODE_KERNEL == "triton":
            k, v = self.k[layer], self.v[layer]
            if not self.position_major:  # [S, Hk, M, d] read as [S, M, Hk, d] through the strides
                k, v = k.transpose(1, 2), v.transpose(1, 2)
            try:
                return _decode.decode_attention(q_BQHd, k, v, plan.seqused, scale, plan.limits, plan.own)
            except Exception as err:  # noqa: BLE001 - a GPU / shape Triton cannot compile for
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                _disable_decode_kernel(err)
        return None

    def _attend_flash(self, layer: int, q_BQHd: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
        B, Q, H, d = q_BQHd.shape
        Hk = self.kv_heads
        G = H // Hk
        if DECODE_KERNEL == "triton" and _decode.preferred(B, Hk, plan.length, Q):
            try:
                return _decode.decode_attention(q_BQHd, self.k[layer], self.v[layer], plan.seqused, scale)
            except Exception as err:  # noqa: BLE001 - a GPU / shape Triton cannot compile for
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise  # the engine's warm-up steps run before any capture, so this is not the first call
                _disable_decode_kernel(err)
        if G > 1 and Q >= FLASH_FOLD_MIN_Q:
            # unfolded, the kernel reads each key/value head once per query head (G times) and fills a
            # 64/128-row query tile with Q rows; folded, G*1 queries share one read of the prefix
            cu_q, cu_k, lengths = plan.folded(Q, G, self.max_len)
            q = q_BQHd.view(B, Q, Hk, G, d).transpose(2, 3).reshape(B * Q * G, Hk, d)
            k, v = self.k[layer].view(-1, Hk, d), self.v[layer].view(-1, Hk, d)
            out = flash_varlen(q, k, v, cu_q, cu_k, G, plan.length, False, scale, lengths)
            return out.view(B, Q, G, Hk, d).transpose(2, 3).reshape(B, Q, H * d)
        # slot b's tokens start at b*M in the flat [S*M, Hk, d] view; seqused_k cuts each row at its
        # length, and the causal mask is aligned to that end (query q sits at seqused - Q + q)
        k, v = self.k[layer].view(-1, Hk, d), self.v[layer].view(-1, Hk, d)
        q = q_BQHd.reshape(B * Q, H, d)
        cu_q, cu_k = plan.row_sequences(Q, self.max_len)
        out = flash_varlen(q, k, v, cu_q, cu_k, Q, plan.length, True, scale, plan.seqused)
        return out.view(B, Q, H * d)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` [n] to ``dst`` [n] (all layers, all positions)."""
        for t in (self.k, self.v):  # one at a time: the gathered temporary is half as large
            t[:, dst] = t[:, src]


def flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q: int, max_k: int, causal: bool, scale: float, seqused_k):
    """The flash variable-length kernel: sequence s's queries q[cu_seqlens_q[s]:cu_seqlens_q[s+1]]
    ([T_q, H, d]) attend to k/v[cu_seqlens_k[s] : cu_seqlens_k[s] + seqused_k[s]] ([T_k, Hk, d]),
    with the causal mask aligned to the end when ``causal``. Returns [T_q, H, d]. (One name for
    the op, so that CPU tests can put a reference in its place.)"""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=seqused_k
    )[0]


def causal_attention(q_BMHd: torch.Tensor, k_BMHd: torch.Tensor, v_BMHd: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of a right-padded prefill (real tokens never see the padding after them).

    Returns [B, M, H * d].
    """
    B, M, H, d = q_BMHd.shape
    G = H // k_BMHd.shape[2]
    q = q_BMHd.transpose(1, 2)
    k = k_BMHd.transpose(1, 2).repeat_interleave(G, dim=1)
    v = v_BMHd.transpose(1, 2).repeat_interleave(G, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(B, M, H * d)
