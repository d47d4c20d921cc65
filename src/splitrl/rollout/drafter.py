"""The MTP heads as a draft model for self-speculative decoding (DESIGN.md §3, §4).

Legend: B = rows, M = new slots per row, H = hidden size, V = vocabulary, D = drafted tokens.

Depth k at position t reads Emb(x_{t+k}) and h^{k-1}_t (h^0 = the backbone's normed output) and
predicts x_{t+k+1}. When the sequence is committed up to x_n (x_n sampled, not yet fed to the
backbone) the drafts come from position n-1: depth 1 reads Emb(x_n) and h^0_{n-1} and proposes
x̂_{n+1}; depth k reads Emb(x̂_{n+k-1}) and h^{k-1}_{n-1} and proposes x̂_{n+k}.

KV caches. Each depth owns a ``DynamicCache``. Depth k's entry for position t needs the committed
token x_{t+k}, so after each verify the depths are *extended* with every position whose inputs
just became known: the new committed tokens x_{n_old+1..n} are the embedding inputs of depth k at
positions n_old-k+1 .. n-k, all k alike, and the hidden input of depth k at position t is depth
k-1's output at t: the previous extension's last output (``carry``) for the first new slot, this
extension's outputs for the others. Depths k >= 2 also take one *query* slot at position n-1 whose
embedding input is a draft; it is masked out of all later attention because its input may be wrong.

Consequence: every position enters every depth's cache, with the teacher-forced inputs of
training, as soon as its inputs are committed; but when depth k >= 3 drafts from n-1, positions
n-k+1 .. n-2 are not in its cache yet (their inputs x_{n+1}.. are still drafts), so its context
lacks the k-2 positions right before the query. Depths 1 and 2 draft with exactly the context of
training. This only affects the drafts' quality (acceptance), never the output distribution,
which the verify rule keeps exact.

Slots. Rows accept different numbers of tokens, so every extension appends the same number of
slots to every row; slots that hold no valid entry are masked out of attention by a per-depth 2D
validity mask, and explicit position ids keep the rotary positions right (DESIGN §4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from splitrl.models.policy import PolicyModel
from splitrl.rollout.kv import compact_cache
from splitrl.rollout.sampling import STREAM_DRAFT, filter_logits, race_sample

SUPPORTED_ATTENTION = ("sdpa", "eager")


def slot_attention_mask(
    kv_valid_BL: torch.Tensor, q_len: int, attn_implementation: str, dtype: torch.dtype
) -> torch.Tensor:
    """4D mask [B, 1, Q, L] for the last ``q_len`` of L cache slots (the new ones) as queries.

    A query attends to earlier-or-equal slots that are valid; it always attends to itself so that
    a masked (garbage) query row stays finite. ``sdpa`` gets a boolean mask (True = attend),
    ``eager`` an additive float mask.
    """
    L = kv_valid_BL.shape[1]
    device = kv_valid_BL.device
    q_slot = torch.arange(L - q_len, L, device=device)[:, None]
    k_slot = torch.arange(L, device=device)[None, :]
    allowed = kv_valid_BL[:, None, :] & (k_slot <= q_slot)[None]
    allowed = (allowed | (k_slot == q_slot)[None])[:, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        zero = torch.zeros((), dtype=dtype, device=device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
    raise ValueError(
        f"speculative decoding supports attn_implementation in {SUPPORTED_ATTENTION}, got {attn_implementation!r}"
    )


@dataclass
class NewSlots:
    """What the last backbone forward committed, as the drafter's next extension reads it.

    Attributes:
        hidden_BMH: h^0 of the forward's slots (model dtype).
        next_tokens_BM: int64, the committed token that follows each slot's token (garbage where
            invalid).
        valid_BM: bool, slots that hold committed tokens.
        positions_BM: int64 backbone positions of the slots.
        last_B: int64 index of each row's last valid slot (position n-1).
    """

    hidden_BMH: torch.Tensor
    next_tokens_BM: torch.Tensor
    valid_BM: torch.Tensor
    positions_BM: torch.Tensor
    last_B: torch.Tensor

    def select(self, rows: torch.Tensor) -> NewSlots:
        return NewSlots(
            *(t[rows] for t in (self.hidden_BMH, self.next_tokens_BM, self.valid_BM, self.positions_BM, self.last_B))
        )


class MTPDrafter:
    """Drafts ``num_drafts`` tokens per row with MTP depths 1..num_drafts; one cache per depth.

    Args:
        model: the policy (its ``mtp`` block, embedding, output head and rotary embedding are used).
        num_drafts: D <= ``model.num_mtp_depths``.
        temperature, top_k, top_p: the draft distribution q is the sampling distribution's rule
            applied to the MTP logits (any q keeps the output exact; a q close to p accepts more).
        batch_size: B, the rows the caches start with.
    """

    def __init__(
        self, model: PolicyModel, num_drafts: int, temperature: float, top_k: int, top_p: float, batch_size: int
    ):
        assert model.mtp is not None and 1 <= num_drafts <= model.num_mtp_depths
        self.model = model
        self.num_drafts = num_drafts
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        device = model.output_weight.device
        self.caches = [DynamicCache() for _ in range(num_drafts)]
        self.valid = [torch.zeros(batch_size, 0, dtype=torch.bool, device=device) for _ in range(num_drafts)]
        H = model.config.hidden_size
        dtype = model.output_weight.dtype
        # carry[k-1] = h^k at the last position depth k covered (input of depth k+1's first new slot)
        self.carry = [torch.zeros(batch_size, H, dtype=dtype, device=device) for _ in range(num_drafts - 1)]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices into the current rows), in that order."""
        for cache in self.caches:
            cache.batch_select_indices(rows)
        self.valid = [v[rows] for v in self.valid]
        self.carry = [c[rows] for c in self.carry]

    def compact(self) -> None:
        """Drop dead slots (masked queries, rejected positions) from every depth's cache."""
        self.valid = [compact_cache(cache, valid) for cache, valid in zip(self.caches, self.valid)]

    def _logits(self, hidden_BH: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden_BH, self.model.output_weight).float()
        return logits / self.temperature if self.temperature != 1.0 else logits

    def extend(
        self,
        new: NewSlots,
        *,
        draft: bool,
        seed_lo_B: torch.Tensor,
        seed_hi_B: torch.Tensor,
        counter_B: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Enter the newly committed positions into every depth's cache; optionally draft.

        Args:
            new: the slots of the last backbone forward.
            draft: also run the query slots and draw D draft tokens.
            seed_lo_B, seed_hi_B: [B] int64 seed words of the rows.
            counter_B: [B] int64 response index of the first drafted token.

        Returns:
            (drafts [B, D] int64, q [B, D, V] fp32 — the filtered, normalized draft distributions the
            drafts were drawn from) when ``draft``, else None.
        """
        mtp = self.model.mtp
        B, M, _ = new.hidden_BMH.shape
        rows = torch.arange(B, device=counter_B.device)
        attn_impl = self.model.config._attn_implementation
        embeds = self.model.embed_tokens(new.next_tokens_BM)  # Emb(x_{t+k}), the same for every depth
        last_pos = new.positions_BM[rows, new.last_B]  # n-1
        prev_out = new.hidden_BMH
        query_hidden = None  # h^{k-1}_{n-1}
        carry_in = list(self.carry)  # this extension overwrites self.carry as it goes
        drafts: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for k in range(1, self.num_drafts + 1):
            shift = k - 1
            valid = new.valid_BM & (new.positions_BM >= shift)
            positions = (new.positions_BM - shift).clamp(min=0)
            if k == 1:
                hidden = prev_out
            else:
                hidden = torch.cat([carry_in[k - 2][:, None], prev_out[:, :-1]], dim=1)
            emb_in, hid_in, pos_in, valid_in = embeds, hidden, positions, valid
            with_query = draft and k >= 2
            if with_query:
                emb_in = torch.cat([embeds, self.model.embed_tokens(drafts[-1])[:, None]], dim=1)
                hid_in = torch.cat([hidden, query_hidden[:, None]], dim=1)
                pos_in = torch.cat([positions, last_pos[:, None]], dim=1)
                valid_in = torch.cat([valid, valid.new_ones(B, 1)], dim=1)
            kv_valid = torch.cat([self.valid[k - 1], valid_in], dim=1)
            mask = slot_attention_mask(kv_valid, valid_in.shape[1], attn_impl, hid_in.dtype)
            out = mtp.depth_forward(
                k,
                emb_in,
                hid_in,
                attention_mask=mask,
                position_embeddings=self.model.rotary_emb(hid_in, pos_in),
                position_ids=pos_in,
                past_key_values=self.caches[k - 1],
                use_cache=True,
            )
            if with_query:
                valid = torch.cat([valid, valid.new_zeros(B, 1)], dim=1)  # the query read a draft
            self.valid[k - 1] = torch.cat([self.valid[k - 1], valid], dim=1)
            out_true = out[:, :M]
            if k < self.num_drafts:
                self.carry[k - 1] = out_true[rows, new.last_B]
            if draft:
                query_hidden = out_true[rows, new.last_B] if k == 1 else out[:, M]
                logits = self._logits(query_hidden)
                filtered = filter_logits(logits, self.top_k, self.top_p)
                drafts.append(race_sample(filtered, seed_lo_B, seed_hi_B, counter_B + shift, STREAM_DRAFT))
                probs.append(filtered.softmax(-1))
            prev_out = out_true
        if not draft:
            return None
        return torch.stack(drafts, dim=1), torch.stack(probs, dim=1)
