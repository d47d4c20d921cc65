"""Kind guarded: masked positions poisoning sums (issue 6, item 3).

A -inf or NaN that the loss never reads — a logprob on a prompt position, the logprobs and the
advantage of a filtered sample (``sample_mask = 0``) — must change nothing: the microbatch builder
replaces masked values (a NaN times a 0 mask is still NaN), and validation looks only where
``token_mask · sample_mask`` is 1. Reference: the same step with those values set to finite
numbers; metrics and gradients must be identical (same computation, same order).
"""

import math

import pytest
import torch
from _utils import capture_grads, make_batch, make_loss, make_model, make_worker

from splitrl.train import MicrobatchConfig, build_microbatches

FIELDS = ("generation_logprobs", "prev_logprobs", "reference_logprobs")
FILTERED = (2, 5)


def _with_masked_values(batch, prompt_value, filtered_value):
    """A copy whose logprobs are ``prompt_value`` on every untrained position of counted samples
    and ``filtered_value`` everywhere on filtered samples (whose advantage becomes it too)."""
    out = batch.select(list(range(len(batch))))
    for name in FIELDS:
        vals = [v.clone() for v in getattr(out, name)]
        for i, v in enumerate(vals):
            if i in FILTERED:
                v[:] = filtered_value
            else:
                untrained = out.token_mask[i] == 0
                untrained[0] = True
                v[untrained] = prompt_value
        setattr(out, name, vals)
    out.advantages = out.advantages.clone()
    for i in FILTERED:
        out.advantages[i] = filtered_value
    return out


def _step(batch, pack, **loss_kw):
    w = make_worker(make_model(D=1), mbs=3, pack=pack, max_grad_norm=None)
    grads = capture_grads(w)
    metrics = w.train(batch, make_loss(kl_coef=0.1, tis_cap=2.0, **loss_kw))
    return metrics, grads[0]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_nonfinite_values_at_masked_positions_change_nothing(pack, ratio_level):
    batch = make_batch(8, seed=21, masked=FILTERED, ref=True)
    poisoned = _with_masked_values(batch, float("-inf"), float("nan"))
    clean = _with_masked_values(batch, -3.0, -1.0)
    m_bad, g_bad = _step(poisoned, pack, ratio_level=ratio_level)
    m_ref, g_ref = _step(clean, pack, ratio_level=ratio_level)
    for k in ("loss", "pg_loss", "kl", "is_weight_mean", "is_weight_max", "logprob_mismatch", "ratio_mean"):
        assert math.isfinite(m_bad[k]), k
    assert m_bad == m_ref
    assert g_bad.keys() == g_ref.keys()
    for n in g_ref:
        assert torch.equal(g_bad[n], g_ref[n]), n


def test_builder_replaces_masked_values_with_zero():
    batch = _with_masked_values(make_batch(6, seed=22, masked=FILTERED, ref=True), float("inf"), float("nan"))
    for mb in build_microbatches(batch, MicrobatchConfig(micro_batch_size=4, pack_sequences=True)):
        for name in FIELDS:
            v = getattr(mb, name)
            assert torch.isfinite(v).all(), name
            assert (v[mb.loss_mask == 0] == 0).all(), name
        assert torch.isfinite(mb.advantages).all()


def test_validation_looks_only_where_the_loss_reads():
    w = make_worker(make_model(D=0))
    w.begin_train_step(make_loss())
    trained = make_batch(4, seed=23, masked=())
    t = int(trained.token_mask[1].nonzero()[-1])
    trained.generation_logprobs[1][t] = float("nan")
    with pytest.raises(ValueError, match=rf"generation_logprobs\[1\] is nan at token {t}.*sample_mask=0"):
        w.train_microbatch(trained)
    counted_adv = make_batch(4, seed=23, masked=(0,))
    counted_adv.advantages[1] = float("inf")
    with pytest.raises(ValueError, match=r"advantages\[1\] is inf on a counted sample"):
        w.train_microbatch(counted_adv)
    bad_mask = make_batch(4, seed=23)
    bad_mask.token_mask[2] = bad_mask.token_mask[2] * float("nan")
    with pytest.raises(ValueError, match=r"token_mask\[2\] must hold only 0.0 and 1.0"):
        w.train_microbatch(bad_mask)
    assert all(p.grad is None for p in w.model.parameters())
    w.abort_train_step()
