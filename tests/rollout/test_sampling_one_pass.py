"""The sampler's block weights taken per block (one reduction axis) and the unfiltered logprob's
normalizer taken from them: same logprobs, same tokens, same distribution as the two-pass form."""

import torch
import torch.nn.functional as F
from test_sampling import _chi2_pvalue

from splitrl.rollout import sampling
from splitrl.rollout.sampling import STREAM_TARGET, column_keys, draw, draw_with_logprobs, filter_logits, seed_words

CPU = torch.device("cpu")


def _two_pass_race(log_weights_BV, lo, hi, counter, stream, keys):
    """The race as it was before: block weights relative to the row's maximum (one reduction over
    the whole row, then the per-block sums)."""
    B, V = log_weights_BV.shape
    block = sampling._block(V)
    nb = -(-V // block)
    padded = F.pad(log_weights_BV, (0, nb * block - V), value=float("-inf")).view(B, nb, block)
    top = padded.amax(dim=(1, 2), keepdim=True)
    block_log_weights = (padded - top).exp().sum(-1).log()
    chosen = sampling._race(block_log_weights, sampling._keys(lo, hi, counter, 2 * stream), keys[:nb].expand(B, -1))
    inside = padded[torch.arange(B), chosen]
    token_ids = chosen[:, None] * block + torch.arange(block)
    token_keys = sampling._keys(lo, hi, counter, 2 * stream + 1)
    return token_ids.gather(1, sampling._race(inside, token_keys, keys[token_ids])[:, None]).squeeze(1)


def _logits_with_holes(V: int, N: int, seed: int) -> torch.Tensor:
    """fp32 [N, V] randn logits; rows 1..3 top-k filtered (most blocks all -inf), row 4 with a
    single finite entry, row 5 with its whole first block -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g)
    x[1:4] = filter_logits(x[1:4], 3, 1.0)
    x[4] = float("-inf")
    x[4, V // 2] = 0.7
    x[5, : sampling._block(V)] = float("-inf")
    return x


def test_row_total_is_the_row_logsumexp_in_fp64():
    for V in (37, 1000, 4099):  # 37 and 4099 pad their last block; 1000 pads 24 columns
        x = _logits_with_holes(V, 8, seed=V).double() * 4
        lo, hi = seed_words(list(range(8)), CPU)
        y, total = sampling._race_with_total(x, lo, hi, torch.arange(8), STREAM_TARGET, None)
        assert total.dtype == torch.float64 and torch.isfinite(x.gather(1, y[:, None])).all()
        torch.testing.assert_close(total, x.logsumexp(-1), atol=1e-12, rtol=0)


def test_unfiltered_logprobs_equal_log_softmax():
    for V in (37, 1000):
        x = _logits_with_holes(V, 8, seed=V)
        lo, hi = seed_words(list(range(8)), CPU)
        y, lp = draw_with_logprobs(x, lo, hi, torch.arange(8), 0, 1.0, column_keys(V, CPU))
        assert not lp.isnan().any() and torch.isfinite(x.gather(1, y[:, None])).all()
        ref = x.double().log_softmax(-1).gather(1, y[:, None]).squeeze(1)
        # |log W| < 8 here: 1e-6 is about two fp32 ulps of the normalizer
        assert (lp.double() - ref).abs().max() < 1e-6
        assert y[4] == V // 2 and lp[4] == 0.0  # the only finite entry, with all the mass


def test_filtered_logprobs_stay_those_of_the_unfiltered_softmax():
    V, N = 1000, 64
    x = torch.randn(N, V, generator=torch.Generator().manual_seed(3))
    lo, hi = seed_words(list(range(N)), CPU)
    y, lp = draw_with_logprobs(x, lo, hi, torch.arange(N), 5, 0.9, column_keys(V, CPU))
    assert torch.isfinite(filter_logits(x, 5, 0.9).gather(1, y[:, None])).all()
    ref = x.double().log_softmax(-1).gather(1, y[:, None]).squeeze(1)
    assert (lp.double() - ref).abs().max() < 1e-6
    # the filtered softmax would give every token at least log(1/5)
    assert (lp < -1.0).all()


def test_tokens_equal_the_two_pass_race():
    """Per-block and per-row shifts give block log-weights that differ by rounding (~1 ulp), so a
    token can only change where the two best race scores are that close: at 2000 rows, expected
    never; a stray near-tie is allowed (99.9 %)."""
    V, N = 4099, 2000
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, V, generator=g) * torch.linspace(0.5, 4.0, N)[:, None]
    lo, hi = seed_words([1000 + i for i in range(N)], CPU)
    counter = torch.arange(N) % 97
    keys = column_keys(V, CPU)
    for top_k, top_p in ((0, 1.0), (50, 0.9)):
        ref = _two_pass_race(filter_logits(x, top_k, top_p), lo, hi, counter, STREAM_TARGET, keys)
        y, lp = draw_with_logprobs(x, lo, hi, counter, top_k, top_p, keys)
        assert torch.equal(draw(x, lo, hi, counter, top_k, top_p, keys), y)
        assert (y == ref).double().mean() >= 0.999, int((y != ref).sum())
        same = y == ref
        ref_lp = x.gather(1, y[:, None]).squeeze(1) - x.logsumexp(-1)
        torch.testing.assert_close(lp[same], ref_lp[same], atol=4e-6, rtol=0)


def test_unfiltered_draw_matches_softmax_frequencies():
    # 37 tokens: 6 blocks of 7 (the last one partial); block 1 entirely -inf, one more hole
    V, n = 37, 20000
    logw = torch.randn(V, generator=torch.Generator().manual_seed(11)) * 1.5
    logw[7:14] = float("-inf")
    logw[30] = float("-inf")
    probs = logw.double().softmax(-1)
    lo, hi = seed_words(list(range(n)), CPU)
    y, lp = draw_with_logprobs(logw.expand(n, -1), lo, hi, torch.full((n,), 5), 0, 1.0, column_keys(V, CPU))
    counts = torch.bincount(y, minlength=V).double()
    assert counts[7:14].sum() == 0 and counts[30] == 0
    big = probs * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([probs[big] * n, (probs[~big].sum() * n)[None]])
    assert _chi2_pvalue(observed, expected) > 1e-3
    assert (lp.double() - probs.log()[y]).abs().max() < 1e-6
