"""Counter-based randomness, the exponential race and the top-k / top-p filters."""

import math

import torch

from splitrl.rollout.sampling import STREAM_DRAFT, STREAM_TARGET, filter_logits, race_sample, seed_words, uniforms


def _chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def test_uniforms_are_pure_functions_of_seed_counter_stream():
    lo, hi = seed_words([0, 1, 2**40 + 3, -5], torch.device("cpu"))
    c = torch.tensor([0, 7, 7, 123])
    u1 = uniforms(lo, hi, c, STREAM_TARGET)
    assert torch.equal(u1, uniforms(lo, hi, c, STREAM_TARGET))
    # each row alone gives the same number as in the batch
    for b in range(4):
        assert torch.equal(uniforms(lo[b : b + 1], hi[b : b + 1], c[b : b + 1], STREAM_TARGET), u1[b : b + 1])
    assert not torch.equal(u1, uniforms(lo, hi, c, STREAM_DRAFT))
    assert ((u1 > 0) & (u1 < 1)).all()
    # the high seed word matters
    lo2, hi2 = seed_words([3, 2**32 + 3], torch.device("cpu"))
    u2 = uniforms(lo2, hi2, torch.zeros(2, dtype=torch.int64), STREAM_TARGET)
    assert u2[0] != u2[1]


def test_uniforms_look_uniform():
    n = 20000
    lo, hi = seed_words([11] * n, torch.device("cpu"))
    u = uniforms(lo, hi, torch.arange(n), STREAM_TARGET)
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert _chi2_pvalue(counts, torch.full((20,), n / 20)) > 1e-3
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_race_sample_matches_probabilities():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 20000
    logw = probs.log().expand(n, -1)
    lo, hi = seed_words(list(range(n)), torch.device("cpu"))
    tokens = race_sample(logw, lo, hi, torch.zeros(n, dtype=torch.int64), STREAM_TARGET)
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[5] == 0  # zero weight is never drawn
    assert _chi2_pvalue(counts, probs.double() * n) > 1e-3
    # same seed and counter, different stream: a different draw somewhere
    other = race_sample(logw, lo, hi, torch.zeros(n, dtype=torch.int64), STREAM_DRAFT)
    assert not torch.equal(tokens, other)


def test_race_sample_is_row_independent():
    torch.manual_seed(0)
    logw = torch.randn(5, 50)
    lo, hi = seed_words([1, 2, 3, 4, 5], torch.device("cpu"))
    c = torch.tensor([0, 1, 2, 3, 4])
    full = race_sample(logw, lo, hi, c, STREAM_TARGET)
    for b in range(5):
        assert race_sample(logw[b : b + 1], lo[b : b + 1], hi[b : b + 1], c[b : b + 1], STREAM_TARGET)[0] == full[b]


def test_filter_top_k_and_top_p():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    k2 = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(k2).tolist() == [[True, False, True, False, False]]
    probs = logits.softmax(-1)[0]  # sorted order: 0, 2, 1, 3, 4
    p_top1 = float(probs[0])
    p_top2 = float(probs[0] + probs[2])
    # top_p just above the first token's mass keeps two tokens; just below keeps one
    keep = torch.isfinite(filter_logits(logits, 0, p_top1 + 1e-4))[0].tolist()
    assert keep == [True, False, True, False, False]
    keep = torch.isfinite(filter_logits(logits, 0, p_top1 - 1e-4))[0].tolist()
    assert keep == [True, False, False, False, False]
    keep = torch.isfinite(filter_logits(logits, 0, p_top2 + 1e-4))[0].tolist()
    assert keep == [True, True, True, False, False]
    # top-p after top-k acts on the renormalized top-k distribution
    renorm = math.exp(3.0) / (math.exp(3.0) + math.exp(2.0))
    keep = torch.isfinite(filter_logits(logits, 2, renorm + 1e-4))[0].tolist()
    assert keep == [True, False, True, False, False]
    # no-ops leave the logits untouched
    assert torch.equal(filter_logits(logits, 0, 1.0), logits)


def test_two_level_race_on_a_larger_vocabulary():
    # 61 tokens: 8 blocks of 8 (the last one partial); weights span four orders of magnitude
    torch.manual_seed(1)
    logw = torch.randn(61) * 2.0
    logw[7] = float("-inf")
    probs = logw.softmax(-1).double()
    n = 30000
    lo, hi = seed_words(list(range(n)), torch.device("cpu"))
    tokens = race_sample(logw.expand(n, -1), lo, hi, torch.full((n,), 3), STREAM_TARGET)
    counts = torch.bincount(tokens, minlength=61).double()
    assert counts[7] == 0
    big = probs * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([probs[big] * n, (probs[~big].sum() * n)[None]])
    assert _chi2_pvalue(observed, expected) > 1e-3


def test_draw_upcasts_a_bf16_head_output_itself():
    """At T = 1 the engine hands the head's bf16 logits to the sampler (the upcast happens inside
    its compiled kernels): tokens and logprob bits equal those of the fp32 logits, for ``draw``
    (the drafter's) and ``draw_with_logprobs`` (the target's). Eager here; compiled on the GPU the
    reductions may be ordered differently for a bf16 input: bf16 rounding, as documented."""
    from splitrl.rollout.sampling import column_keys, draw, draw_with_logprobs, seed_words

    g = torch.Generator().manual_seed(5)
    V, N = 1000, 6
    logits = (torch.randn(N, V, generator=g) * 3).to(torch.bfloat16)
    lo, hi = seed_words(list(range(N)), torch.device("cpu"))
    counter = torch.arange(N)
    keys = column_keys(V, torch.device("cpu"))
    for top_k, top_p in ((0, 1.0), (20, 0.9)):
        y16, lp16 = draw_with_logprobs(logits, lo, hi, counter, top_k, top_p, keys)
        y32, lp32 = draw_with_logprobs(logits.float(), lo, hi, counter, top_k, top_p, keys)
        assert lp16.dtype == torch.float32 and torch.equal(y16, y32) and torch.equal(lp16, lp32)
        assert torch.equal(draw(logits, lo, hi, counter, top_k, top_p, keys), y32)
