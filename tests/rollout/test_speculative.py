"""Self-speculative decoding with the MTP heads: exact outputs, exact draft caches, acceptance."""

import pytest
import torch
from _rollout_helpers import make_model, random_prompts, teacher_forced, teacher_forced_mtp_hidden

from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout import engine as engine_mod
from splitrl.rollout.drafter import MTPDrafter
from splitrl.rollout.sampling import filter_logits

VOCAB = 128


def _spec_and_plain(model, **cfg):
    spec = RolloutEngine(model, GenerationConfig(speculative=True, **cfg), "cpu")
    plain = RolloutEngine(model, GenerationConfig(speculative=False, **cfg), "cpu")
    return spec, plain


@pytest.mark.parametrize(
    "depths,repeated,attn", [(2, False, "sdpa"), (3, False, "sdpa"), (2, True, "sdpa"), (2, False, "eager")]
)
def test_greedy_speculative_equals_plain(depths, repeated, attn):
    model = make_model(vocab=VOCAB, depths=depths, repeated=repeated, attn=attn)
    spec, plain = _spec_and_plain(model, top_k=1, max_new_tokens=14, batch_size=4, stop_token_ids=[17, 99])
    prompts = random_prompts(6, VOCAB, (1, 8), seed=5)
    seeds = list(range(6))
    out_s, out_p = spec.generate(prompts, seeds), plain.generate(prompts, seeds)
    for s, p in zip(out_s, out_p):
        assert s.response_ids == p.response_ids and s.finish_reason == p.finish_reason
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-5, rtol=0)
    stats = spec.last_stats
    assert stats.speculative_active and stats.drafted_tokens > 0
    assert stats.num_forwards < plain.last_stats.num_forwards + 1  # never more forwards than plain


def test_speculative_logprobs_equal_teacher_forced():
    model = make_model(vocab=16, depths=2, hidden_size=32, intermediate_size=64)
    T = 0.8
    engine = RolloutEngine(
        model, GenerationConfig(speculative=True, temperature=T, max_new_tokens=16, batch_size=5), "cpu"
    )
    prompts = random_prompts(8, 16, (1, 6), seed=6)
    results = engine.generate(prompts, seeds=list(range(8)))
    for prompt, res in zip(prompts, results):
        ref, _ = teacher_forced(model, prompt, res.response_ids, T)
        torch.testing.assert_close(torch.tensor(res.logprobs), ref, atol=1e-5, rtol=0)
    stats = engine.last_stats
    assert stats.accepted_tokens > 0  # the multi-token path ran
    assert sum(r.accepted_tokens for r in results) == stats.accepted_tokens
    assert sum(r.drafted_tokens for r in results) == stats.drafted_tokens
    assert sum(stats.accepted_per_depth) == stats.accepted_tokens
    assert stats.reached_per_depth[0] == stats.drafted_tokens // 2  # depth 1 is reached every iteration
    assert all(0.0 <= r <= 100.0 for r in [stats.acceptance_rate, *stats.acceptance_rate_per_depth])
    metrics = stats.as_metrics()
    assert metrics["rollout/acceptance_rate"] == stats.acceptance_rate
    assert metrics["rollout/mtp_2_acceptance_rate"] == stats.acceptance_rate_per_depth[1]


@pytest.mark.parametrize("depths", [2, 3])
def test_draft_caches_match_teacher_forced_mtp(monkeypatch, depths):
    """Every draft distribution equals softmax(lm_head(h^k_{n-1})) of a full teacher-forced pass,
    wherever its inputs were the committed tokens (depth 1 always; depth k after k-1 right drafts).
    Depth 3 skips the positions the cache cannot hold yet (module docstring), so only k <= 2 is exact."""
    model = make_model(vocab=16, depths=depths, hidden_size=32, intermediate_size=64)
    records = []
    original = MTPDrafter.extend

    def recording_extend(self, new, *, draft, seed_lo_B, seed_hi_B, counter_B):
        out = original(self, new, draft=draft, seed_lo_B=seed_lo_B, seed_hi_B=seed_hi_B, counter_B=counter_B)
        if out is not None:
            records.append((seed_lo_B.tolist(), counter_B.tolist(), out[0].tolist(), out[1]))
        return out

    monkeypatch.setattr(MTPDrafter, "extend", recording_extend)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=12, batch_size=3), "cpu")
    prompts = random_prompts(5, 16, (1, 7), seed=7)
    seeds = [10, 11, 12, 13, 14]
    results = engine.generate(prompts, seeds)
    by_seed = {s: (p, r.response_ids) for s, p, r in zip(seeds, prompts, results)}
    hidden = {s: teacher_forced_mtp_hidden(model, p + resp) for s, (p, resp) in by_seed.items()}
    compared = {1: 0, 2: 0}
    for seed_rows, counters, drafts, q in records:
        for r, (seed, c) in enumerate(zip(seed_rows, counters)):
            prompt, resp = by_seed[seed]
            n = len(prompt) + c - 1  # absolute position of the last committed token
            for k in range(1, min(depths, 2) + 1):
                # inputs of depth k at n-1 are x_n .. x_{n+k-1}: committed iff drafts 1..k-1 are right
                if c + k - 2 >= len(resp) or drafts[r][: k - 1] != resp[c : c + k - 1]:
                    continue
                h = hidden[seed][k][n - 1]
                ref = (h @ model.output_weight.T).float().softmax(-1)
                torch.testing.assert_close(q[r, k - 1], ref, atol=1e-5, rtol=0)
                compared[k] += 1
    assert compared[1] > 10 and compared[2] > 3


@torch.no_grad()
def _exact_first_tokens(model, prompt, T, top_k, n):
    """Exact probabilities of every n-token continuation (V^n of them) under the filtered sampling
    distribution, by teacher forcing."""
    V = model.config.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(V)] * n)
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    hidden = model.backbone.model(input_ids=ids).last_hidden_state[:, len(prompt) - 1 : -1]
    logits = filter_logits((hidden @ model.output_weight.T).float() / T, top_k, 1.0)
    lp = logits.log_softmax(-1).gather(-1, seqs[..., None]).squeeze(-1)
    return lp.sum(-1).exp().double()


@pytest.mark.parametrize("top_k", [0, 3])
def test_speculative_samples_the_target_distribution(monkeypatch, top_k):
    monkeypatch.setattr(engine_mod, "CALIBRATION_INTERVAL", 0)  # every token after the first is speculative
    V, N, n, T = 4, 6000, 3, 0.9
    model = make_model(vocab=V, depths=2, init=0.5, hidden_size=32, intermediate_size=64)
    prompt = [1, 2]
    cfg = GenerationConfig(speculative=True, temperature=T, top_k=top_k, max_new_tokens=n, batch_size=N)
    engine = RolloutEngine(model, cfg, "cpu")
    results = engine.generate([prompt] * N, seeds=list(range(N)))
    # tokens 2 and 3 came from accepted drafts and from residual draws alike
    stats = engine.last_stats
    assert 10.0 < stats.acceptance_rate < 90.0 and stats.reached_per_depth[0] - stats.accepted_per_depth[0] > 500
    probs = _exact_first_tokens(model, prompt, T, top_k, n)
    codes = torch.tensor([(r.response_ids[0] * V + r.response_ids[1]) * V + r.response_ids[2] for r in results])
    counts = torch.bincount(codes, minlength=V**n).double()
    if top_k:
        assert counts[probs == 0].sum() == 0  # nothing outside the top-k is ever emitted
    big = probs * N >= 5  # chi-square cells; the rare rest is pooled into one
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([probs[big] * N, (probs[~big].sum() * N)[None]])
    stat = ((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum()
    df = int(big.sum())
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))
    assert p_value > 1e-3, p_value


class _ScriptedDrafter:
    """Proposes the reference greedy continuation, but gets it wrong where a fixed pattern says so."""

    def __init__(self, reference, wrong, model, num_drafts, *args):
        self.reference, self.wrong, self.D, self.V = reference, wrong, num_drafts, model.config.vocab_size

    def select(self, rows):
        pass

    def extend(self, new, *, draft, seed_lo_B, seed_hi_B, counter_B):
        if not draft:
            return None
        drafts = []
        for seed, c in zip(seed_lo_B.tolist(), counter_B.tolist()):
            ref = self.reference[seed]
            row = []
            for j in range(self.D):
                i = c + j
                tok = ref[i] if i < len(ref) else 0
                row.append((tok + 1) % self.V if (seed, i) in self.wrong else tok)
            drafts.append(row)
        drafts = torch.tensor(drafts)
        return drafts, torch.nn.functional.one_hot(drafts, self.V).float()


def test_verify_accepts_right_drafts_and_corrects_wrong_ones(monkeypatch):
    """With a scripted draft, greedy output equals plain and the accept counts are the expected ones."""
    model = make_model(vocab=VOCAB, depths=3)
    spec = RolloutEngine(model, GenerationConfig(speculative=True, top_k=1, max_new_tokens=20, batch_size=3), "cpu")
    plain = RolloutEngine(model, GenerationConfig(top_k=1, max_new_tokens=23, batch_size=3), "cpu")
    prompts = random_prompts(4, VOCAB, (2, 9), seed=8)
    seeds = [0, 1, 2, 3]
    # the reference runs 3 tokens longer: the last verify may accept drafts past the length limit
    ref = {s: r.response_ids for s, r in zip(seeds, plain.generate(prompts, seeds))}
    wrong = {(s, i) for s in seeds for i in range(20) if (7 * s + 3 * i) % 5 == 0}
    monkeypatch.setattr(engine_mod, "MTPDrafter", lambda *a: _ScriptedDrafter(ref, wrong, *a))
    monkeypatch.setattr(engine_mod, "CALIBRATION_INTERVAL", 0)  # no plain steps: exact counts below
    results = spec.generate(prompts, seeds)
    for s, r in zip(seeds, results):
        assert r.response_ids == ref[s][:20]
        # walk the response as the engine must: from index c, accept drafts until the first wrong one
        expected_acc, c = 0, 1
        while c < 20:
            a = 0
            while a < 3 and (s, c + a) not in wrong:
                a += 1
            expected_acc += a
            c += a + 1
        assert r.accepted_tokens == expected_acc
    assert spec.last_stats.num_forwards < 0.6 * 2 * 19  # plain: 2 batches (3 + 1 rows) x 19 decode steps


def test_switches_itself_off_when_slower_and_back_on_after_a_sync(monkeypatch):
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=40, batch_size=2), "cpu")
    prompts, seeds = [[1, 2], [3]], [0, 1]
    monkeypatch.setattr(engine_mod._Timing, "speedup", lambda self: 1.5)
    engine.generate(prompts, seeds)
    assert engine.last_stats.speculative_active and engine.last_stats.speculative_next
    monkeypatch.setattr(engine_mod._Timing, "speedup", lambda self: 0.5)
    engine.generate(prompts, seeds)
    assert engine.last_stats.speculative_active and not engine.last_stats.speculative_next
    assert engine.last_stats.as_metrics()["rollout/speculative_next"] == 0.0
    off = engine.generate(prompts, seeds)
    assert not engine.last_stats.speculative_active and engine.last_stats.drafted_tokens == 0
    assert "rollout/acceptance_rate" not in engine.last_stats.as_metrics()
    assert all(r.drafted_tokens == 0 for r in off)
    engine.load_state_dict(model.state_dict(), version=1)
    engine.generate(prompts, seeds)
    assert engine.last_stats.speculative_active


def test_speedup_is_measured_against_plain_steps():
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=60, batch_size=4), "cpu")
    engine.generate(random_prompts(4, VOCAB, (1, 4), seed=9), seeds=[0, 1, 2, 3])
    speedup = engine.last_stats.speculative_speedup
    assert speedup is not None and speedup > 0


def test_every_cached_mtp_entry_matches_teacher_forcing(monkeypatch):
    """Each slot an extension marks valid holds depth k's teacher-forced output at its position,
    for every depth (3 here): the caches are filled exactly as training computes the MTP branch."""
    monkeypatch.setattr(engine_mod, "CALIBRATION_INTERVAL", 3)  # mix plain steps (1-slot extensions) in
    model = make_model(vocab=16, depths=3, hidden_size=32, intermediate_size=64)
    outputs, checks = [], []
    original_depth = type(model.mtp).depth_forward
    original_extend = MTPDrafter.extend

    def recording_depth(self, depth, embeds, hidden, **kw):
        out = original_depth(self, depth, embeds, hidden, **kw)
        outputs.append((depth, kw["position_ids"], out))
        return out

    def recording_extend(self, new, **kw):
        outputs.clear()
        result = original_extend(self, new, **kw)
        for depth, positions, out in outputs:
            valid = self.valid[depth - 1][:, -positions.shape[1] :]
            checks.append((kw["seed_lo_B"].tolist(), depth, positions, valid, out))
        return result

    monkeypatch.setattr(type(model.mtp), "depth_forward", recording_depth)
    monkeypatch.setattr(MTPDrafter, "extend", recording_extend)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=14, batch_size=3), "cpu")
    prompts = random_prompts(4, 16, (1, 7), seed=10)
    seeds = [20, 21, 22, 23]
    results = engine.generate(prompts, seeds)
    hidden = {s: teacher_forced_mtp_hidden(model, p + r.response_ids) for s, p, r in zip(seeds, prompts, results)}
    compared = [0, 0, 0]
    for seed_rows, depth, positions, valid, out in checks:
        for r, seed in enumerate(seed_rows):
            for j in valid[r].nonzero().flatten().tolist():
                t = int(positions[r, j])
                torch.testing.assert_close(out[r, j], hidden[seed][depth][t], atol=1e-5, rtol=1e-4)
                compared[depth - 1] += 1
    assert min(compared) > 20


@pytest.mark.parametrize("speculative", [False, True])
def test_cache_compaction_changes_nothing(monkeypatch, speculative):
    """Dropping dead KV slots (finished rows' padding, rejected drafts) leaves every sample as it was."""
    model = make_model(vocab=16, depths=2, hidden_size=32, intermediate_size=64)
    cfg = GenerationConfig(
        speculative=speculative, temperature=0.9, max_new_tokens=24, batch_size=6, stop_token_ids=[3]
    )
    prompts = random_prompts(6, 16, (1, 12), seed=11)
    seeds = list(range(6))
    monkeypatch.setattr(engine_mod, "CALIBRATION_INTERVAL", 0)
    monkeypatch.setattr(engine_mod, "COMPACT_MIN_HOLES", 10**9)
    loose = RolloutEngine(model, cfg, "cpu").generate(prompts, seeds)
    compactions = []
    original = engine_mod.compact_cache
    monkeypatch.setattr(engine_mod, "compact_cache", lambda c, v: compactions.append(v.shape) or original(c, v))
    monkeypatch.setattr(engine_mod, "COMPACT_MIN_HOLES", 1)
    monkeypatch.setattr(engine_mod, "COMPACT_MIN_FRACTION", 0.0)
    dense = RolloutEngine(model, cfg, "cpu").generate(prompts, seeds)
    assert len(compactions) >= (5 if speculative else 1)
    for a, b in zip(loose, dense):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
