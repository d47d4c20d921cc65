"""Chunks queued ahead of the host's read of the done flags (splitrl.rollout.scheduler, "Chunks
ahead"): the same samples as reading every chunk first, no chunk past the call's end on rows without
stop tokens, and the chunk sizes the host can be sure of."""

import pytest
import torch
from _rollout_helpers import make_model, random_prompts

from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout import runner as runner_mod
from splitrl.rollout import scheduler as scheduler_mod
from splitrl.rollout.results import RolloutStats


def _run(model, cfg, prompts, seeds, look_ahead: bool, monkeypatch, drafts=None):
    """(results, [(kind, B, L, steps) of each chunk], stats, the most chunks queued at a read) of
    one call on a fresh CPU engine."""
    chunks, queued, most = [], [0], [0]
    original, snapshot, read = (
        runner_mod.ModelRunner.run_steps,
        scheduler_mod.Scheduler.snapshot,
        scheduler_mod.Scheduler.read,
    )

    def recording(self, kind, B, L, n):
        chunks.append((kind, B, L, n))
        return original(self, kind, B, L, n)

    def snapshotting(self, B):
        queued[0] += 1
        return snapshot(self, B)

    def reading(self, snap, active):
        most[0] = max(most[0], queued[0])
        queued[0] -= 1
        return read(self, snap, active)

    monkeypatch.setattr(runner_mod.ModelRunner, "run_steps", recording)
    monkeypatch.setattr(scheduler_mod.Scheduler, "snapshot", snapshotting)
    monkeypatch.setattr(scheduler_mod.Scheduler, "read", reading)
    engine = RolloutEngine(model, cfg, "cpu")
    engine.speculative_switch_off = False
    engine.look_ahead = look_ahead
    results = engine.generate(prompts, seeds)
    monkeypatch.undo()
    return results, chunks, engine.last_stats, most[0]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("stops", [[], [0, 1]])
def test_chunks_ahead_give_the_same_samples(monkeypatch, speculative, stops):
    """Fixed-length rows (no stop tokens) and ragged ones (two stop ids of 24), more prompts than
    slots (refills, during which nothing is queued ahead) and a tail with none waiting: tokens,
    logprobs (within 2e-5: another cache bucket rounds in another order), finish reasons and the
    speculative counts equal those of the engine that reads every
    chunk's flags before the next launch. Without stop tokens the queued chunks never run past the
    call's end: the forwards are as many as without them."""
    V = 24
    model = make_model(vocab=V, depths=2, hidden_size=32, intermediate_size=64, init=0.5, seed=4)
    cfg = GenerationConfig(
        speculative=speculative, temperature=0.9, max_new_tokens=23, stop_token_ids=stops, batch_size=4
    )
    prompts = random_prompts(6, V, (2, 9), seed=11)
    seeds = [40 + i for i in range(6)]
    # SYNC_EVERY 3: many chunks in a short call (set again after each run's undo)
    monkeypatch.setattr(scheduler_mod, "SYNC_EVERY", 3)
    base, base_chunks, base_stats, base_queued = _run(model, cfg, prompts, seeds, False, monkeypatch)
    monkeypatch.setattr(scheduler_mod, "SYNC_EVERY", 3)
    ahead, ahead_chunks, ahead_stats, ahead_queued = _run(model, cfg, prompts, seeds, True, monkeypatch)
    assert (base_queued, ahead_queued) == (1, 2)  # chunks were queued ahead of a read (and only then)
    for a, b in zip(ahead, base):
        assert (a.response_ids, a.finish_reason) == (b.response_ids, b.finish_reason)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0)
        assert (a.drafted_tokens, a.accepted_tokens) == (b.drafted_tokens, b.accepted_tokens)
    assert ahead_stats.generated_tokens == base_stats.generated_tokens
    assert (ahead_stats.drafted_tokens, ahead_stats.accepted_tokens) == (
        base_stats.drafted_tokens,
        base_stats.accepted_tokens,
    )
    if not stops and not speculative:
        # plain rows without stops: the host knows every row's end, so no step is wasted
        assert ahead_stats.num_forwards == base_stats.num_forwards
        assert sum(c[3] for c in ahead_chunks) == sum(c[3] for c in base_chunks)
    if not stops:
        # the last chunk of the call: no queued chunk runs after every row has ended
        assert sum(c[3] for c in ahead_chunks) <= sum(c[3] for c in base_chunks) + 3


def test_a_chunk_is_queued_ahead_only_when_no_prompt_waits(monkeypatch):
    """The scheduler's chunk ahead: None while prompts wait (their refill must not wait a chunk
    longer); without waiting prompts the steps the slowest row needs if the queued chunk gained it the
    most tokens (plain: one a step, exact; a verify of d drafts: d + 1 a step), None when none is
    certainly needed."""
    V = 24
    model = make_model(vocab=V, depths=2, hidden_size=32, intermediate_size=64, seed=4)
    cfg = GenerationConfig(speculative=True, temperature=0.9, max_new_tokens=40, batch_size=2)
    engine = RolloutEngine(model, cfg, "cpu")
    engine.runner.ensure_buffers(8)
    prompts = random_prompts(3, V, (2, 8), seed=1)
    slots = scheduler_mod.Scheduler(engine.runner, prompts, [0, 1, 2], 0)
    slots.refill(drafts=0)
    active = slots.active()
    stats = RolloutStats()
    assert slots.waiting  # the third prompt waits
    assert slots.next_chunk(active, 0, stats, ahead=(5, 0)) is None
    slots.waiting.clear()
    slots.count[:2] = [1, 10]  # the slowest row has 39 tokens to go
    B, L, n = slots.next_chunk(active, 0, stats, ahead=(16, 0))
    assert (B, n) == (2, 16)  # 39 - 16 = 23 certain steps: a full chunk
    assert slots.next_chunk(active, 0, stats, ahead=(30, 0))[2] == 9  # 39 - 30: exactly the rest
    assert slots.next_chunk(active, 0, stats, ahead=(39, 0)) is None  # nothing is certain to remain
    # two drafts a verify: the queued chunk of 10 verifies may have made 30 tokens; 9 remain, 3 verifies
    assert slots.next_chunk(active, 2, stats, ahead=(10, 2))[2] == 3
    assert slots.next_chunk(active, 2, stats, ahead=(13, 2)) is None


def test_rows_ending_on_stop_tokens_still_compact_with_chunks_ahead(monkeypatch):
    """Every prompt in a slot from the start (none waits, so chunks are queued ahead) and rows ending
    on stop tokens: nothing is queued while the live rows fit a smaller bucket, so the compaction
    (which needs nothing queued) still shrinks the bucket, and the row-steps computed stay those of
    reading every chunk first, give or take one chunk. (Queued chunks used to keep the call at its
    first bucket to the end: 2.6x the row-steps, found in review.)"""
    V = 24
    model = make_model(vocab=V, depths=2, hidden_size=32, intermediate_size=64, init=0.5, seed=4)
    cfg = GenerationConfig(temperature=0.9, max_new_tokens=60, stop_token_ids=[0, 1, 2], batch_size=8)
    prompts = random_prompts(8, V, (2, 9), seed=3)
    seeds = list(range(8))
    monkeypatch.setattr(scheduler_mod, "SYNC_EVERY", 4)
    base, base_chunks, _, _ = _run(model, cfg, prompts, seeds, False, monkeypatch)
    monkeypatch.setattr(scheduler_mod, "SYNC_EVERY", 4)
    ahead, ahead_chunks, _, queued = _run(model, cfg, prompts, seeds, True, monkeypatch)
    assert [r.response_ids for r in ahead] == [r.response_ids for r in base]
    assert queued == 2
    buckets = {c[1] for c in ahead_chunks}
    assert min(buckets) < 8  # compacted
    row_steps = [sum(c[1] * c[3] for c in chunks) for chunks in (base_chunks, ahead_chunks)]
    assert row_steps[1] <= row_steps[0] + 8 * 4, row_steps
