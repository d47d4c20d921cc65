"""The MTP heads as a draft model for self-speculative decoding (DESIGN.md §3, §4, §5).

Legend: B = rows, P = padded prompt length, H = hidden size, V = vocabulary, D = drafted tokens.

Depth k at position t reads Emb(x_{t+k}) and h^{k-1}_t (h^0 = the backbone's normed output) and
predicts x_{t+k+1}. When the sequence is committed up to x_n (x_n emitted, not yet fed to the
backbone) the drafts come from position n-1: depth 1 reads Emb(x_n) and h^0_{n-1} and proposes
x̂_{n+1}; depth k reads Emb(x̂_{n+k-1}) and h^{k-1}_{n-1} (a *query*) and proposes x̂_{n+k}.

KV caches. Depth k owns one layer of a static cache (:mod:`splitrl.rollout.kv`) and holds every
position t <= f_k = n - k (its *frontier*: x_{t+k} is committed there), computed with the
teacher-forced inputs of training. After a verify that fed x_n and D drafts at positions p0..p0+D
and accepted a of them, depth k enters the window of positions p0-(k-1)+i, i = 0..D, valid for
i <= a; its embedding inputs are the verify's target tokens t_i = x_{p0+i+1} (the same for every
depth) and its hidden inputs depth k-1's outputs one position earlier (for i = 0 the *carry*,
depth k-1's last valid output of the previous window). The query of depth k >= 2 sits at n-1 and
reads the cache up to f_k and itself; its entry is overwritten once n-1 enters the frontier. So
depths 1 and 2 draft with exactly the context of training; depth k >= 3 lacks the k-2 positions
before the query (their inputs are drafts). This only affects acceptance, never the output.

Drafts use the target's own noise (Gumbel-max keyed by seed and response index, stream
``STREAM_TARGET``) on the filtered MTP logits: the verify accepts a draft iff it equals the token
plain decoding emits there, so a draft and its target agree whenever the two distributions put
their race winner on the same token.
"""

from __future__ import annotations

import torch

from splitrl.rollout.forward import DecoderForward
from splitrl.rollout.kv import StaticKVCache
from splitrl.rollout.sampling import column_keys


class DraftVocabulary:
    """The tokens the MTP heads draft from (``GenerationConfig.draft_vocab_size``): the ``size`` most
    frequent tokens of the responses :meth:`count` was given, then (ties, and tokens no response had
    yet) of the prompts, then the lower id; and the output layer's rows of those tokens. Responses
    rank first because drafts are response tokens: a prompt's template and system text would
    otherwise fill a small set.

    ``ids`` (int64 [size], ascending) and ``weight`` ([size, H], the output layer's dtype) are
    buffers on the model's device that :meth:`refresh` rewrites in place, so CUDA graphs captured
    with them read the new set; ``inside`` is the set as a host bool [V]. Until the first refresh
    they hold tokens 0..size-1. The counts (``counts`` of responses, ``prompt_counts``; int64 [V])
    are kept on the host.

    Args:
        output_weight: the model's output layer [V, H] (its storage: weight syncs copy into it).
        size: tokens drafted from, 1 <= size <= V.

    Raises:
        ValueError: ``size`` outside 1..V.
    """

    def __init__(self, output_weight: torch.Tensor, size: int):
        V = output_weight.shape[0]
        if not 1 <= size <= V:
            raise ValueError(
                f"draft_vocab_size={size} is outside 1..{V} (the model's vocabulary); use at most {V}, "
                "or leave it unset to draft from the whole vocabulary"
            )
        self.size, self.vocab_size = size, V
        self._output_weight = output_weight
        self.counts = torch.zeros(V, dtype=torch.int64)
        self.prompt_counts = torch.zeros(V, dtype=torch.int64)
        self.ids = torch.arange(size, device=output_weight.device)
        self.weight = output_weight.detach()[:size].clone()
        self.inside = torch.arange(V) < size  # host bool [V]: token in the set

    def count(self, token_ids: torch.Tensor, prompt: bool = False) -> None:
        """Add response tokens (or, with ``prompt``, prompt tokens; int64 [n] on the host, ids in
        [0, V)) to the counts the next :meth:`refresh` ranks."""
        if token_ids.numel():
            counts = self.prompt_counts if prompt else self.counts
            counts += torch.bincount(token_ids, minlength=self.vocab_size)

    @torch.no_grad()
    def refresh(self) -> None:
        """Take the ``size`` most frequent tokens counted so far, and their rows of the output
        layer as it is now (call it after a weight sync too)."""
        order = torch.sort(self.prompt_counts, descending=True, stable=True).indices  # ties: the lower id
        top = order[torch.sort(self.counts[order], descending=True, stable=True).indices[: self.size]]
        self.ids.copy_(torch.sort(top).values)
        self.inside = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.inside[top] = True
        torch.index_select(self._output_weight, 0, self.ids, out=self.weight)

    def covered(self, token_ids: torch.Tensor) -> int:
        """How many of ``token_ids`` (int64 [n] on the host) are in the set now."""
        return int(self.inside[token_ids].sum())


class MTPDrafter:
    """Drafts ``num_drafts`` tokens per row with MTP depths 1..num_drafts.

    Args:
        forward: the engine's decoder forward (its model has an ``mtp`` block).
        num_drafts: D <= ``model.num_mtp_depths``.
        cache: a static cache with (at least) D layers, one per depth.
        temperature, top_k, top_p: the sampling rule, applied to the MTP logits too.
        vocabulary: the tokens to draft from (None: all): a draft's logits are computed for these
            only, the others are -inf, so the race (the target's own noise) runs over the whole
            vocabulary as the target's does and a token outside the set is never drafted.
    """

    def __init__(
        self,
        forward: DecoderForward,
        num_drafts: int,
        cache: StaticKVCache,
        temperature: float,
        top_k: int,
        top_p: float,
        vocabulary: DraftVocabulary | None = None,
    ):
        model = forward.model
        assert model.mtp is not None and 1 <= num_drafts <= model.num_mtp_depths
        self.fwd = forward
        self.model = model
        self.D = num_drafts
        self.cache = cache
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.vocabulary = vocabulary
        self._columns = column_keys(model.config.vocab_size, model.output_weight.device)
        # tests: called (seed_lo [B], counter [B], depth, logits [B, V]) at every draw (eager runs only)
        self.probe = None

    def _drafts(self, num_drafts: int | None) -> int:
        """d of a call: ``num_drafts`` (1..D), or D."""
        if num_drafts is None:
            return self.D
        if not 1 <= num_drafts <= self.D:
            raise ValueError(f"num_drafts={num_drafts} is outside 1..{self.D}, the depths this drafter has caches for")
        return num_drafts

    def _draw(
        self, hidden_BH: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor, depth: int
    ) -> torch.Tensor:
        vocab = self.vocabulary
        if vocab is None:
            logits = self.fwd.head_logits(hidden_BH, self.temperature)
        else:
            some = self.fwd.head_logits(hidden_BH, self.temperature, vocab.weight)  # [B, size]
            logits = some.new_full((some.shape[0], vocab.vocab_size), float("-inf")).index_copy_(1, vocab.ids, some)
        if self.probe is not None:
            self.probe(seed_lo, counter, depth, logits.float())
        return self.fwd.k.draw(logits, seed_lo, seed_hi, counter, self.top_k, self.top_p, self._columns)

    def prefill(
        self,
        h0_BPH: torch.Tensor,
        seq_BT: torch.Tensor,
        n_B: torch.Tensor,
        slots_B: torch.Tensor,
        seed_lo: torch.Tensor,
        seed_hi: torch.Tensor,
        num_drafts: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill depths 1..d's caches for a prefilled prompt and draft d tokens from n-1.

        Args:
            h0_BPH: the backbone's h⁰ of the right-padded prompts, positions 0..P-1.
            seq_BT: int64 [B, P + D], x_0..x_n per row (prompt, then the first emitted token),
                padded with any token.
            n_B: int64 prompt lengths (x_n is the emitted token).
            slots_B: the cache slots of the rows.
            seed_lo, seed_hi: [B] seed words.
            num_drafts: d, the drafts of this call (1..D; default D): depths past d are left as they are.

        Returns:
            (drafts [B, d] int64 for response indices 1..d, carry [d-1, B, H]).
        """
        B, P, H = h0_BPH.shape
        D = self._drafts(num_drafts)
        rows = torch.arange(B, device=n_B.device)
        embeds = self.model.embed_tokens(seq_BT)
        prev = h0_BPH
        carry = h0_BPH.new_zeros(max(D - 1, 0), B, H)
        drafts: list[torch.Tensor] = []
        query = None
        last = n_B - 1  # the query position n-1
        for k in range(1, D + 1):
            out = self.fwd.mtp_prefill(k, embeds[:, k : k + P], prev, slots_B, self.cache)  # valid for t <= n-k
            if k < D:
                carry[k - 1] = out[rows, (n_B - k).clamp(min=0)]
            if k == 1:
                query = out[rows, last]
            else:
                e = self.model.embed_tokens(drafts[-1])[:, None]
                # reads its entries up to n-k and its own at n-1 < P: a prefix of P entries (not the
                # whole cache, which a prefill graph would hold a gathered copy of)
                query = self.fwd.mtp_decode(
                    k, e, query[:, None], last[:, None], last[:, None], (n_B - k)[:, None],
                    self.cache, P, slots_B,
                )[:, 0]  # fmt: skip
            drafts.append(self._draw(query, seed_lo, seed_hi, torch.full_like(n_B, k), k))
            prev = out
        return torch.stack(drafts, dim=1), carry

    def step(
        self,
        h0_BWH: torch.Tensor,
        targets_BW: torch.Tensor,
        accepted_B: torch.Tensor,
        p0_B: torch.Tensor,
        counter_B: torch.Tensor,
        carry: torch.Tensor,
        seed_lo: torch.Tensor,
        seed_hi: torch.Tensor,
        length: int,
        drafts_out: torch.Tensor | None = None,
        num_drafts: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Enter a verify's window (W = d+1 positions from ``p0_B``) and draft d tokens (slots 0..B-1;
        static shapes), d = ``num_drafts`` (1..D; default D; the verify drafted d as well).

        Args:
            h0_BWH: the verify's h⁰ at positions p0..p0+D.
            targets_BW: its target tokens t_i = x_{p0+i+1} (valid for i <= a).
            accepted_B: a, accepted drafts per row.
            p0_B: position of the fed x_n of the verify.
            counter_B: response index of the first token to draft (tokens emitted so far).
            carry: [D-1, B, H] carried hidden states (see the module docstring).
            length: cache prefix the attention reads (> every position involved).
            drafts_out: int64 [B, d], contiguous, where to write the drafts (returned then).

        Returns:
            (drafts [B, d], new carry [d-1, B, H]).

        Raises:
            ValueError: ``num_drafts`` outside 1..D, or a window of other than d+1 positions.
        """
        B, W, H = h0_BWH.shape
        D = self._drafts(num_drafts)
        if W != D + 1:
            raise ValueError(f"a verify of {D} drafts has a window of {D + 1} positions, got h0 of {W}")
        at_accepted = accepted_B[:, None, None].expand(B, 1, H)  # gather index of window entry a
        prev = h0_BWH
        new_carry = []
        drafts: list[torch.Tensor] = []
        query = None
        for k in range(1, D + 1):
            pos, write, limit = self.fwd.k.draft_window(p0_B, accepted_B, None, k, W, self.cache.scratch)  # query: n-1
            # token ids and hidden parts, concatenated and embedded inside the fused MTP input op
            if k == 1:
                ids, hidden = [targets_BW], [prev]
            else:  # the query at n-1 reads the frontier n-k and itself
                ids = [targets_BW, drafts[-1][:, None]]
                hidden = [carry[k - 2][:, None], prev[:, : W - 1], query[:, None]]
            out = self.fwd.mtp_decode(k, ids, hidden, pos, write, limit, self.cache, length)
            window = out[:, :W]
            last = window.gather(1, at_accepted)[:, 0] if k == 1 or k < D else None  # entry a: [B, H]
            if k < D:
                new_carry.append(last)
            query = last if k == 1 else out[:, W]
            drafts.append(self._draw(query, seed_lo, seed_hi, counter_B if k == 1 else counter_B + (k - 1), k))
            prev = window
        if not new_carry:
            carry_out = carry
        else:
            carry_out = new_carry[0][None] if len(new_carry) == 1 else torch.stack(new_carry)
        if drafts_out is None:
            return torch.stack(drafts, dim=1), carry_out
        return torch.stack(drafts, dim=1, out=drafts_out), carry_out
