"""Per-sample randomness and the sampling rules of the rollout engine.

Legend: B = rows, V = vocabulary.

Every random number is a pure function of (seed, counter, stream, column): the sample's seed, the
response index of the token being decided, a stream id naming the decision (target sample, draft,
accept test) and, for whole-vocabulary draws, the vocabulary column. A sample's tokens therefore
depend only on its own seed and its own logits, never on which other prompts share the batch or
on how many forwards produced them, and no generator state has to be carried or restored.

Tokens are drawn with the exponential race (equivalently the Gumbel-max trick): the token is
argmax_i log w_i - log E_i with E_i ~ Exp(1), which picks i with probability w_i / Σ w. Unlike an
inverse-CDF draw it needs no cumulative sum, so tail tokens of a large vocabulary keep their
probability instead of being rounded away against a fp32 running total. The race runs on two
levels (blocks, then tokens in the chosen block), so it hashes ~2·sqrt(V) numbers per row, not V.

The hash is 32-bit (murmur3's finalizer); products are split so that every intermediate fits in a
non-negative int64, where torch's integer arithmetic is well defined on every device.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F

STREAM_TARGET = 0  # the token at a response index (plain and speculative decoding, and the drafts)
STREAM_DRAFT = 1  # spare streams (earlier rejection-sampling rule: draft and accept test)
STREAM_ACCEPT = 2

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32 without leaving the non-negative int64 range."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def sample_seed(run_seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample, from the run seed, prompt index and sample index (DESIGN §4)."""
    h = hashlib.blake2b(f"{run_seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def seed_words(seeds: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split Python ints (taken mod 2^64) into low and high 32-bit words, int64 [B] each."""
    s = [int(x) % (1 << 64) for x in seeds]
    lo = torch.tensor([x & _M32 for x in s], dtype=torch.int64, device=device)
    hi = torch.tensor([x >> 32 for x in s], dtype=torch.int64, device=device)
    return lo, hi


def _keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    # Each stage is a bijection of one input for fixed others: distinct counters (or seeds) of one
    # sample never share a key.
    k = _fmix32(torch.full_like(counter, (stream * _GOLDEN) & _M32) ^ (counter & _M32))
    k = _fmix32(k ^ seed_hi)
    return _fmix32(k ^ seed_lo)


def _to_uniform(h: torch.Tensor) -> torch.Tensor:
    # 24 bits, offset by half a step: exactly representable in fp32 and strictly inside (0, 1).
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    """One uniform in (0, 1) per element of ``counter`` (fp32, ``counter``'s shape).

    ``seed_lo`` / ``seed_hi`` broadcast against ``counter`` (e.g. [B, 1] against [B, D]).
    """
    lo, hi, c = torch.broadcast_tensors(seed_lo, seed_hi, counter)
    return _to_uniform(_keys(lo, hi, c, stream))


_COLUMN_KEYS: dict[tuple[int, str], torch.Tensor] = {}


def _column_keys(vocab: int, device: torch.device) -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _COLUMN_KEYS:
        cols = torch.arange(vocab, dtype=torch.int64, device=device)
        _COLUMN_KEYS[key] = _fmix32(_fmix32(cols ^ _GOLDEN))
    return _COLUMN_KEYS[key]


def _race(log_weights_BN: torch.Tensor, row_keys_B: torch.Tensor, column_keys_BN: torch.Tensor) -> torch.Tensor:
    """argmax of log w + Gumbel noise, the noise of element (b, n) hashed from its two keys."""
    u = _to_uniform(_fmix32(row_keys_B[:, None] ^ column_keys_BN))
    return (log_weights_BN - torch.log(-torch.log(u))).argmax(-1)


def race_sample(
    log_weights_BV: torch.Tensor,
    seed_lo_B: torch.Tensor,
    seed_hi_B: torch.Tensor,
    counter_B: torch.Tensor,
    stream: int,
    column_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row with probability proportional to exp(log_weights).

    Two levels keep the hashing small: a race over blocks of about sqrt(V) tokens weighted by their
    total weight picks a block, a race inside it picks the token; P(token) = W_block / W · w / W_block.

    Args:
        log_weights_BV: [B, V] fp32 unnormalized log-weights; -inf excludes a token (each row needs
            at least one finite entry).
        seed_lo_B, seed_hi_B: [B] int64 seed words (:func:`seed_words`).
        counter_B: [B] int64 response index of the token being drawn.
        stream: which decision this is (``STREAM_*``).
        column_keys: :func:`column_keys` of V (looked up when None; pass it from compiled code).

    Returns:
        [B] int64 token ids.
    """
    return _race_with_total(log_weights_BV, seed_lo_B, seed_hi_B, counter_B, stream, column_keys)[0]


def _race_with_total(
    log_weights_BV: torch.Tensor,
    seed_lo_B: torch.Tensor,
    seed_hi_B: torch.Tensor,
    counter_B: torch.Tensor,
    stream: int,
    column_keys: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`race_sample`'s tokens (int64 [B]) and each row's log W = logsumexp(log_weights)
    (``log_weights``' dtype, [B]), the latter from the block weights the race needs anyway.

    Each block's log-weight is taken relative to the block's own maximum, m_b + log Σ exp(x - m_b),
    rather than to the row's: the max and the sum then reduce over the same (last) axis of the
    [B, blocks, block] view, which a compiler fuses into one read of the logits, and log W is a
    logsumexp over ~sqrt(V) block weights instead of another read of all V. The block race only
    depends on the block weights up to a common factor, so this changes rounding, not the
    distribution.
    """
    B, V = log_weights_BV.shape
    block = _block(V)
    num_blocks = -(-V // block)
    if column_keys is None:
        column_keys = _column_keys(num_blocks * block, log_weights_BV.device)
    padded = F.pad(log_weights_BV, (0, num_blocks * block - V), value=float("-inf")).view(B, num_blocks, block)
    block_max = padded.amax(-1)  # [B, num_blocks]
    # an all -inf block (padding, filtered tokens) shifted by -inf would give -inf - -inf = NaN;
    # shifted by 0 its weight is log 0 = -inf, so the race never picks it
    shift = block_max.masked_fill(block_max == float("-inf"), 0.0)
    block_log_weights = shift + (padded - shift[..., None]).exp().sum(-1).log()  # [B, num_blocks]
    block_keys = _keys(seed_lo_B, seed_hi_B, counter_B, 2 * stream)
    chosen = _race(block_log_weights, block_keys, column_keys[:num_blocks].expand(B, -1))
    inside = padded[torch.arange(B, device=padded.device), chosen]  # [B, block]
    token_ids = chosen[:, None] * block + torch.arange(block, device=padded.device)
    token_keys = _keys(seed_lo_B, seed_hi_B, counter_B, 2 * stream + 1)
    tokens = token_ids.gather(1, _race(inside, token_keys, column_keys[token_ids])[:, None]).squeeze(1)
    return tokens, block_log_weights.logsumexp(-1)


def column_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """The per-column hash keys :func:`race_sample` uses for a vocabulary of ``vocab`` tokens
    (int64 [ceil(V / block) · block]); built once per (vocab, device). Get them before a CUDA
    graph capture, which must not allocate tensors that outlive it."""
    block = _block(vocab)
    return _column_keys(-(-vocab // block) * block, device)


def _block(V: int) -> int:
    return max(1, math.isqrt(V - 1) + 1) if V > 1 else 1


def draw(
    logits_NV: torch.Tensor,
    seed_lo_N: torch.Tensor,
    seed_hi_N: torch.Tensor,
    counter_N: torch.Tensor,
    top_k: int,
    top_p: float,
    column_keys: torch.Tensor,
) -> torch.Tensor:
    """The target-stream token of each row of ``logits_NV`` (fp32, or the head's bf16 / fp16 output:
    upcast here, which compiled is part of the sampler's first kernel instead of a copy of its own)
    after top-k / top-p: int64 [N]."""
    logits_NV = logits_NV.float()
    return race_sample(
        filter_logits(logits_NV, top_k, top_p), seed_lo_N, seed_hi_N, counter_N, STREAM_TARGET, column_keys
    )


def draw_with_logprobs(
    logits_NV: torch.Tensor,
    seed_lo_N: torch.Tensor,
    seed_hi_N: torch.Tensor,
    counter_N: torch.Tensor,
    top_k: int,
    top_p: float,
    column_keys: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draw`, plus each token's logprob under the unfiltered softmax(logits) (DESIGN §5):
    (int64 [N], fp32 [N]).

    Unfiltered, the race already sums the row's weight, so its normalizer comes with the token and
    the logits are read once; filtered, the race sums only the kept tokens and the unfiltered
    normalizer is a reduction of its own.
    """
    logits_NV = logits_NV.float()
    if 0 < top_k < logits_NV.shape[-1] or top_p < 1.0:  # filter_logits is not a no-op
        y = draw(logits_NV, seed_lo_N, seed_hi_N, counter_N, top_k, top_p, column_keys)
        log_total = logits_NV.logsumexp(-1)
    else:
        y, log_total = _race_with_total(logits_NV, seed_lo_N, seed_hi_N, counter_N, STREAM_TARGET, column_keys)
    return y, logits_NV.gather(-1, y[:, None]).squeeze(-1) - log_total


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits that top-k / top-p remove to -inf (last dim = vocabulary; any leading shape).

    ``top_k`` = 0 and ``top_p`` = 1 are no-ops. Top-p is applied to the top-k-renormalized
    distribution; the most likely token is always kept.
    """
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
