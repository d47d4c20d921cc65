"""Self-speculative decoding with the MTP heads: the same tokens as plain decoding (on, off, or
switched off midway), exact draft caches, acceptance counts, the switch-off rule."""

import time

import pytest
import torch
from _rollout_helpers import make_model, random_prompts, scripted_draw, teacher_forced, teacher_forced_mtp_hidden

from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout import results as results_mod
from splitrl.rollout import runner as runner_mod
from splitrl.rollout import scheduler as scheduler_mod
from splitrl.rollout import spec_policy as spec_policy_mod
from splitrl.rollout.drafter import MTPDrafter
from splitrl.rollout.sampling import filter_logits, seed_words

VOCAB = 128


def _spec_and_plain(model, **cfg):
    spec = RolloutEngine(model, GenerationConfig(speculative=True, **cfg), "cpu")
    plain = RolloutEngine(model, GenerationConfig(speculative=False, **cfg), "cpu")
    return spec, plain


@pytest.mark.parametrize(
    "depths,repeated,attn,family",
    [
        (2, False, "sdpa", "qwen3"),
        (3, False, "sdpa", "qwen3"),
        (2, True, "sdpa", "qwen3"),
        (2, False, "eager", "qwen3"),
        (2, False, "sdpa", "llama"),
        (2, False, "sdpa", "qwen2"),
    ],
)
def test_greedy_speculative_equals_plain(depths, repeated, attn, family):
    model = make_model(vocab=VOCAB, depths=depths, repeated=repeated, attn=attn, family=family)
    spec, plain = _spec_and_plain(model, top_k=1, max_new_tokens=14, batch_size=4, stop_token_ids=[17, 99])
    prompts = random_prompts(6, VOCAB, (1, 8), seed=5)
    seeds = list(range(6))
    out_s, out_p = spec.generate(prompts, seeds), plain.generate(prompts, seeds)
    for s, p in zip(out_s, out_p):
        assert s.response_ids == p.response_ids and s.finish_reason == p.finish_reason
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-5, rtol=0)
    stats = spec.last_stats
    assert stats.speculative_active and stats.drafted_tokens > 0  # random heads: acceptance may be 0 here


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_speculative_logprobs_equal_teacher_forced(family):
    model = make_model(vocab=16, depths=2, hidden_size=32, intermediate_size=64, family=family)
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
def test_draft_distributions_match_teacher_forced_mtp(monkeypatch, depths):
    """Every draft's MTP logits equal lm_head(h^k_{n-1}) of a full teacher-forced pass wherever its
    inputs were committed tokens (depth 1 always; depth k after k-1 right drafts). Depth 3 lacks the
    positions its cache cannot hold yet (drafter docstring), so only k <= 2 is exact; several
    samples through 2 slots exercise refills and the windowed cache updates."""
    model = make_model(vocab=16, depths=depths, hidden_size=32, intermediate_size=64)
    T = 0.9
    records = []
    original_init = MTPDrafter.__init__

    def init(self, *a, **kw):
        original_init(self, *a, **kw)
        self.probe = lambda lo, c, k, logits: records.append((lo.tolist(), c.tolist(), k, logits.clone()))

    monkeypatch.setattr(MTPDrafter, "__init__", init)
    engine = RolloutEngine(
        model, GenerationConfig(speculative=True, temperature=T, max_new_tokens=12, batch_size=2), "cpu"
    )
    prompts = random_prompts(5, 16, (1, 7), seed=7)
    seeds = [10, 11, 12, 13, 14]
    results = engine.generate(prompts, seeds)
    by_seed = {s: (p, r.response_ids) for s, p, r in zip(seeds, prompts, results)}
    hidden = {s: teacher_forced_mtp_hidden(model, p + resp) for s, (p, resp) in by_seed.items()}
    first = {}  # (seed, response index, depth) -> logits of the first draw (a finished row repeats
    for lo_rows, counters, k, logits in records:  # its last draws until the host syncs)
        for r, key in enumerate(zip(lo_rows, counters)):
            first.setdefault((*key, k), logits[r])
    compared = {1: 0, 2: 0}
    for (seed, idx, k), logits in first.items():
        prompt, resp = by_seed[seed]
        c = idx - (k - 1)  # tokens emitted when drafting: x_n = response[c - 1], drafting from n - 1
        if k > 2 or c >= len(resp):  # the draws after the last verify of a row are never used
            continue
        if k == 2 and _race_token(first[(seed, c, 1)], seed, c) != resp[c]:
            continue  # depth 2 read a wrong draft
        n = len(prompt) + c - 1
        ref = (hidden[seed][k][n - 1] @ model.output_weight.T).float() / T
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        compared[k] += 1
    assert compared[1] > 10 and compared[2] > 3


def _race_token(logits_V, seed, idx):
    """The draft drawn from unfiltered logits: the race winner under the target's noise."""
    from splitrl.rollout.sampling import STREAM_TARGET, race_sample

    lo, hi = seed_words([seed], torch.device("cpu"))
    return int(race_sample(logits_V[None], lo, hi, torch.tensor([idx]), STREAM_TARGET)[0])


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


def test_verify_accepts_right_drafts_and_corrects_wrong_ones(monkeypatch):
    """With scripted drafts, greedy output equals plain and the accept counts are the expected ones."""
    model = make_model(vocab=VOCAB, depths=3)
    spec = RolloutEngine(model, GenerationConfig(speculative=True, top_k=1, max_new_tokens=20, batch_size=3), "cpu")
    plain = RolloutEngine(model, GenerationConfig(top_k=1, max_new_tokens=23, batch_size=3), "cpu")
    prompts = random_prompts(4, VOCAB, (2, 9), seed=8)
    seeds = [0, 1, 2, 3]
    # the reference runs 3 tokens longer: the last verify may accept drafts past the length limit
    ref = {s: r.response_ids for s, r in zip(seeds, plain.generate(prompts, seeds))}
    wrong = {(s, i) for s in seeds for i in range(20) if (7 * s + 3 * i) % 5 == 0}

    monkeypatch.setattr(MTPDrafter, "_draw", scripted_draw(ref, wrong, VOCAB))
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


def _switch_off_after(monkeypatch, iterations):
    """Make the switch-off rule decide after ``iterations`` verify iterations, with timings that
    make plain steps look free."""
    monkeypatch.setattr(spec_policy_mod, "SWITCH_MIN_ITERATIONS", iterations)
    monkeypatch.setattr(runner_mod.ModelRunner, "plain_step_time", lambda self, B, L: 1e-9)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 10, 0.9)])
def test_speculation_on_off_and_switched_off_midway_give_the_same_samples(monkeypatch, temperature, top_k, top_p):
    """DESIGN §5: a sample's tokens depend on its prompt, seed and logits only (fp32, CPU)."""
    model = make_model(vocab=32, depths=2, hidden_size=32, intermediate_size=64, init=0.5)
    cfg = dict(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=40, stop_token_ids=[3], batch_size=4)
    prompts = random_prompts(9, 32, (1, 8), seed=12)
    seeds = [50 + i for i in range(9)]
    monkeypatch.setattr(spec_policy_mod, "SWITCH_MIN_ITERATIONS", 10**9)  # speculative throughout
    spec, plain = _spec_and_plain(model, **cfg)
    out_s, out_p = spec.generate(prompts, seeds), plain.generate(prompts, seeds)
    assert spec.last_stats.accepted_tokens > 0 and spec.last_stats.switched_off_at_iteration is None
    _switch_off_after(monkeypatch, 3)
    midway = RolloutEngine(model, GenerationConfig(speculative=True, **cfg), "cpu")
    out_m = midway.generate(prompts, seeds)
    stats = midway.last_stats
    assert stats.switched_off_at_iteration is not None and stats.accepted_tokens > 0
    assert stats.speculative_active and not stats.speculative_next
    for s, p, m in zip(out_s, out_p, out_m):
        assert s.response_ids == p.response_ids == m.response_ids
        assert s.finish_reason == p.finish_reason == m.finish_reason
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(m.logprobs), torch.tensor(p.logprobs), atol=1e-5, rtol=0)


def test_deterministic_rollouts_give_bit_identical_logprobs_whatever_the_timings(monkeypatch):
    """rollout.deterministic: the speculation decision reads no clock. Under timings that make the
    switch-off rule and the measured choice decode plainly (plain steps free, plain calls faster)
    and under timings that keep speculation on (the reverse), every call is speculative and the
    tokens and logprobs are bit-identical. Without the switch the same timings do decide both
    ways (checked here), and logprobs of tokens a plain step emits differ from a verify's in the
    last bits (16 of 202 here on CPU fp32: matrix products of other shapes round otherwise)."""
    model = make_model(vocab=32, depths=2, hidden_size=32, intermediate_size=64, init=0.5)
    prompts, seeds = random_prompts(9, 32, (1, 8), seed=12), [50 + i for i in range(9)]
    monkeypatch.setattr(spec_policy_mod, "SWITCH_MIN_ITERATIONS", 3)
    real_record = spec_policy_mod.SpecPolicy.record_call
    plain_wins = (1e-9, {2: 50.0, 1: 50.0, 0: 100.0})  # (plain step seconds, call tokens/s by drafts)
    spec_wins = (1e3, {2: 100.0, 1: 100.0, 0: 50.0})

    def run(deterministic: bool, timings) -> list[tuple[list[int], torch.Tensor, bool, int | None, int]]:
        step_s, speed = timings
        monkeypatch.setattr(runner_mod.ModelRunner, "plain_step_time", lambda self, B, L: step_s)
        monkeypatch.setattr(
            spec_policy_mod.SpecPolicy,
            "record_call",
            lambda self, kind, b, rate: real_record(self, kind, b, speed[kind]),
        )
        cfg = GenerationConfig(
            speculative=True, deterministic=deterministic, max_new_tokens=40, stop_token_ids=[3], batch_size=4
        )
        engine = RolloutEngine(model, cfg, "cpu")
        calls = []
        for _ in range(4):  # kinds measured: 2 drafts, plain, 1 draft; the fourth call is the choice
            results = engine.generate(prompts, seeds)
            stats = engine.last_stats
            tokens = [t for r in results for t in r.response_ids]
            logprobs = torch.tensor([lp for r in results for lp in r.logprobs])
            calls.append((tokens, logprobs, stats.speculative_active, stats.switched_off_at_iteration, stats.num_drafts))
        return calls

    timed = run(False, plain_wins), run(False, spec_wins)  # the timings decide both ways
    # plain wins: each speculative kind is switched off inside its first call, then plain runs
    assert [c[4] for c in timed[0]] == [2, 0, 1, 0] and [c[3] is not None for c in timed[0]] == [True, False, True, False]
    assert [c[4] for c in timed[1]] == [2, 0, 1, 2] and all(c[3] is None for c in timed[1])  # plain measured once
    a, b = run(True, plain_wins), run(True, spec_wins)
    for x, y in zip(a, b):
        assert x[2] and y[2] and x[3] is None and y[3] is None  # speculative throughout
        assert x[4] == y[4] == 2  # every depth drafts
        assert x[0] == y[0] == a[0][0]
        assert torch.equal(x[1], y[1]) and torch.equal(x[1], a[0][1])  # bit for bit
    assert timed[0][0][0] == a[0][0]  # the tokens never depended on it


def test_switches_itself_off_when_slower_and_back_on_after_a_sync(monkeypatch):
    """The in-call rule (the measured choice between calls is tested below; off here)."""
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=40, batch_size=2), "cpu")
    prompts, seeds = [[1, 2], [3]], [0, 1]
    monkeypatch.setattr(spec_policy_mod.SpecPolicy, "record_call", lambda *a: None)
    monkeypatch.setattr(spec_policy_mod, "SWITCH_MIN_ITERATIONS", 2)
    monkeypatch.setattr(runner_mod.ModelRunner, "plain_step_time", lambda self, B, L: 1e3)  # plain is slow
    engine.generate(prompts, seeds)
    assert engine.last_stats.speculative_active and engine.last_stats.speculative_next
    assert engine.last_stats.speculative_speedup >= 1.0
    monkeypatch.setattr(runner_mod.ModelRunner, "plain_step_time", lambda self, B, L: 1e-9)  # plain is fast
    engine.generate(prompts, seeds)
    assert engine.last_stats.speculative_active and not engine.last_stats.speculative_next
    assert engine.last_stats.speculative_speedup < 1.0
    assert engine.last_stats.as_metrics()["rollout/speculative_next"] == 0.0
    off = engine.generate(prompts, seeds)
    assert not engine.last_stats.speculative_active and engine.last_stats.drafted_tokens == 0
    assert "rollout/acceptance_rate" not in engine.last_stats.as_metrics()
    assert all(r.drafted_tokens == 0 for r in off)
    engine.load_state_dict(model.state_dict(), version=1)
    engine.generate(prompts, seeds)
    assert engine.last_stats.speculative_active


def test_step_times_are_measured_without_changing_the_samples(monkeypatch):
    """Timing both step kinds runs them on the live state at every sync and restores it: the
    samples and the acceptance counts are those of a run that never times."""
    model = make_model(vocab=VOCAB, depths=2)
    cfg = GenerationConfig(speculative=True, max_new_tokens=30, batch_size=4, stop_token_ids=[5])
    prompts, seeds = random_prompts(6, VOCAB, (1, 4), seed=9), list(range(6))
    monkeypatch.setattr(spec_policy_mod, "SWITCH_MIN_ITERATIONS", 10**9)
    reference = RolloutEngine(model, cfg, "cpu").generate(prompts, seeds)

    original = runner_mod.ModelRunner.plain_step_time
    timed = []

    def time_every_chunk(self, B, L):
        self._step_times.clear()  # measure again at every sync
        timed.append(original(self, B, L))
        return timed[-1]

    monkeypatch.setattr(runner_mod.ModelRunner, "plain_step_time", time_every_chunk)
    monkeypatch.setattr(spec_policy_mod.SpecPolicy, "should_switch_off", lambda *a: False)
    results = RolloutEngine(model, cfg, "cpu").generate(prompts, seeds)
    assert len(timed) > 3 and all(t > 0 for t in timed)
    for a, b in zip(reference, results):
        assert a.response_ids == b.response_ids
        assert (a.drafted_tokens, a.accepted_tokens) == (b.drafted_tokens, b.accepted_tokens)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_every_mtp_cache_entry_matches_teacher_forcing(monkeypatch, family):
    """Every entry the drafter writes as valid (prefill prefix, verify windows), at every depth (3
    here), holds depth k's teacher-forced output h^k at its position: the static MTP caches are
    filled exactly as training computes the MTP branch. Refills (5 samples, 2 slots) included; with
    Qwen2, the MTP layers' q/k/v biases too."""
    from splitrl.rollout.forward import DecoderForward

    model = make_model(vocab=16, depths=3, hidden_size=32, intermediate_size=64, family=family)
    writes = []  # (seed, depth, position, output)
    context = {}
    original_prefill, original_step = MTPDrafter.prefill, MTPDrafter.step
    original_mtp_prefill, original_mtp_decode = DecoderForward.mtp_prefill, DecoderForward.mtp_decode

    def prefill(self, h0, seq, n, slots, lo, hi, **kw):
        context.update(seeds=lo.tolist(), n=n.tolist(), scratch=self.cache.scratch)
        return original_prefill(self, h0, seq, n, slots, lo, hi, **kw)

    def step(self, h0, t, a, p0, counter, carry, lo, hi, length, **kw):
        context.update(seeds=lo.tolist(), n=None, scratch=self.cache.scratch)
        return original_step(self, h0, t, a, p0, counter, carry, lo, hi, length, **kw)

    def mtp_prefill(self, depth, embeds, hidden, slots, cache):
        out = original_mtp_prefill(self, depth, embeds, hidden, slots, cache)
        for r, (seed, n) in enumerate(zip(context["seeds"], context["n"])):
            for t in range(n - depth + 1):  # valid prefix: x_{t+k} is committed
                writes.append((seed, depth, t, out[r, t]))
        return out

    def mtp_decode(self, depth, embeds, hidden, positions, write, limit, cache, length, slots=None):
        out = original_mtp_decode(self, depth, embeds, hidden, positions, write, limit, cache, length, slots)
        if context["n"] is None:  # a verify window (the query, last column for k >= 2, reads a draft)
            W = out.shape[1] - (1 if depth >= 2 else 0)
            for r, seed in enumerate(context["seeds"]):
                for j in range(W):
                    if int(write[r, j]) != context["scratch"]:
                        writes.append((seed, depth, int(write[r, j]), out[r, j]))
        return out

    monkeypatch.setattr(MTPDrafter, "prefill", prefill)
    monkeypatch.setattr(MTPDrafter, "step", step)
    monkeypatch.setattr(DecoderForward, "mtp_prefill", mtp_prefill)
    monkeypatch.setattr(DecoderForward, "mtp_decode", mtp_decode)
    monkeypatch.setattr(spec_policy_mod, "SWITCH_MIN_ITERATIONS", 10**9)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=14, batch_size=2), "cpu")
    prompts = random_prompts(5, 16, (1, 7), seed=10)
    seeds = [20, 21, 22, 23, 24]
    results = engine.generate(prompts, seeds)
    full = {s: p + r.response_ids for s, p, r in zip(seeds, prompts, results)}
    hidden = {s: teacher_forced_mtp_hidden(model, ids) for s, ids in full.items()}
    first = {}
    for seed, depth, t, out in writes:
        first.setdefault((seed, depth, t), out)  # a finished row rewrites garbage until the host syncs
    compared = [0, 0, 0]
    for (seed, depth, t), out in first.items():
        if t + depth > len(full[seed]) - 1:  # past the sample's last committed input: a finished row
            continue
        torch.testing.assert_close(out, hidden[seed][depth][t], atol=1e-5, rtol=1e-4)
        compared[depth - 1] += 1
    assert min(compared) > 20, compared


def test_switch_off_estimate_counts_the_host_time_of_each_chunk():
    """speedup = plain wall / verify wall for the same tokens, plain wall = a·Σt_plain +
    (a·iterations / SYNC_EVERY)·h, h = (wall - device) per verify chunk. A device-only estimate
    (the old rule) overstated the speedup where host work per chunk is large."""
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=8, batch_size=2), "cpu")
    engine.speculative_switch_off = False
    stats = results_mod.RolloutStats(num_drafts=2, drafted_tokens=100, accepted_tokens=50)  # a = 1 + 2 · 0.5 = 2
    # 4 chunks of 8 iterations: device 4 ms per iteration, 10 ms host per chunk; plain step 2.5 ms
    timing = spec_policy_mod.SpecTiming(
        spec_s=32 * 4e-3, wall_s=32 * 4e-3 + 4 * 10e-3, plain_s=32 * 2.5e-3, chunks=4, iterations=32
    )
    engine.policy.should_switch_off(timing, stats, [0, 0], [0, 0])
    a = 2.0
    plain_wall = a * 32 * 2.5e-3 + a * 32 / scheduler_mod.SYNC_EVERY * 10e-3
    assert stats.speculative_speedup == pytest.approx(plain_wall / (32 * 4e-3 + 40e-3), rel=1e-12)
    device_only = a * 32 * 2.5e-3 / (32 * 4e-3)
    assert stats.speculative_speedup < device_only  # 1.19 vs 1.25


def _fixed_speeds(monkeypatch, speed: dict[int, float]) -> None:
    """The measured choice fed fixed call speeds (tokens/s by drafts a verify, 0: plain)."""
    real_record = spec_policy_mod.SpecPolicy.record_call
    monkeypatch.setattr(
        spec_policy_mod.SpecPolicy, "record_call", lambda self, drafts, b, rate: real_record(self, drafts, b, speed[drafts])
    )
    monkeypatch.setattr(spec_policy_mod.SpecPolicy, "should_switch_off", lambda *a: False)


def test_measured_choice_runs_the_faster_kind_and_revisits_the_others(monkeypatch):
    """Between calls the engine measures whole calls of each kind (drafts a verify: D, plain, then
    D-1 .. 1), then runs the fastest, and every EXPLORE_EVERY calls the kind measured longest ago;
    per row bucket. Guards the 'never slower than plain once decided' rule against an in-call
    estimate that errs (it said 1.15x where 0.94x was measured on an H200). The samples never change."""
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=12, batch_size=2), "cpu")
    prompts, seeds = [[1, 2], [3]], [0, 1]
    _fixed_speeds(monkeypatch, {2: 50.0, 1: 70.0, 0: 100.0})  # plain is fastest, then one draft
    kinds, outs = [], []
    E = spec_policy_mod.EXPLORE_EVERY
    for _ in range(2 * E + 5):
        outs.append([r.response_ids for r in engine.generate(prompts, seeds)])
        kinds.append(engine.last_stats.num_drafts)
        assert engine.last_stats.speculative_active == (kinds[-1] > 0)
    assert kinds[:3] == [2, 0, 1]  # measure every kind
    assert kinds[3 : 3 + E] == [0] * E  # the fastest
    assert kinds[3 + E] == 2  # the kind measured longest ago, once
    assert kinds[4 + E : 4 + 2 * E] == [0] * E
    assert kinds[4 + 2 * E] == 1  # then the other one
    assert all(o == outs[0] for o in outs)
    # another bucket (one row) is measured on its own
    engine.generate([[4]], [2])
    assert engine.last_stats.num_drafts == 2
    # the benchmark's switch: every call drafts every depth
    engine.speculative_switch_off = False
    engine.generate(prompts, seeds)
    assert engine.last_stats.num_drafts == 2


def test_measured_choice_drafts_fewer_tokens_where_that_is_faster(monkeypatch):
    """On an H200 at batch 32 one draft a verify of two MTP heads measured 1.39x plain and two 1.19x
    (a verify of 64 rows against 96): the choice then settles on one draft, with the same samples;
    the metrics say how many drafts the call made."""
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=12, batch_size=2), "cpu")
    prompts, seeds = [[1, 2], [3]], [0, 1]
    _fixed_speeds(monkeypatch, {2: 119.0, 1: 139.0, 0: 100.0})
    kinds, outs = [], []
    for _ in range(6):
        outs.append([r.response_ids for r in engine.generate(prompts, seeds)])
        kinds.append(engine.last_stats.num_drafts)
    assert kinds == [2, 0, 1, 1, 1, 1]
    assert all(o == outs[0] for o in outs)
    stats = engine.last_stats
    assert stats.speculative_next and stats.as_metrics()["rollout/num_drafts"] == 1.0
    assert stats.reached_per_depth[1] == 0 and stats.reached_per_depth[0] > 0


def test_a_kind_switched_off_inside_its_call_does_not_stop_the_others(monkeypatch):
    """Two drafts a verify slower than plain (the in-call rule switches them off inside the call)
    while one draft is the fastest kind: the next calls still measure plain and one draft, settle
    on one draft, and re-measuring two drafts (switched off again) does not turn speculation off
    for the calls after it. A weight sync measures the switched-off kind again first."""
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=12, batch_size=2), "cpu")
    prompts, seeds = [[1, 2], [3]], [0, 1]
    speed = {1: 139.0, 0: 100.0}
    real_record = spec_policy_mod.SpecPolicy.record_call
    monkeypatch.setattr(
        spec_policy_mod.SpecPolicy, "record_call", lambda self, d, b, rate: real_record(self, d, b, speed[d])
    )

    def rule(self, timing, stats, *live):  # the in-call rule, tripping for two drafts only
        if stats.num_drafts != 2:
            return False
        stats.speculative_speedup = 0.9
        self.record_switch_off(stats, per_iter=1.5)
        return True

    monkeypatch.setattr(spec_policy_mod.SpecPolicy, "should_switch_off", rule)
    E = spec_policy_mod.EXPLORE_EVERY
    kinds, outs = [], []
    for _ in range(E + 6):
        outs.append([r.response_ids for r in engine.generate(prompts, seeds)])
        kinds.append(engine.last_stats.num_drafts)
        if kinds[-1] == 2:
            assert engine.last_stats.switched_off_at_iteration is not None
    assert kinds[:3] == [2, 0, 1]  # two drafts switched off inside the first call; the rest measured
    assert kinds[3 : 3 + E] == [1] * E
    assert kinds[3 + E] == 2  # explored: the kind measured longest ago, switched off inside again
    assert kinds[4 + E :] == [1, 1]  # and speculation goes on with the fastest kind
    assert all(o == outs[0] for o in outs)
    assert engine.policy.measured_all(2) and engine.last_stats.speculative_next
    engine.load_state_dict(model.state_dict(), version=1)  # new heads: two drafts measured again
    engine.generate(prompts, seeds)
    assert engine.last_stats.num_drafts == 2


def test_switch_off_estimate_counts_the_call_s_drafts():
    """With fewer drafts than depths the tokens a verify are 1 + d · acceptance, not 1 + D · it; the
    estimate never exceeds them (a new user's trial saw 19x on a shared CPU)."""
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=8, batch_size=2), "cpu")
    engine.speculative_switch_off = False
    timing = spec_policy_mod.SpecTiming(spec_s=32 * 4e-3, wall_s=32 * 4e-3, plain_s=32 * 2.5e-3, chunks=4, iterations=32)
    for d, a in ((1, 1.5), (2, 2.0)):  # acceptance 50 %
        stats = results_mod.RolloutStats(num_drafts=d, drafted_tokens=100, accepted_tokens=50)
        engine.policy.should_switch_off(timing, stats, [0, 0], [0, 0])
        assert stats.speculative_speedup == pytest.approx(a * 2.5 / 4, rel=1e-12)
    # a plain step timed on a busy machine (40 times too slow): the estimate stays within the tokens a verify
    slow_plain = spec_policy_mod.SpecTiming(spec_s=32 * 4e-3, wall_s=32 * 4e-3, plain_s=32 * 0.1, chunks=4, iterations=32)
    stats = results_mod.RolloutStats(num_drafts=1, drafted_tokens=100, accepted_tokens=50)
    engine.policy.should_switch_off(slow_plain, stats, [0, 0], [0, 0])
    assert stats.speculative_speedup == 1.5


@pytest.mark.parametrize("drafts", [1, 2])
def test_a_call_drafting_fewer_tokens_than_the_heads_equals_an_engine_built_for_that_many(monkeypatch, drafts):
    """A call of d < D drafts a verify on an engine whose buffers hold D = 3 (the measured choice's
    fewer drafts) emits what an engine built with num_draft_tokens=d emits: the same tokens and
    drafted / accepted counts per depth, logprobs within 1e-5 of it and of the teacher-forced
    reference; depths past d are never reached (NaN rates). Calls of D and d drafts then alternate
    on one engine (padded refills keyed by the drafts, stale deeper caches) with the same samples."""
    model = make_model(vocab=16, depths=3, hidden_size=32, intermediate_size=64, init=0.5)
    cfg = dict(speculative=True, temperature=0.8, max_new_tokens=16, batch_size=3, stop_token_ids=[3])
    prompts, seeds = random_prompts(7, 16, (1, 6), seed=8), [70 + i for i in range(7)]
    wide = RolloutEngine(model, GenerationConfig(**cfg), "cpu")
    narrow = RolloutEngine(model, GenerationConfig(num_draft_tokens=drafts, **cfg), "cpu")
    for engine in (wide, narrow):
        engine.speculative_switch_off = False
        engine.prefill_buckets = True
    choice = {"drafts": drafts}
    monkeypatch.setattr(wide.policy, "choose", lambda bucket, peek=False: choice["drafts"])
    ref = narrow.generate(prompts, seeds)
    ref_stats = narrow.last_stats
    assert ref_stats.accepted_tokens > 0
    for call in (drafts, 3, drafts):
        choice["drafts"] = call
        out = wide.generate(prompts, seeds)
        stats = wide.last_stats
        assert stats.num_drafts == call
        for r, q, prompt in zip(out, ref, prompts):
            assert r.response_ids == q.response_ids and r.finish_reason == q.finish_reason
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(q.logprobs), atol=1e-5, rtol=0)
            tf, _ = teacher_forced(model, prompt, r.response_ids, 0.8)
            torch.testing.assert_close(torch.tensor(r.logprobs), tf, atol=1e-5, rtol=0)
        if call == drafts:
            assert (stats.drafted_tokens, stats.accepted_tokens) == (ref_stats.drafted_tokens, ref_stats.accepted_tokens)
            assert stats.reached_per_depth[:drafts] == ref_stats.reached_per_depth
            assert stats.accepted_per_depth[:drafts] == ref_stats.accepted_per_depth
            assert stats.reached_per_depth[drafts:] == [0] * (3 - drafts)
            assert all(r != r for r in stats.acceptance_rate_per_depth[drafts:])  # NaN: never reached
            assert [r.drafted_tokens for r in out] == [q.drafted_tokens for q in ref]


def test_drafter_refuses_a_draft_count_it_has_no_caches_for():
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=4, batch_size=2), "cpu")
    engine.generate([[1, 2]], [0])
    drafter = engine.runner.drafter
    with pytest.raises(ValueError, match="outside 1..2"):
        drafter._drafts(3)
    with pytest.raises(ValueError, match="drafts=3 is outside 0..2"):
        runner_mod.step_kind(3, 2)
    assert [runner_mod.step_kind(d, 2) for d in range(3)] == ["plain", "spec1", "spec"]
    assert [runner_mod.drafts_of(k, 2) for k in ("plain", "spec1", "spec")] == [0, 1, 2]


def test_measured_choice_rates_leave_out_setup_time(monkeypatch):
    """A call's speed sample for the measured choice is tokens / (wall - setup), setup being CUDA
    graph captures and the switch-off rule's plain-step timings: on the H200 counting a capture made
    the rule decode plainly at batch 1, where speculation was 1.2x faster. Here the plain steps
    (which a speculative call runs only to time them) take 0.3 s more each; the recorded rate must
    not see them."""
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=40, batch_size=2), "cpu")
    real_run_steps = runner_mod.ModelRunner.run_steps

    def slow_plain(self, kind, B, L, n):
        if kind == "plain":
            time.sleep(0.3)
        return real_run_steps(self, kind, B, L, n)

    recorded = []
    monkeypatch.setattr(runner_mod.ModelRunner, "run_steps", slow_plain)
    monkeypatch.setattr(spec_policy_mod.SpecPolicy, "should_switch_off", lambda *a: False)
    monkeypatch.setattr(
        spec_policy_mod.SpecPolicy, "record_call", lambda self, spec, bucket, rate: recorded.append(rate)
    )
    engine.generate([[1, 2], [3]], [0, 1])
    stats = engine.last_stats
    assert stats.speculative_active
    assert stats.setup_s >= 0.3  # the plain-step timing ran, inside the setup accounting
    assert recorded == [pytest.approx(stats.generated_tokens / (stats.wall_time_s - stats.setup_s), rel=1e-9)]


def test_a_call_during_which_torch_compile_compiled_is_no_speed_sample(monkeypatch):
    """A kernel's first shape compiles for seconds inside the call that meets it; such a call's
    tokens/s says nothing of the decoding kind, so the measured choice does not take it."""
    model = make_model(vocab=VOCAB, depths=2)
    engine = RolloutEngine(model, GenerationConfig(speculative=True, max_new_tokens=6, batch_size=2), "cpu")
    recorded = []
    monkeypatch.setattr(
        spec_policy_mod.SpecPolicy, "record_call", lambda self, spec, bucket, rate: recorded.append(rate)
    )
    count = iter(range(1000))
    monkeypatch.setattr(spec_policy_mod, "_compilations", lambda: next(count))  # something compiles in every call
    engine.generate([[1, 2]], [0])
    assert recorded == []
    monkeypatch.setattr(spec_policy_mod, "_compilations", lambda: 7)
    engine.generate([[1, 2]], [0])
    assert len(recorded) == 1


def test_compilations_counts_what_torch_compile_makes():
    before = spec_policy_mod._compilations()
    f = torch.compile(lambda x: x * 3 + 1)
    f(torch.ones(3))
    assert spec_policy_mod._compilations() > before
