"""Batched rollouts with a KV cache, optionally self-speculative with the MTP heads (DESIGN §4, §5).

Legend: B = rows, P = padded prompt length, H = hidden size, V = vocabulary, D = drafted tokens.

A batch is left-padded; positions are the cumulative attention mask - 1, so every row's first
token is at position 0 whatever the padding. The KV cache is one ``DynamicCache`` whose slots are
common to all rows; a 2D validity mask marks padding and, with speculative decoding, the slots of
rejected drafts, which are never attended to again and are dropped when enough of them pile up
(:mod:`splitrl.rollout.kv`). A row leaves the batch (its cache rows are dropped) as soon as it
emits a stop token or reaches ``max_new_tokens``.

Randomness is counter-based (:mod:`splitrl.rollout.sampling`): a sample's tokens depend only on its
prompt, its seed and its logits, so the same prompt and seed give the same response in any batch.

Speculative decoding (Leviathan et al. 2023; Chen et al. 2023). Each iteration the MTP depths draft
x̂_1..x̂_D from q, the backbone scores [x_n, x̂_1..x̂_D] in one forward (target p), draft j is
accepted with probability min(1, p(x̂_j) / q(x̂_j)), and at the first rejection a token is drawn from
norm(max(0, p - q)); if all D pass, a bonus token is drawn from p. The emitted tokens are then
distributed exactly as plain sampling from p, at any temperature and with top-k / top-p (p and q
are the filtered distributions), and their logprobs are the target's (unfiltered, logits / T).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from splitrl.models.policy import PolicyModel
from splitrl.rollout.config import GenerationConfig
from splitrl.rollout.drafter import SUPPORTED_ATTENTION, MTPDrafter, NewSlots
from splitrl.rollout.kv import compact_cache
from splitrl.rollout.sampling import STREAM_ACCEPT, STREAM_TARGET, filter_logits, race_sample, seed_words, uniforms

log = logging.getLogger(__name__)

# In speculative mode, every this many iterations (starting with the second) one plain step
# measures what plain decoding would cost now, for the switch-off rule (0: never; tests).
CALIBRATION_INTERVAL = 16
# The KV cache is compacted once it holds at least this many dead slots (padding of finished rows,
# rejected drafts) and they are at least this fraction of it.
COMPACT_MIN_HOLES = 32
COMPACT_MIN_FRACTION = 1 / 3


@dataclass
class RolloutStats:
    """Statistics of one ``generate`` call.

    Acceptance rates are percentages (0-100, DESIGN §5). ``acceptance_rate`` = 100 · accepted /
    drafted over all drafts; ``acceptance_rate_per_depth[k-1]`` = 100 · accepted_k / reached_k, where
    draft k is *reached* when drafts 1..k-1 of its iteration were accepted (the rollout counterpart
    of the teacher-forced ``mtp_{k}_acceptance_rate``). Rates are NaN when nothing was drafted.

    Attributes:
        num_samples, prompt_tokens, generated_tokens: counts of the call.
        wall_time_s: seconds of the whole call; tokens_per_s = generated_tokens / wall_time_s.
        policy_version: weights version that generated the call.
        num_forwards: backbone decode forwards (prefills excluded).
        speculative_active: speculative decoding ran in this call.
        speculative_next: it will run in the next call (False once switched off, see
            :class:`RolloutEngine`).
        speculative_speedup: measured (speculative tokens/s) / (plain tokens/s) in this call, or None.
        drafted_tokens, accepted_tokens: totals over the call.
        reached_per_depth, accepted_per_depth: per depth k = 1..D.
    """

    num_samples: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
    policy_version: int = 0
    num_forwards: int = 0
    speculative_active: bool = False
    speculative_next: bool = False
    speculative_speedup: float | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    reached_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return 100.0 * self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else math.nan

    @property
    def acceptance_rate_per_depth(self) -> list[float]:
        return [100.0 * a / r if r else math.nan for a, r in zip(self.accepted_per_depth, self.reached_per_depth)]

    def as_metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        """Flat metrics for the logger (acceptance keys only when speculative decoding ran)."""
        out = {
            f"{prefix}tokens_per_s": self.tokens_per_s,
            f"{prefix}generated_tokens": float(self.generated_tokens),
            f"{prefix}wall_time_s": self.wall_time_s,
            f"{prefix}speculative_active": float(self.speculative_active),
            f"{prefix}speculative_next": float(self.speculative_next),
        }
        if self.speculative_active:
            out[f"{prefix}acceptance_rate"] = self.acceptance_rate
            for k, rate in enumerate(self.acceptance_rate_per_depth, start=1):
                out[f"{prefix}mtp_{k}_acceptance_rate"] = rate  # named like the training-side metric
            if self.speculative_speedup is not None:
                out[f"{prefix}speculative_speedup"] = self.speculative_speedup
        return out


@dataclass
class GenerationResult:
    """One sample's response.

    Attributes:
        response_ids: generated tokens (a stop token, when generated, is the last one).
        logprobs: fp32 logprob of each response token under softmax(logits / T) of the policy,
            unfiltered by top-k / top-p (DESIGN §5); same length as ``response_ids``.
        finish_reason: ``"stop"`` (ended with a stop token) or ``"length"`` (hit max_new_tokens).
        policy_version: weights version that generated it.
        stats: the statistics of the whole ``generate`` call (shared by its results).
        drafted_tokens, accepted_tokens: this sample's speculative counts (0 without).
    """

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    policy_version: int
    stats: RolloutStats
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class _Timing:
    """Per-call measurements for the speculative switch-off rule."""

    def __init__(self) -> None:
        self.plain_s = 0.0
        self.plain_tokens = 0
        self.spec_s = 0.0
        self.spec_tokens = 0

    def speedup(self) -> float | None:
        if not (self.plain_s > 0 and self.spec_s > 0 and self.plain_tokens and self.spec_tokens):
            return None
        return (self.spec_tokens / self.spec_s) / (self.plain_tokens / self.plain_s)


class _Rows:
    """Decoding state of the rows of one batch; every tensor is indexed by the current live rows."""

    def __init__(self, prompts: list[list[int]], seeds: list[int], config: GenerationConfig, device: torch.device):
        B = len(prompts)
        P = max(len(p) for p in prompts)
        ids = torch.zeros(B, P, dtype=torch.int64)
        mask = torch.zeros(B, P, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, P - len(p) :] = torch.tensor(p, dtype=torch.int64)
            mask[b, P - len(p) :] = True
        self.prompt_ids = ids.to(device)
        self.mask = mask.to(device)  # [B, slots] validity of every cache slot
        self.prompt_positions = (self.mask.long().cumsum(-1) - 1).clamp(min=0)
        self.prompt_lens = [len(p) for p in prompts]
        self.next_position = torch.tensor(self.prompt_lens, dtype=torch.int64, device=device)
        self.seed_lo, self.seed_hi = seed_words(seeds, device)
        self.counter = torch.zeros(B, dtype=torch.int64, device=device)  # tokens emitted so far
        self.last_token = torch.zeros(B, dtype=torch.int64, device=device)  # x_n: sampled, not yet fed
        self.cache = DynamicCache()
        self.ids = list(range(B))  # batch-local sample index of each live row
        self.responses: list[list[int]] = [[] for _ in range(B)]
        self.logprobs: list[list[float]] = [[] for _ in range(B)]
        self.finish: list[str | None] = [None] * B
        self.drafted = [0] * B
        self.accepted = [0] * B
        self._stop = set(config.stop_token_ids)
        self._max_new = config.max_new_tokens

    def __len__(self) -> int:
        return len(self.ids)

    def holes(self) -> int:
        """Cache slots beyond what the fullest live row needs (from CPU-side counts, no sync)."""
        valid = max(self.prompt_lens[s] + len(self.responses[s]) - 1 for s in self.ids)
        return self.mask.shape[1] - valid

    def commit(self, y: torch.Tensor, num_fed: torch.Tensor) -> None:
        """``num_fed`` tokens entered the cache (x_n and the accepted drafts) and ``y`` followed.

        The row emitted ``num_fed`` tokens: the accepted drafts and ``y``.
        """
        self.last_token = y
        self.next_position = self.next_position + num_fed
        self.counter = self.counter + num_fed

    def record(self, tokens: list[list[int]], logprobs: list[list[float]]) -> list[int]:
        """Append each live row's emitted tokens up to a stop token or the length limit.

        Returns the live-row indices that continue.
        """
        keep = []
        for r, (toks, lps) in enumerate(zip(tokens, logprobs)):
            s = self.ids[r]
            resp, resp_lp = self.responses[s], self.logprobs[s]
            for t, lp in zip(toks, lps):
                resp.append(t)
                resp_lp.append(lp)
                if t in self._stop:
                    self.finish[s] = "stop"
                    break
                if len(resp) >= self._max_new:
                    self.finish[s] = "length"
                    break
            if self.finish[s] is None:
                keep.append(r)
        return keep

    def select(self, rows: torch.Tensor, keep: list[int]) -> None:
        self.cache.batch_select_indices(rows)
        for name in ("mask", "next_position", "seed_lo", "seed_hi", "counter", "last_token"):
            setattr(self, name, getattr(self, name)[rows])
        self.ids = [self.ids[r] for r in keep]


class RolloutEngine:
    """Samples responses from a :class:`PolicyModel` (DESIGN §4 "Rollouts").

    Args:
        model: the policy; it is moved to ``device`` and put in eval mode, in the dtype it has
            (cast it to bf16 beforehand for bf16 rollouts).
        config: the sampling rules.
        device: where to run (default: where the model's parameters are).

    Speculative switch-off: in a speculative call, one plain step every ``CALIBRATION_INTERVAL``
    iterations measures plain decoding; when the measured speculative tokens/s falls below the plain
    tokens/s, the next calls decode plainly (``stats.speculative_next`` = False, logged) until the
    next weight sync (:meth:`load_state_dict`), whose new MTP heads may draft better.

    Raises:
        ValueError: a stop token outside the vocabulary; ``speculative=True`` with a model without
            MTP heads, with more draft tokens than MTP depths, or with an unsupported attention.
    """

    def __init__(self, model: PolicyModel, config: GenerationConfig, device: str | torch.device | None = None):
        vocab = model.config.vocab_size
        bad = [t for t in config.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary of size {vocab}")
        self.num_drafts = 0
        if config.speculative:
            D = model.num_mtp_depths
            if D == 0:
                raise ValueError(
                    "speculative=True needs a model with MTP heads (mtp.mtp_num_layers > 0); "
                    "add MTP heads to the model or set speculative=False"
                )
            n = config.num_draft_tokens or D
            if n > D:
                raise ValueError(f"num_draft_tokens={n} exceeds the model's {D} MTP depths; use at most {D}")
            attn = model.config._attn_implementation
            if attn not in SUPPORTED_ATTENTION:
                raise ValueError(
                    f"speculative decoding needs attn_implementation in {SUPPORTED_ATTENTION}, got {attn!r}"
                )
            self.num_drafts = n
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.config = config
        self.policy_version = 0
        self.last_stats: RolloutStats | None = None
        self._speculative_active = config.speculative
        self._warned_slow = False

    # ------------------------------------------------------------------------------ weights
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Receive a weight sync: the full PolicyModel state dict, MTP tensors included.

        Raises:
            ValueError: missing or unexpected keys (a sync without the ``mtp.`` tensors leaves a
                stale draft), or a shape mismatch. Nothing is changed then.
        """
        own = self.model.state_dict()
        missing = sorted(own.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - own.keys())
        if missing or unexpected:
            hint = ""
            if any(k.startswith("mtp.") for k in missing):
                hint = " (the MTP tensors must be synced too: a stale draft destroys acceptance)"
            raise ValueError(
                f"weight sync keys do not match the policy: {len(missing)} missing (e.g. {missing[:3]}), "
                f"{len(unexpected)} unexpected (e.g. {unexpected[:3]}){hint}; send PolicyModel.state_dict()"
            )
        wrong = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(own[k].shape)]
        if wrong:
            raise ValueError(f"weight sync shapes differ from the policy for {wrong[:5]}; send the same architecture")
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)
        self.policy_version = int(version)
        self._speculative_active = self.config.speculative

    # ----------------------------------------------------------------------------- generate
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[GenerationResult]:
        """Sample one response per prompt.

        Args:
            prompts: token ids of each prompt (non-empty, ids in [0, V)).
            seeds: one int per prompt; the same prompt, seed and weights give the same response
                whatever else is in the request (up to the logits' rounding on the device).

        Returns:
            One :class:`GenerationResult` per prompt, in order; the call's :class:`RolloutStats`
            are on each result and in ``self.last_stats``.

        Raises:
            ValueError: lengths of ``prompts`` and ``seeds`` differ, an empty prompt, a token id
                outside the vocabulary, or prompt + max_new_tokens beyond the model's positions.
        """
        self._check_request(prompts, seeds)
        start = time.perf_counter()
        cfg = self.config
        speculative = cfg.speculative and self._speculative_active
        D = self.num_drafts if speculative else 0
        stats = RolloutStats(
            num_samples=len(prompts),
            prompt_tokens=sum(len(p) for p in prompts),
            policy_version=self.policy_version,
            speculative_active=speculative,
            reached_per_depth=[0] * D,
            accepted_per_depth=[0] * D,
        )
        timing = _Timing()
        # Similar lengths share a batch (less padding); results do not depend on the grouping.
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        rows_out: list[tuple[list[int], list[float], str, int, int] | None] = [None] * len(prompts)
        for b0 in range(0, len(order), cfg.batch_size):
            idx = order[b0 : b0 + cfg.batch_size]
            done = self._generate_batch([prompts[i] for i in idx], [seeds[i] for i in idx], D, stats, timing)
            for i, res in zip(idx, done):
                rows_out[i] = res
        stats.wall_time_s = time.perf_counter() - start
        stats.generated_tokens = sum(len(r[0]) for r in rows_out)  # type: ignore[index]
        stats.tokens_per_s = stats.generated_tokens / stats.wall_time_s if stats.wall_time_s > 0 else 0.0
        if speculative:
            stats.speculative_speedup = timing.speedup()
            if stats.speculative_speedup is not None and stats.speculative_speedup < 1.0:
                self._speculative_active = False
                # warn the first time; afterwards the switch shows in rollout/speculative_active
                level = logging.INFO if self._warned_slow else logging.WARNING
                self._warned_slow = True
                log.log(
                    level,
                    "speculative rollouts measured %.2fx plain speed (acceptance %.1f%%): decoding plainly "
                    "until the next weight sync",
                    stats.speculative_speedup,
                    stats.acceptance_rate,
                )
        stats.speculative_next = cfg.speculative and self._speculative_active
        self.last_stats = stats
        return [
            GenerationResult(
                response_ids=r[0],
                logprobs=r[1],
                finish_reason=r[2],  # type: ignore[arg-type]
                policy_version=self.policy_version,
                stats=stats,
                drafted_tokens=r[3],
                accepted_tokens=r[4],
            )
            for r in rows_out  # type: ignore[misc]
        ]

    def _check_request(self, prompts: list[list[int]], seeds: list[int]) -> None:
        if len(prompts) != len(seeds):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
        vocab = self.model.config.vocab_size
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            if max_pos is not None and len(p) + self.config.max_new_tokens > max_pos:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens) + max_new_tokens={self.config.max_new_tokens} exceeds the "
                    f"model's max_position_embeddings={max_pos}; shorten the prompt or lower max_new_tokens"
                )

    # ----------------------------------------------------------------------------- internals
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Same ops as PolicyModel.forward: head in the model dtype, then fp32, then / T.
        logits = F.linear(hidden, self.model.output_weight).float()
        return logits / self.config.temperature if self.config.temperature != 1.0 else logits

    def _backbone(self, rows: _Rows, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.backbone.model(
            input_ids=input_ids,
            attention_mask=rows.mask,
            position_ids=positions,
            past_key_values=rows.cache,
            use_cache=True,
        ).last_hidden_state

    def _generate_batch(
        self, prompts: list[list[int]], seeds: list[int], D: int, stats: RolloutStats, timing: _Timing
    ) -> list[tuple[list[int], list[float], str, int, int]]:
        cfg = self.config
        device = self.device
        rows = _Rows(prompts, seeds, cfg, device)
        B, P = rows.prompt_ids.shape
        drafter = MTPDrafter(self.model, D, cfg.temperature, cfg.top_k, cfg.top_p, B) if D > 0 else None

        # prefill: the first token comes from the last prompt slot of every row
        hidden = self._backbone(rows, rows.prompt_ids, rows.prompt_positions)
        logits = self._logits(hidden[:, -1])
        y = race_sample(
            filter_logits(logits, cfg.top_k, cfg.top_p), rows.seed_lo, rows.seed_hi, rows.counter, STREAM_TARGET
        )
        lp = logits.gather(-1, y[:, None]).squeeze(-1) - logits.logsumexp(-1)
        rows.last_token = y
        rows.counter = rows.counter + 1
        pending = None
        if drafter is not None:
            pending = NewSlots(
                hidden_BMH=hidden,
                next_tokens_BM=torch.cat([rows.prompt_ids[:, 1:], y[:, None]], dim=1),
                valid_BM=rows.mask.clone(),
                positions_BM=rows.prompt_positions,
                last_B=torch.full((B,), P - 1, dtype=torch.int64, device=device),
            )
        keep = rows.record([[t] for t in y.tolist()], [[v] for v in lp.tolist()])

        iteration = 0
        while True:
            if len(keep) < len(rows):
                if not keep:
                    break
                sel = torch.tensor(keep, dtype=torch.int64, device=device)
                rows.select(sel, keep)
                if drafter is not None:
                    drafter.select(sel)
                    pending = pending.select(sel)
            calibrate = drafter is not None and CALIBRATION_INTERVAL > 0 and iteration % CALIBRATION_INTERVAL == 1
            t_start = time.perf_counter()
            # A calibration step must see a cache as dense as plain decoding's to measure its cost.
            if calibrate or rows.holes() >= max(COMPACT_MIN_HOLES, COMPACT_MIN_FRACTION * rows.mask.shape[1]):
                rows.mask = compact_cache(rows.cache, rows.mask)
                if drafter is not None:
                    drafter.compact()
            drafts = q = None
            if drafter is not None:
                out = drafter.extend(
                    pending,
                    draft=not calibrate,
                    seed_lo_B=rows.seed_lo,
                    seed_hi_B=rows.seed_hi,
                    counter_B=rows.counter,
                )
                if out is not None:
                    drafts, q = out
                if calibrate and device.type == "cuda":
                    torch.cuda.synchronize(device)  # the plain step's clock must not wait for the MTP's work
            t1 = time.perf_counter()
            tokens, logprobs, accepted, pending = self._verify(rows, drafts, q, keep_slots=drafter is not None)
            stats.num_forwards += 1
            if drafter is not None and not calibrate:
                self._count_acceptance(rows, accepted, D, stats)
            keep = rows.record(tokens, logprobs)
            t_end = time.perf_counter()  # _verify ends with a host sync (tokens to CPU)
            n_emitted = sum(len(t) for t in tokens)
            if drafter is None:
                pass
            elif calibrate:
                timing.plain_s += t_end - t1
                timing.plain_tokens += n_emitted
                timing.spec_s += t1 - t_start  # compaction and MTP extension are speculative overhead
            else:
                timing.spec_s += t_end - t_start
                timing.spec_tokens += n_emitted
            iteration += 1

        return [
            (rows.responses[s], rows.logprobs[s], rows.finish[s] or "length", rows.drafted[s], rows.accepted[s])
            for s in range(B)
        ]

    def _count_acceptance(self, rows: _Rows, accepted: list[int], D: int, stats: RolloutStats) -> None:
        for r, a in enumerate(accepted):
            s = rows.ids[r]
            rows.drafted[s] += D
            rows.accepted[s] += a
            stats.drafted_tokens += D
            stats.accepted_tokens += a
            for k in range(1, min(a + 1, D) + 1):  # draft k reached when 1..k-1 were accepted
                stats.reached_per_depth[k - 1] += 1
            for k in range(1, a + 1):
                stats.accepted_per_depth[k - 1] += 1

    def _verify(
        self, rows: _Rows, drafts: torch.Tensor | None, q: torch.Tensor | None, *, keep_slots: bool
    ) -> tuple[list[list[int]], list[list[float]], list[int], NewSlots | None]:
        """Feed [x_n, drafts...] to the backbone, accept, and commit; a plain step without drafts.

        Returns per live row the emitted tokens, their logprobs and the number of accepted drafts,
        plus the committed slots for the drafter (when ``keep_slots``).
        """
        cfg = self.config
        B = len(rows)
        D = 0 if drafts is None else drafts.shape[1]
        device = rows.last_token.device
        steps = torch.arange(D + 1, device=device)
        input_ids = rows.last_token[:, None] if drafts is None else torch.cat([rows.last_token[:, None], drafts], dim=1)
        positions = rows.next_position[:, None] + steps
        rows.mask = torch.cat([rows.mask, rows.mask.new_ones(B, D + 1)], dim=1)
        hidden = self._backbone(rows, input_ids, positions)  # [B, D+1, H]
        logits = self._logits(hidden)  # [B, D+1, V]
        filtered = filter_logits(logits, cfg.top_k, cfg.top_p)
        if D == 0:
            accepted = torch.zeros(B, dtype=torch.int64, device=device)
            y = race_sample(filtered[:, 0], rows.seed_lo, rows.seed_hi, rows.counter, STREAM_TARGET)
            emitted = y[:, None]
        else:
            assert q is not None
            p = filtered.softmax(-1)
            p_draft = p[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)  # [B, D]
            q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
            u = uniforms(
                rows.seed_lo[:, None], rows.seed_hi[:, None], rows.counter[:, None] + steps[:-1], STREAM_ACCEPT
            )
            ok = u * q_draft < p_draft  # u < p/q without dividing by q
            accepted = ok.long().cumprod(dim=1).sum(dim=1)  # leading accepted drafts
            rows_idx = torch.arange(B, device=device)
            p_last = p[rows_idx, accepted]  # [B, V] target at the first rejection (or the bonus slot)
            q_last = q[rows_idx, accepted.clamp(max=D - 1)] * (accepted < D)[:, None]  # no q at the bonus slot
            residual = (p_last - q_last).clamp(min=0.0)
            # p = q up to rounding leaves nothing to draw from; p itself is then the exact answer
            empty = residual.sum(-1, keepdim=True) <= 0
            residual = torch.where(empty, p_last, residual)
            y = race_sample(residual.log(), rows.seed_lo, rows.seed_hi, rows.counter + accepted, STREAM_TARGET)
            emitted = torch.cat([drafts, drafts.new_zeros(B, 1)], dim=1)
            emitted[rows_idx, accepted] = y
        logprobs = logits.gather(-1, emitted[..., None]).squeeze(-1) - logits.logsumexp(-1)  # [B, D+1]
        valid = steps[None] <= accepted[:, None]
        rows.mask[:, -(D + 1) :] = valid
        pending = None
        if keep_slots:
            pending = NewSlots(
                hidden_BMH=hidden, next_tokens_BM=emitted, valid_BM=valid, positions_BM=positions, last_B=accepted
            )
        rows.commit(y, accepted + 1)
        # one device-to-host copy (float64 holds token ids exactly)
        host = torch.cat([accepted[:, None].double(), emitted.double(), logprobs.double()], dim=1).cpu()
        acc_list = host[:, 0].long().tolist()
        tokens = [t[: a + 1] for t, a in zip(host[:, 1 : D + 2].long().tolist(), acc_list)]
        lps = [v[: a + 1] for v, a in zip(host[:, D + 2 :].tolist(), acc_list)]
        return tokens, lps, acc_list, pending
