"""The host side of continuous batching: which sample each slot holds, refills, compaction and
collection (see :mod:`splitrl.rollout.engine`). S = slots, B = slots of one decode step, L = the
cache prefix a step reads.

The host synchronizes every few steps (``SYNC_EVERY``) to collect finished slots, refill them
with waiting prompts (a batched ragged prefill, see :meth:`ModelRunner.prefill
<splitrl.rollout.runner.ModelRunner.prefill>`) and move rows to lower slots when a smaller bucket
suffices. Finished rows in a bucket keep computing until that sync, writing only their own slot;
their results are fixed.

Chunks ahead. With no prompt waiting for a slot, the host queues the next chunk before it reads
the flags of the one running (:meth:`next_chunk` with ``ahead``): the GPU then runs through the
read and the host's bookkeeping instead of idling after every chunk (about 0.5 ms a sync at
batch 32: bench/RESULTS.md). The chunk ahead is sized from what the host knows for certain: its
steps are at most the ones the slowest row still needs even if it gained the most tokens a step
in the chunk running, so on rows without stop tokens it never runs past the call's end; a row
that stops early is one that keeps computing (as above) until the next read. The flags are read
from a copy queued behind their chunk (:meth:`snapshot`), so the read waits for that chunk only.
Nothing is queued ahead while the live rows fit a smaller bucket (the compaction moves rows, so
it runs with nothing in flight), and a read that finds finished rows waits for the queued chunk
too (their collection copies their outputs behind it): in a ragged call's tail the reads are
mostly plain reads again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

import torch

from splitrl.rollout.results import GenerationResult, RolloutStats
from splitrl.rollout.runner import ModelRunner, length_bucket, row_bucket

# The host reads the done flags every this many decode steps (plain) or verify iterations (spec;
# half as many while prompts wait for a slot).
SYNC_EVERY = 16
# Prefill token budget of one forward (rows of a refill are cut into forwards of at most this).
PREFILL_TOKENS = 16384
# Free slots are refilled once they are at least this fraction of the slots (or nothing runs):
# a few larger refills cost less host time than many small ones.
REFILL_MIN_FRACTION = 1 / 8


class Scheduler:
    """The slots of one ``generate`` call, on the host.

    Args:
        runner: the model runner, its buffers allocated for the call's prompts.
        prompts, seeds: the call's (checked) prompts and seeds; prompts enter free slots in order.
        policy_version: stamped on every result.

    Attributes (by slot, host copies as of the last sync):
        item: the index of the prompt the slot holds (None: free).
        count: the slot's response counter.
        live_drafted, live_accepted: the speculative counts of the sample the slot holds, not yet
            added to the call's stats.
    """

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], seeds: list[int], policy_version: int):
        self.runner, self.prompts, self.seeds, self.policy_version = runner, prompts, seeds, policy_version
        S = self.S = runner.config.batch_size
        runner.state.done.fill_(True)
        self.waiting = deque(range(len(prompts)))
        self.item: list[int | None] = [None] * S  # sample index held by each slot
        self.count = [0] * S  # host copy of each slot's counter at the last sync
        self.live_drafted = [0] * S
        self.live_accepted = [0] * S

    def refill(self, drafts: int) -> None:
        """Prefill waiting prompts into free slots, once enough slots are free (or none is busy);
        ``drafts``: the call's drafts a verify (0: plain)."""
        S, waiting, item = self.S, self.waiting, self.item
        free = [s for s in range(S) if item[s] is None]
        idle = len(free) == S
        if not (waiting and free and (idle or len(free) >= min(len(waiting), max(1, int(S * REFILL_MIN_FRACTION))))):
            return
        take = free[: len(waiting)]
        new = [waiting.popleft() for _ in take]
        budget = max(1, PREFILL_TOKENS // max(len(self.prompts[i]) for i in new))
        for c in range(0, len(take), budget):
            chunk_s, chunk_i = take[c : c + budget], new[c : c + budget]
            self.runner.prefill(chunk_s, [self.prompts[i] for i in chunk_i], [self.seeds[i] for i in chunk_i], drafts)
        for s, i in zip(take, new):
            item[s], self.count[s] = i, 1
            self.live_drafted[s] = self.live_accepted[s] = 0

    def active(self) -> list[int]:
        """The slots holding a sample, in order; moved to slots 0..n-1 first when no prompt waits
        and a smaller row bucket suffices (empty: the call is done)."""
        S = self.S
        active = [s for s in range(S) if self.item[s] is not None]
        if active and not self.waiting and row_bucket(len(active), S) < row_bucket(active[-1] + 1, S):
            self.compact(active)
            active = list(range(len(active)))
        return active

    def compact(self, active: list[int]) -> None:
        """Move the rows of ``active`` to slots 0..len-1 (a smaller bucket)."""
        item, runner = self.item, self.runner
        n = len(active)
        src = [s for s in active if s >= n]
        dst = [s for s in range(n) if item[s] is None]
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.int64, device=runner.device)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=runner.device)
        runner.cache.move(src_t, dst_t)
        if runner.mtp_cache is not None:
            runner.mtp_cache.move(src_t, dst_t)
        runner.state.move(src_t, dst_t)
        runner.state.done[src_t] = True
        for a, b in zip(src, dst):
            for lst in (item, self.count, self.live_drafted, self.live_accepted):
                lst[b] = lst[a]
            item[a] = None

    def next_chunk(
        self, active: list[int], drafts: int, stats: RolloutStats, ahead: tuple[int, int] | None = None
    ) -> tuple[int, int, int] | None:
        """(B, L, steps) of the next chunk of decode steps (``drafts`` 0) or verify iterations of
        ``drafts`` drafts (1..D) of ``active``.

        ``ahead``: (steps, drafts) of a chunk queued but not read yet, which this one follows
        (module docstring, "Chunks ahead"): the rows' counts are then known only up to that chunk's
        tokens, so the steps are those the slowest row needs even if each of its steps emitted
        drafts + 1 tokens; None when no step is certainly needed, when prompts wait (their refill
        must not wait a chunk longer) or when the live rows fit a smaller bucket (the compaction
        runs with nothing queued).
        """
        runner, S = self.runner, self.S
        M, max_new = runner.cache.max_len, runner.config.max_new_tokens
        D = runner.num_drafts  # the cache margin below is the buffers' (the most drafts)
        B = row_bucket(active[-1] + 1, S)
        spec = drafts > 0
        Q = drafts + 1
        if ahead is not None:
            # prompts waiting for a slot, or rows a smaller bucket would hold (a compaction, which
            # needs nothing queued): read first
            if self.waiting or row_bucket(len(active), S) < B:
                return None
            gained = ahead[0] * (ahead[1] + 1)  # the most tokens a row can have gained in the queued chunk
            need = max(max_new - self.count[s] for s in active) - gained  # tokens the slowest row still needs, at least
            if need <= 0:
                return None
            n_steps = min(SYNC_EVERY, -(-need // Q))
            top = max(len(self.prompts[self.item[s]]) + min(self.count[s] + gained + n_steps * Q, max_new) for s in active)
            return B, length_bucket(top + 2 * D + 1, M), n_steps
        # with prompts waiting, stop when the first row can end (its slot is refilled then); with
        # none, when the last can: finished rows idle in the bucket until then (fewer host syncs
        # at a call's tail; results are fixed when a row finishes)
        left = [max_new - self.count[s] for s in active]
        remaining = min(left) if self.waiting else max(left)
        per_iter = 1.0
        if spec and stats.drafted_tokens + sum(self.live_drafted):
            per_iter = 1.0 + drafts * (stats.accepted_tokens + sum(self.live_accepted)) / (
                stats.drafted_tokens + sum(self.live_drafted)
            )
        # a verify makes ~2 tokens: with prompts waiting, half the iterations keep the wait for a
        # free slot as long in tokens as a plain chunk's; with none, fewer host syncs are all that
        # count (each leaves the GPU idle a while: bench/RESULTS.md, the profile at batch 32)
        limit = SYNC_EVERY // 2 if spec and self.waiting else SYNC_EVERY
        n_steps = max(1, min(limit, math.ceil(remaining / per_iter)))
        top = max(len(self.prompts[self.item[s]]) + min(self.count[s] + n_steps * Q, max_new) for s in active)
        L = length_bucket(top + 2 * D + 1, M)
        return B, L, n_steps

    def snapshot(self, B: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue a copy of slots 0..B-1's progress (done, counter, drafted, accepted) to the host
        behind the work queued so far; :meth:`read` takes it. On CUDA the copy lands in pinned
        memory with an event, so the read waits for the work before it only."""
        st = self.runner.state
        flags = torch.stack([st.done[:B].long(), st.counter[:B], st.drafted[:B], st.accepted[:B]])
        if flags.device.type != "cuda":
            return flags.clone(), None
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flags.device))  # the engine's device, not the current one
        return host, event

    def read(self, snap: tuple[torch.Tensor, torch.cuda.Event | None], active: list[int]) -> list[int]:
        """Take a :meth:`snapshot` (waiting for it): update the host copies of ``active``'s
        progress; the slots of ``active`` that had finished."""
        flags, event = snap
        if event is not None:
            event.synchronize()
        host = flags.tolist()
        finished = []
        for s in active:
            self.count[s], self.live_drafted[s], self.live_accepted[s] = host[1][s], host[2][s], host[3][s]
            if host[0][s]:
                finished.append(s)
        return finished

    def collect(self, finished: list[int], stats: RolloutStats) -> Iterator[tuple[int, GenerationResult]]:
        """(prompt index, result) of each finished slot, which is freed; adds them to ``stats``."""
        st, item, count = self.runner.state, self.item, self.count
        live_drafted, live_accepted = self.live_drafted, self.live_accepted
        idx = torch.tensor(finished, dtype=torch.int64, device=self.runner.device)
        w = max(count[s] for s in finished)
        host = torch.cat(
            [
                st.out_tokens[idx, :w].double(),
                st.out_logprobs[idx, :w].double(),
                st.stopped[idx, None].double(),
                st.reached_depth[idx].double(),
                st.accepted_depth[idx].double(),
            ],
            dim=1,
        ).cpu()
        D = len(stats.reached_per_depth)
        for r, s in enumerate(finished):
            n = count[s]
            row = host[r]
            tokens = row[:n].long().tolist()
            stats.generated_tokens += n
            stats.drafted_tokens += live_drafted[s]
            stats.accepted_tokens += live_accepted[s]
            for k in range(D):
                stats.reached_per_depth[k] += int(row[2 * w + 1 + k])
                stats.accepted_per_depth[k] += int(row[2 * w + 1 + D + k])
            result = GenerationResult(
                response_ids=tokens,
                logprobs=row[w : w + n].tolist(),
                finish_reason="stop" if row[2 * w] > 0 else "length",
                policy_version=self.policy_version,
                stats=stats,
                drafted_tokens=live_drafted[s],
                accepted_tokens=live_accepted[s],
            )
            index = item[s]
            item[s] = None
            live_drafted[s] = live_accepted[s] = 0
            yield index, result
