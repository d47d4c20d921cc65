"""The drafts' reduced vocabulary (``GenerationConfig.draft_vocab_size``): plain decoding's tokens
and logprobs whatever the set, drafts only from the set, the set from the run's own token counts,
the head rows from the current weights, and the settings refused before anything changes."""

import pytest
import torch
from _rollout_helpers import make_model, random_prompts

from splitrl.rollout import GenerationConfig, RolloutEngine
from splitrl.rollout.drafter import DraftVocabulary


def _generate(model, prompts, seeds, **cfg):
    engine = RolloutEngine(model, GenerationConfig(**cfg), "cpu")
    return engine, engine.generate(prompts, seeds)


@pytest.mark.parametrize("size,top_k,T", [(3, 0, 1.0), (40, 0, 0.8), (40, 5, 1.0), (128, 1, 1.0)])
def test_tokens_and_logprobs_equal_plain(size, top_k, T):
    """Drafting from 3, 40 or all 128 tokens changes only acceptance: the responses, finish
    reasons and logprobs are plain decoding's (fp32, 1e-5 as the other speculative tests)."""
    model = make_model(vocab=128, depths=2)
    prompts, seeds = random_prompts(7, 128, (1, 9), seed=3), list(range(7))
    cfg = dict(top_k=top_k, temperature=T, max_new_tokens=12, batch_size=4, stop_token_ids=[5])
    spec, out_s = _generate(model, prompts, seeds, speculative=True, draft_vocab_size=size, **cfg)
    _, out_p = _generate(model, prompts, seeds, **cfg)
    for s, p in zip(out_s, out_p):
        assert s.response_ids == p.response_ids and s.finish_reason == p.finish_reason
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-5, rtol=0)
    assert spec.last_stats.drafted_tokens > 0


def test_whole_vocabulary_set_drafts_as_no_set():
    """A set of every token drafts exactly what the full output layer drafts: the same draft logits
    at every draw (bit for bit) and the same acceptance counts."""
    model = make_model(vocab=16, depths=2, hidden_size=32, intermediate_size=64)
    prompts, seeds = random_prompts(6, 16, (1, 6), seed=6), list(range(6))
    runs = []
    for size in (None, 16):
        engine = RolloutEngine(
            model, GenerationConfig(speculative=True, temperature=0.9, max_new_tokens=14, batch_size=3,
                                    draft_vocab_size=size), "cpu"
        )  # fmt: skip
        engine.runner.ensure_buffers(8)
        draws = []
        engine.runner.drafter.probe = lambda lo, c, k, logits: draws.append(logits.clone())
        out = engine.generate(prompts, seeds)
        runs.append((draws, [r.response_ids for r in out], engine.last_stats))
    (d0, r0, s0), (d1, r1, s1) = runs
    assert r0 == r1 and len(d0) == len(d1) > 0
    for a, b in zip(d0, d1):
        assert torch.equal(a, b)
    assert s0.accepted_tokens == s1.accepted_tokens > 0
    assert s0.accepted_per_depth == s1.accepted_per_depth and s0.drafted_tokens == s1.drafted_tokens


def test_drafts_come_from_the_most_frequent_tokens():
    """Each draw's logits are -inf outside the set and the head's values inside it, and the set is
    the most frequent tokens of the prompts and responses counted before the call."""
    model = make_model(vocab=64, depths=2)
    size = 10
    engine = RolloutEngine(
        model, GenerationConfig(speculative=True, max_new_tokens=10, batch_size=4, draft_vocab_size=size), "cpu"
    )
    engine.speculative_switch_off = False  # every call speculative (the measured choice would switch)
    vocab = engine.runner.draft_vocab
    prompts = random_prompts(5, 64, (3, 12), seed=2)
    first = engine.generate(prompts, list(range(5)))
    bincount = lambda tokens: torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=64)  # noqa: E731
    assert torch.equal(vocab.counts, bincount([t for r in first for t in r.response_ids]))
    assert torch.equal(vocab.prompt_counts, bincount([t for p in prompts for t in p]))

    prompts2 = random_prompts(4, 64, (3, 12), seed=9)
    responses, in_prompts = vocab.counts.clone(), vocab.prompt_counts + bincount([t for p in prompts2 for t in p])
    # the ranking: response count, then prompt count (this call's prompts included), descending; then the lower id
    order = sorted(range(64), key=lambda t: (-int(responses[t]), -int(in_prompts[t]), t))
    expected = torch.tensor(sorted(order[:size]))
    draws = []
    engine.runner.drafter.probe = lambda lo, c, k, logits: draws.append(logits.clone())
    second = engine.generate(prompts2, list(range(4)))
    assert torch.equal(vocab.ids, expected)
    outside = torch.ones(64, dtype=torch.bool)
    outside[expected] = False
    assert draws
    for logits in draws:
        assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, expected]).all()
    assert torch.equal(vocab.weight, model.output_weight[expected])
    stats = engine.last_stats
    inside = sum(int(t in set(expected.tolist())) for r in second for t in r.response_ids)
    assert stats.draft_vocab_size == size and stats.draft_vocab_covered == inside
    assert stats.as_metrics()["rollout/draft_vocab_coverage"] == pytest.approx(100 * inside / stats.generated_tokens)


def test_head_rows_follow_a_weight_sync():
    """After load_state_dict the next call drafts with the new weights' rows (the set's weight
    buffer keeps its storage, which captured graphs read)."""
    model = make_model(vocab=32, depths=1)
    engine = RolloutEngine(
        model, GenerationConfig(speculative=True, max_new_tokens=6, batch_size=2, draft_vocab_size=8), "cpu"
    )
    prompts = random_prompts(2, 32, (2, 5), seed=1)
    engine.generate(prompts, [0, 1])
    vocab = engine.runner.draft_vocab
    storage = vocab.weight.data_ptr()
    head = engine.model.output_weight
    names = [k for k, v in engine.weight_tensors().items() if v is head]
    assert names
    new = {k: v * 1.5 if k in names else v for k, v in engine.model.state_dict().items()}
    before = vocab.weight.clone()
    engine.load_state_dict(new, version=1)
    engine.generate(prompts, [0, 1])
    assert vocab.weight.data_ptr() == storage
    assert torch.equal(vocab.weight, head.detach()[vocab.ids])
    assert not torch.equal(vocab.weight, before)


def test_ranking_and_membership():
    t = lambda ids: torch.tensor(ids, dtype=torch.int64)  # noqa: E731
    weight = torch.arange(40.0).view(10, 4).requires_grad_()
    vocab = DraftVocabulary(weight, 3)
    assert not vocab.weight.requires_grad
    assert vocab.ids.tolist() == [0, 1, 2] and vocab.covered(t([0, 2, 3])) == 2  # before any count
    vocab.count(t([7, 7, 7, 2, 2, 9, 1]))
    vocab.refresh()
    assert vocab.ids.tolist() == [1, 2, 7]  # 7 (3), 2 (2), then the lower of the ties 1, 9
    assert vocab.covered(t([7, 2, 9, 0])) == 2 and vocab.covered(t([])) == 0
    assert torch.equal(vocab.weight, weight.detach()[[1, 2, 7]])
    # prompt tokens break ties and fill the rest, never outrank a response token
    vocab.count(t([9, 5, 5, 5, 5, 5, 5]), prompt=True)
    vocab.refresh()
    assert vocab.ids.tolist() == [2, 7, 9]  # 7 (3), 2 (2), then 9 over 1 (in a prompt); 5 only in prompts
    vocab.count(t([3]), prompt=False)
    vocab.count(t([5] * 100 + [4]), prompt=True)
    vocab.refresh()
    assert vocab.ids.tolist() == [2, 7, 9]  # 1, 3 and 9 have one response each: 9 was also in a prompt
    with pytest.raises(ValueError, match="outside 1..10"):
        DraftVocabulary(torch.zeros(10, 4), 11)


@pytest.mark.parametrize(
    "cfg,match",
    [
        (dict(draft_vocab_size=8), "speculative=False"),
        (dict(speculative=True, draft_vocab_size=129), "exceeds the model's vocabulary of 128"),
        (dict(speculative=True, deterministic=True, draft_vocab_size=8), "deterministic=true: .* bit-reproducible"),
    ],
)
def test_bad_settings_refused(cfg, match):
    model = make_model(vocab=128, depths=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        RolloutEngine(model, GenerationConfig(**cfg), "cpu")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_zero_is_refused_by_the_config():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        GenerationConfig(speculative=True, draft_vocab_size=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: run with a GPU (the device machine)")
def test_cuda_graphs_read_the_refreshed_set():
    """fp32 on CUDA with captured graphs: the samples equal plain decoding's on the same device, and
    a second call on other prompts, whose refreshed set differs, replays the decode-step graphs of
    the first with the set's buffers rewritten in place (same storage)."""
    model = make_model(vocab=128, depths=2, seed=3).to("cuda")
    cfg = dict(temperature=0.9, max_new_tokens=20, batch_size=4)
    spec = RolloutEngine(model, GenerationConfig(speculative=True, draft_vocab_size=24, **cfg), "cuda")
    spec.speculative_switch_off = False
    plain = RolloutEngine(model, GenerationConfig(**cfg), "cuda")
    assert spec.use_cuda_graphs
    vocab = spec.runner.draft_vocab
    ids_ptr, weight_ptr = vocab.ids.data_ptr(), vocab.weight.data_ptr()
    outs, sets, steps = [], [], []
    for seed in (8, 9):
        prompts = random_prompts(4, 128, (3, 30), seed=seed)
        seeds = list(range(seed, seed + 4))
        outs.append((spec.generate(prompts, seeds), plain.generate(prompts, seeds)))
        sets.append(vocab.ids.clone())
        steps.append({k for k in spec.runner.graphs if k[0] != "prefill"})
    # the first call's decode graphs are kept (a refresh drops none; compaction may add small buckets)
    assert steps[0] and steps[0] <= steps[1] and spec.last_stats.drafted_tokens > 0
    assert not torch.equal(sets[0], sets[1])
    assert (vocab.ids.data_ptr(), vocab.weight.data_ptr()) == (ids_ptr, weight_ptr)
    for got, ref in outs:
        assert [r.response_ids for r in got] == [r.response_ids for r in ref]
        for a, b in zip(got, ref):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    assert torch.equal(vocab.weight, model.output_weight[vocab.ids])


def test_a_stream_closed_early_counts_what_it_gave():
    """The responses a caller received before closing the stream are counted (for the next call's
    set, and in the call's coverage); the call's prompts were counted at its start."""
    model = make_model(vocab=64, depths=1)
    engine = RolloutEngine(
        model, GenerationConfig(speculative=True, max_new_tokens=8, batch_size=2, draft_vocab_size=8), "cpu"
    )
    stream = engine.generate_stream(random_prompts(6, 64, (2, 6), seed=4), list(range(6)))
    got = [next(stream)[1], next(stream)[1]]
    stream.close()
    vocab = engine.runner.draft_vocab
    tokens = [t for r in got for t in r.response_ids]
    assert int(vocab.counts.sum()) == len(tokens) > 0
    inside = sum(int(vocab.inside[t]) for t in tokens)
    assert engine.last_stats.draft_vocab_covered == inside
