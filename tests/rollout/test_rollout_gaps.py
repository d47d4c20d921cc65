"""Rollout-engine cases that the other rollout tests left unpinned (each found by mutation testing):
one- and two-token responses, cache prefixes past the first 64-entry length bucket, compaction under
speculation, acceptance at every draft depth, the per-depth reached counters, streaming, the Triton
kernel's per-query limits, and the top-p boundary."""

import math

import pytest
import torch
from _rollout_helpers import make_model, random_prompts, reference_sample, scripted_draw

from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout import runner as runner_mod
from splitrl.rollout import scheduler as scheduler_mod
from splitrl.rollout.drafter import MTPDrafter
from splitrl.rollout.fused import draft_window, plan_tensors, query_limits
from splitrl.rollout.sampling import filter_logits


def _assert_equals_reference(model, cfg, prompts, seeds, results):
    """Tokens and finish reasons exactly, logprobs within 2e-5 (fp32), of the step-by-step reference."""
    for prompt, seed, res in zip(prompts, seeds, results):
        tokens, logprobs, reason = reference_sample(
            model, prompt, seed, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens, stop_token_ids=tuple(cfg.stop_token_ids),
        )  # fmt: skip
        assert (res.response_ids, res.finish_reason) == (tokens, reason), (prompt, seed)
        torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(logprobs), atol=2e-5, rtol=0)


# ------------------------------------------------------------------ 1. one- and two-token responses
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_one_and_two_token_responses_equal_the_reference(speculative, max_new_tokens):
    """max_new_tokens 1 ends every row at its prefill (no row verifies) and 2 after one step or
    verify: the same tokens, logprobs and finish reasons as the step-by-step reference. Guards the
    prefill's length check (without it a one-token request returned two tokens)."""
    V = 32
    model = make_model(vocab=V, depths=2, hidden_size=32, intermediate_size=64, init=0.5, seed=2)
    cfg = GenerationConfig(
        speculative=speculative, temperature=0.9, max_new_tokens=max_new_tokens,
        stop_token_ids=list(range(8)), batch_size=3,
    )  # fmt: skip
    prompts = random_prompts(7, V, (1, 9), seed=31)
    seeds = [70 + i for i in range(7)]
    engine = RolloutEngine(model, cfg, "cpu")
    engine.speculative_switch_off = False
    results = engine.generate(prompts, seeds)
    _assert_equals_reference(model, cfg, prompts, seeds, results)
    assert {r.finish_reason for r in results} == {"stop", "length"}  # both end conditions
    stats = engine.last_stats
    assert stats.generated_tokens == sum(len(r.response_ids) for r in results)
    if max_new_tokens == 1:
        assert all(len(r.response_ids) == 1 for r in results)
        assert stats.drafted_tokens == 0  # done at the prefill: no row verifies
    elif speculative:
        assert stats.drafted_tokens > 0


# ------------------------------------------------------------------ 2. past the first length bucket
@pytest.mark.parametrize("speculative", [False, True])
def test_long_prompts_read_past_the_first_length_bucket(monkeypatch, speculative):
    """Prompts of 50-120 tokens plus 30 new ones: the decode steps read cache prefixes of 96..192
    entries (length buckets past 64); tokens, logprobs and finish reasons equal the reference.
    Guards the step's length bucket (a step reading 64 entries emitted other tokens)."""
    V = 32
    model = make_model(vocab=V, depths=2, hidden_size=32, intermediate_size=64, seed=1)
    cfg = GenerationConfig(
        speculative=speculative, temperature=0.9, max_new_tokens=30, stop_token_ids=[0], batch_size=2
    )
    prompts = random_prompts(3, V, (50, 120), seed=5)
    seeds = [0, 1, 2]
    assert max(len(p) for p in prompts) > 100
    lengths = []
    original = runner_mod.ModelRunner.run_steps

    def recording(self, kind, B, L, n):
        lengths.append(L)
        return original(self, kind, B, L, n)

    monkeypatch.setattr(runner_mod.ModelRunner, "run_steps", recording)
    engine = RolloutEngine(model, cfg, "cpu")
    engine.speculative_switch_off = False
    results = engine.generate(prompts, seeds)
    _assert_equals_reference(model, cfg, prompts, seeds, results)
    assert max(lengths) > 128, lengths  # the steps read past the first two length buckets
    if speculative:
        assert engine.last_stats.drafted_tokens > 0


# ------------------------------------------------------------------ 3. compaction under speculation
@pytest.mark.parametrize("depths", [2, 3])
def test_compaction_moves_the_mtp_cache_with_its_rows(monkeypatch, depths):
    """Speculative rows moved to lower slots (stop tokens end rows early, a sync every 2 verifies)
    draft as if they had never moved: each sample's (drafted, accepted) counts and tokens equal those
    of the same sample run alone. Guards the move of the MTP cache and (D = 3) of the carried MTP
    hidden states in the compaction (stale draft state only changes acceptance, never tokens: only
    the counts see it)."""
    V = 16
    model = make_model(vocab=V, depths=depths, hidden_size=32, intermediate_size=64)
    cfg = GenerationConfig(speculative=True, temperature=0.8, max_new_tokens=40, batch_size=8, stop_token_ids=[3, 5])
    prompts = random_prompts(8, V, (1, 7), seed=6)
    seeds = list(range(8))
    monkeypatch.setattr(scheduler_mod, "SYNC_EVERY", 2)
    moved = []
    original = scheduler_mod.Scheduler.compact

    def recording(self, active, *a):
        moved.extend(s for i, s in enumerate(active) if s != i)
        return original(self, active, *a)

    monkeypatch.setattr(scheduler_mod.Scheduler, "compact", recording)
    engine = RolloutEngine(model, cfg, "cpu")
    engine.speculative_switch_off = False
    batch = engine.generate(prompts, seeds)
    assert len(moved) >= 3, moved  # rows really moved
    monkeypatch.setattr(scheduler_mod.Scheduler, "compact", original)
    for p, s, b in zip(prompts, seeds, batch):
        alone = RolloutEngine(model, cfg, "cpu")
        alone.speculative_switch_off = False
        a = alone.generate([p], [s])[0]
        assert a.response_ids == b.response_ids
        assert (b.drafted_tokens, b.accepted_tokens) == (a.drafted_tokens, a.accepted_tokens), (p, s)
    assert sum(r.accepted_tokens for r in batch) > 20


# ------------------------------------------------------------------ 4, 5. acceptance at every depth
def _scripted_walk(seed: int, wrong: set, D: int, max_new: int) -> tuple[list[int], list[int], list[int]]:
    """(verifies by accepted count a = 0..D, reached per depth, accepted per depth) of one sample
    whose draft at response index i is right unless (seed, i) is in ``wrong``: from index c a
    verify accepts the leading right drafts a (<= D; counted whole even past ``max_new``) and emits
    a + 1 tokens; depth k is reached when a >= k - 1 and accepted when a >= k."""
    by_a, reached, accepted = [0] * (D + 1), [0] * D, [0] * D
    c = 1  # the prefill emitted index 0
    while c < max_new:
        a = 0
        while a < D and (seed, c + a) not in wrong:
            a += 1
        by_a[a] += 1
        for k in range(D):
            reached[k] += a >= k
            accepted[k] += a > k
        c += a + 1
    return by_a, reached, accepted


@pytest.mark.parametrize("depths,repeated", [(2, False), (3, False), (2, True), (3, True)])
def test_drafts_accepted_at_every_depth_give_the_plain_tokens_and_exact_counts(monkeypatch, depths, repeated):
    """Scripted drafts (right at most indices, so verifies accept 0..D drafts, D often) through
    separate and repeated MTP layers: greedy tokens and logprobs equal plain decoding, every depth
    accepts, and the per-sample and per-depth counts are those of a walk over the response
    (reached_k = accepted_{k-1}). Guards the verify's position advance by a + 1 (random heads rarely
    accept 2 drafts, so the other tests miss it) and the per-depth reached counters."""
    V, max_new = 64, 20
    model = make_model(vocab=V, depths=depths, repeated=repeated, hidden_size=32, intermediate_size=64)
    prompts = random_prompts(4, V, (2, 9), seed=8)
    seeds = [0, 1, 2, 3]
    plain = RolloutEngine(model, GenerationConfig(top_k=1, max_new_tokens=max_new + depths, batch_size=3), "cpu")
    ref_results = plain.generate(prompts, seeds)
    ref = {s: r.response_ids for s, r in zip(seeds, ref_results)}
    wrong = {(s, i) for s in seeds for i in range(max_new + depths) if (5 * s + i * i) % 7 < 2}

    monkeypatch.setattr(MTPDrafter, "_draw", scripted_draw(ref, wrong, V))
    spec = RolloutEngine(
        model, GenerationConfig(speculative=True, top_k=1, max_new_tokens=max_new, batch_size=3), "cpu"
    )
    spec.speculative_switch_off = False
    results = spec.generate(prompts, seeds)
    reached, accepted, by_a = [0] * depths, [0] * depths, [0] * (depths + 1)
    for s, r, p in zip(seeds, results, ref_results):
        assert r.response_ids == ref[s][:max_new] and r.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(p.logprobs[:max_new]), atol=1e-5, rtol=0)
        by_a_s, reached_s, accepted_s = _scripted_walk(s, wrong, depths, max_new)
        assert (r.drafted_tokens, r.accepted_tokens) == (depths * sum(by_a_s), sum(accepted_s)), s
        reached = [x + y for x, y in zip(reached, reached_s)]
        accepted = [x + y for x, y in zip(accepted, accepted_s)]
        by_a = [x + y for x, y in zip(by_a, by_a_s)]
    assert min(by_a) >= 3, by_a  # verifies accepting each of 0..D drafts
    stats = spec.last_stats
    assert all(a > 0 for a in stats.accepted_per_depth), stats.accepted_per_depth
    assert stats.reached_per_depth == reached and stats.accepted_per_depth == accepted
    assert stats.reached_per_depth[0] * depths == stats.drafted_tokens  # depth 1: every verify
    for k in range(1, depths):  # draft k+1 is reached exactly when draft k was accepted
        assert stats.reached_per_depth[k] == stats.accepted_per_depth[k - 1]


def test_reached_per_depth_counts_the_verifies_that_drafted_that_deep():
    """With the real (random) heads: reached_1 = verifies, reached_k = accepted_{k-1} for k >= 2,
    totals = sums over depths and over samples. Guards the reached counters (per-depth acceptance
    rates are accepted_k / reached_k)."""
    V = 8  # a small vocabulary and peaky distributions: random heads accept at depths 1 and 2
    model = make_model(vocab=V, depths=3, hidden_size=32, intermediate_size=64, init=1.0)
    cfg = GenerationConfig(
        speculative=True, temperature=0.5, top_k=2, max_new_tokens=30, batch_size=4, stop_token_ids=[1]
    )
    engine = RolloutEngine(model, cfg, "cpu")
    engine.speculative_switch_off = False
    results = engine.generate(random_prompts(8, V, (1, 8), seed=13), list(range(8)))
    stats = engine.last_stats
    assert stats.accepted_per_depth[0] > 0 and stats.accepted_per_depth[1] > 0, stats.accepted_per_depth
    assert stats.reached_per_depth[0] * 3 == stats.drafted_tokens == sum(r.drafted_tokens for r in results)
    assert sum(stats.accepted_per_depth) == stats.accepted_tokens == sum(r.accepted_tokens for r in results)
    for k in (1, 2):
        assert stats.reached_per_depth[k] == stats.accepted_per_depth[k - 1]
    rates = stats.acceptance_rate_per_depth
    assert rates[1] == pytest.approx(100.0 * stats.accepted_per_depth[1] / stats.accepted_per_depth[0], rel=1e-12)


# ------------------------------------------------------------------ 6. streaming
def test_stream_yields_a_sample_before_the_others_have_finished(monkeypatch):
    """generate_stream hands out a finished sample while other rows are still decoding: at the first
    yield a row of the same batch is short of its length limit and the call has generated fewer
    tokens than in the end. Guards streaming itself (a generator that ran the whole call before
    its first yield passed the other stream test)."""
    V = 32
    model = make_model(vocab=V, depths=2, hidden_size=32, intermediate_size=64, init=0.5)
    # seeds chosen so that sample 0 stops within 6 tokens and sample 1 runs to the limit
    cfg = GenerationConfig(temperature=1.0, max_new_tokens=30, stop_token_ids=[0, 1, 2], batch_size=2)
    prompts, seeds = [[5, 6, 7], [5, 6, 7]], [38, 3]
    full = RolloutEngine(model, cfg, "cpu").generate(prompts, seeds)
    assert len(full[0].response_ids) <= 6 and len(full[1].response_ids) == 30, [len(r.response_ids) for r in full]
    monkeypatch.setattr(scheduler_mod, "SYNC_EVERY", 1)
    engine = RolloutEngine(model, cfg, "cpu")
    stream = engine.generate_stream(prompts, seeds)
    i, first = next(stream)
    assert i == 0 and first.response_ids == full[0].response_ids
    counters = engine.runner.state.counter[:2].tolist()  # rows still decoding hold their live counters
    assert engine.last_stats.generated_tokens == len(first.response_ids)
    assert counters[1] <= len(first.response_ids) + 1 < 30, counters
    rest = list(stream)
    assert [j for j, _ in rest] == [1] and rest[0][1].response_ids == full[1].response_ids
    assert engine.last_stats.generated_tokens == len(first.response_ids) + 30


# ------------------------------------------------------------------ 7. per-query limits
def _draft_window_plans():
    """(positions, limits, length) of draft-window plans as the drafter builds them: depths 1..3,
    accepted 0..D, prompts shorter than the depth (positions clamped to 0), explicit queries, and
    a read length shorter than some positions (own entry outside the read)."""
    plans = []
    for depth in (1, 2, 3):
        for W in (2, 3, 4):
            p0 = torch.tensor([0, 1, 2, 5, 63, 64, 100])
            acc = torch.arange(len(p0)) % W
            for query in (None, p0 + acc + 1):
                pos, _, limit = draft_window(p0, acc, query, depth, W, scratch=199)
                for length in (int(pos.max()) + 1, int(pos.max()) + 9, 64):
                    plans.append((pos, limit, length))
    return plans


def test_query_limits_are_the_rule_of_the_masked_plan():
    """query_limits (what the Triton kernel reads: entries j <= limit and j = own, walking j < end)
    against plan_tensors' mask (the masked path) on draft-window plans of depths 1-3: the same
    allowed entries for every query, and each row's end is 1 + its largest allowed entry (none
    past it is skipped, none more walked). Guards the kernel's per-query rule on the CPU, where
    the kernel cannot run."""
    checked = 0
    for pos, limit, length in _draft_window_plans():
        B, Q = pos.shape
        limits, own, ends = query_limits(pos, limit, length)
        assert limits.dtype == own.dtype == ends.dtype == torch.int32
        _, mask = plan_tensors(pos, pos, limit, torch.arange(B), 1, 200, length, False)
        allowed = torch.isfinite(mask[:, 0, 0])  # [B, Q, length]
        j = torch.arange(length)
        rule = (j <= limits[..., None].long()) | (j == own[..., None].long())
        assert torch.equal(rule, allowed), (pos, limit, length)
        assert ((own == -1) == (pos >= length)).all() and (own[pos < length] == pos[pos < length]).all()
        for b in range(B):
            reads = allowed[b].any(0).nonzero()
            last = int(reads.max()) if len(reads) else 0
            assert int(ends[b]) == last + 1, (pos[b], limit[b], length, ends[b])
        checked += B
    assert checked > 300


# ------------------------------------------------------------------ 8. top-p boundary
def _nucleus_reference(logits: list[float], top_k: int, top_p: float) -> int:
    """How many tokens the filters keep, by definition, in float64: top-k (ties with the k-th kept),
    then the smallest most-likely prefix whose renormalized mass reaches top_p (a token is kept
    iff the mass before it is < top_p)."""
    x = sorted(logits, reverse=True)
    if 0 < top_k < len(x):
        x = [v for v in x if v >= x[top_k - 1]]
    finite = [v for v in x if v != -math.inf]
    m = max(finite)
    w = [math.exp(v - m) for v in finite]
    total = sum(w)
    kept, before = 0, 0.0
    for wi in w:
        if before >= top_p:
            break
        kept += 1
        before += wi / total
    return kept


@pytest.mark.parametrize(
    "logits,top_k,top_p,kept",
    [
        ([0.0, 0.0], 0, 0.5, 1),  # the first token's mass is exactly top_p: it alone reaches it
        ([0.0, 0.0], 0, 0.5000001, 2),
        ([0.0] * 4, 0, 0.25, 1),
        ([0.0] * 4, 0, 0.5, 2),
        ([0.0] * 4, 0, 0.75, 3),
        ([0.0, 0.0, -1.0, -2.0], 2, 0.5, 1),  # on the top-k-renormalized distribution
        ([0.0, 0.0, 0.0, 0.0, -math.inf], 0, 0.5, 2),
    ],
)
def test_top_p_keeps_the_smallest_prefix_that_reaches_it(logits, top_k, top_p, kept):
    """At the exact boundary (the kept tokens' mass equals top_p) top-p stops: the nucleus is the
    smallest prefix whose mass *reaches* top_p (config docstring). Hand-counted and by the float64
    reference. Guards the >= of the filter (a > kept one token too many at every boundary)."""
    assert _nucleus_reference(logits, top_k, top_p) == kept
    out = filter_logits(torch.tensor([logits]), top_k, top_p)[0]
    keep = torch.isfinite(out)
    assert int(keep.sum()) == kept
    # the kept ones are the most likely, their logits unchanged
    src = torch.tensor(logits)
    assert torch.equal(out[keep], src[keep])
    if not keep.all():
        assert float(src[keep].min()) >= float(src[~keep].max())


def test_top_k_top_p_filter_equals_a_hand_written_one_on_random_rows():
    """filter_logits on random rows (V = 50, several top-k / top-p) keeps exactly the tokens of the
    float64 reference, rows whose cumulative masses lie within 1e-5 of top_p left out."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 50, generator=g) * 2.0
    compared = 0
    for top_k, top_p in ((0, 0.9), (0, 0.5), (10, 0.8), (5, 1.0), (0, 0.05)):
        out = filter_logits(rows, top_k, top_p)
        for r in range(rows.shape[0]):
            x = rows[r].double()
            order = x.argsort(descending=True)
            pool = x[order[:top_k]] if top_k else x[order]
            cum = pool.softmax(-1).cumsum(-1)
            if top_p < 1.0 and (cum - top_p).abs().min() < 1e-5:
                continue
            kept = _nucleus_reference(rows[r].tolist(), top_k, top_p)
            expect = torch.zeros(50, dtype=torch.bool)
            expect[order[:kept]] = True
            assert torch.equal(torch.isfinite(out[r]), expect), (r, top_k, top_p)
            compared += 1
    assert compared > 190
