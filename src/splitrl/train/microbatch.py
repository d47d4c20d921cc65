"""The one microbatch builder, shared by the synchronous and the split path (DESIGN §3).

A chunk (:class:`TrainBatch`) is cut into microbatches by sample count or by a token budget, in
sample order, and each microbatch is laid out as padded rows (one sample per row) or as one packed
row. The masks are derived per sample *before* cutting or packing:

    loss_mask_i     = token_mask_i · sample_mask_i, with position 0 zeroed (nothing predicts it)
    mtp_loss_mask_i = token_mask_i · sample_mask_i  (unshifted; the MTP loss shifts it once)

and then laid out exactly as the tokens are, so that the two paths cannot disagree.

Masked values are replaced here, once: token-aligned logprobs where ``loss_mask`` is 0 and the
advantages of filtered samples become 0, so that a -inf or NaN the loss never reads (prompt
logprobs, a filtered sample's failed logprobs) cannot turn a masked sum into NaN.
"""

from __future__ import annotations

import torch

from splitrl.models.config import ModelCapabilities
from splitrl.train.batch import _OPTIONAL_TOKEN_FIELDS, MicroBatch, TrainBatch
from splitrl.train.config import MicrobatchConfig  # noqa: F401 - defined there, torch-free


def _cost(lengths: list[int], packed: bool) -> int:
    return sum(lengths) if packed else len(lengths) * max(lengths)


def plan_microbatches(lengths: list[int], config: MicrobatchConfig, packed: bool) -> list[list[int]]:
    """Sample indices of each microbatch, in order (greedy fill up to count or token budget)."""
    groups: list[list[int]] = []
    current: list[int] = []
    budget = config.max_tokens_per_microbatch
    if budget == "auto":
        raise ValueError(
            "max_tokens_per_microbatch='auto' is resolved by the TrainWorker's memory planner; cut microbatches "
            "with the worker's config (TrainWorker.config.microbatch), or give a number of tokens"
        )
    for i, n in enumerate(lengths):
        if current:
            if budget is None:
                full = len(current) >= config.micro_batch_size
            else:
                full = _cost([lengths[j] for j in current] + [n], packed) > budget
            if full:
                groups.append(current)
                current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def _sample_masks(batch: TrainBatch, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    mtp_mask = batch.token_mask[i].float() * batch.sample_mask[i]
    return batch.loss_mask(i), mtp_mask


def _clean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``values`` where ``keep`` is nonzero, 0 elsewhere. Replaced, not multiplied: a masked
    -inf or NaN (a prompt position, a filtered sample) times 0 is NaN and poisons every sum."""
    return torch.where(keep > 0, values.float(), torch.zeros((), dtype=torch.float32))


def _layout(batch: TrainBatch, idx: list[int], packed: bool, capabilities: ModelCapabilities) -> MicroBatch:
    rows: list[list[int]] = [idx] if packed else [[i] for i in idx]
    # at least 2 positions: a row of 1 token has no prediction, and the model still needs one
    # position to run its output head on (every rank runs every module, DESIGN §2 inv. 7)
    width = max(2, max(sum(batch.lengths[i] for i in r) for r in rows))
    b = len(rows)
    input_ids = torch.zeros(b, width, dtype=torch.long)
    segment_ids = torch.full((b, width), -1, dtype=torch.long)
    position_ids = torch.zeros(b, width, dtype=torch.long)
    sample_index = torch.full((b, width), -1, dtype=torch.long)
    loss_mask = torch.zeros(b, width)
    mtp_loss_mask = torch.zeros(b, width)
    extras = {n: torch.zeros(b, width) for n in _OPTIONAL_TOKEN_FIELDS if getattr(batch, n) is not None}
    local = {i: j for j, i in enumerate(idx)}
    for r, row in enumerate(rows):
        pos = 0
        for seg, i in enumerate(row):
            L = batch.lengths[i]
            sl = slice(pos, pos + L)
            input_ids[r, sl] = batch.input_ids[i].long()
            segment_ids[r, sl] = seg
            position_ids[r, sl] = torch.arange(L)
            sample_index[r, sl] = local[i]
            sample_loss_mask, mtp_loss_mask[r, sl] = _sample_masks(batch, i)
            loss_mask[r, sl] = sample_loss_mask
            for n, t in extras.items():
                t[r, sl] = _clean(getattr(batch, n)[i], sample_loss_mask)
            pos += L
    sel = torch.as_tensor(idx, dtype=torch.long)
    return MicroBatch(
        input_ids=input_ids,
        segment_ids=segment_ids,
        position_ids=position_ids,
        sample_index=sample_index,
        loss_mask=loss_mask,
        mtp_loss_mask=mtp_loss_mask,
        advantages=_clean(batch.advantages[sel], batch.sample_mask[sel]),
        sample_mask=batch.sample_mask[sel],
        packed=packed,
        capabilities=capabilities,
        **extras,
    )


def empty_microbatch(batch: TrainBatch, capabilities: ModelCapabilities) -> MicroBatch:
    """A fully masked microbatch (1 row of 2 padding tokens, no sample).

    It runs the same modules as a real one, so a rank with nothing to do still takes part in
    every FSDP2 gather / reduce-scatter (DESIGN §2, invariant 7). Optional fields are present iff
    they are in ``batch``, so every microbatch returns the same metric names.
    """
    shape = (1, 2)
    extras = {n: torch.zeros(shape) for n in _OPTIONAL_TOKEN_FIELDS if getattr(batch, n) is not None}
    return MicroBatch(
        input_ids=torch.zeros(shape, dtype=torch.long),
        segment_ids=torch.full(shape, -1, dtype=torch.long),
        position_ids=torch.zeros(shape, dtype=torch.long),
        sample_index=torch.full(shape, -1, dtype=torch.long),
        loss_mask=torch.zeros(shape),
        mtp_loss_mask=torch.zeros(shape),
        advantages=torch.zeros(0),
        sample_mask=torch.zeros(0),
        packed=False,
        capabilities=capabilities,
        **extras,
    )


def _packed(config: MicrobatchConfig, capabilities: ModelCapabilities) -> bool:
    # a model that slices context-parallel inputs itself takes packed, unsharded rows (DESIGN §3)
    return (
        config.pack_sequences or capabilities.slices_context_parallel_inputs
    ) and not capabilities.owns_sequence_packing


def build_ready_microbatches(
    batch: TrainBatch, config: MicrobatchConfig, capabilities: ModelCapabilities | None = None
) -> tuple[list[MicroBatch], TrainBatch | None]:
    """Every microbatch of ``batch`` but the last, and the last one's samples (None when empty).

    The greedy plan is prefix-stable: planning ``rest + more samples`` later cuts the same
    microbatches as planning everything at once, so a stream of chunks yields the microbatches of
    one synchronous step.
    """
    capabilities = capabilities or ModelCapabilities()
    packed = _packed(config, capabilities)
    plan = plan_microbatches(batch.lengths, config, packed) if len(batch) else []
    if not plan:
        return [], None
    return [_layout(batch, idx, packed, capabilities) for idx in plan[:-1]], batch.select(plan[-1])


def build_microbatches(
    batch: TrainBatch,
    config: MicrobatchConfig,
    capabilities: ModelCapabilities | None = None,
    num_microbatches: int | None = None,
) -> list[MicroBatch]:
    """Cut a chunk into microbatches.

    Args:
        batch: the chunk (validated by the caller).
        config: count or token budget, packing.
        capabilities: the model's flags; ``owns_sequence_packing`` turns the builder's packing off
            (the model receives padded samples and the unpacked MTP mask).
        num_microbatches: pad the list with empty microbatches up to this count (so that every
            data-parallel rank runs the same number, DESIGN §2 invariant 7).

    Returns:
        The microbatches, in sample order.

    Raises:
        ValueError: ``num_microbatches`` is smaller than what the chunk needs.
    """
    capabilities = capabilities or ModelCapabilities()
    packed = _packed(config, capabilities)
    plan = plan_microbatches(batch.lengths, config, packed) if len(batch) else []
    mbs = [_layout(batch, idx, packed, capabilities) for idx in plan]
    if num_microbatches is not None:
        if num_microbatches < len(mbs):
            raise ValueError(f"num_microbatches={num_microbatches} < {len(mbs)} needed by the chunk")
        mbs += [empty_microbatch(batch, capabilities) for _ in range(num_microbatches - len(mbs))]
    return mbs
