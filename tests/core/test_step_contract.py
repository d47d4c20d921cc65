"""DESIGN §2 invariants 3–5 and §3's two-denominator combination: state machine, abort, empty steps."""

import copy
import math

import pytest
import torch
from _utils import (
    assert_metrics_close,
    capture_grads,
    make_batch,
    make_loss,
    make_model,
    make_worker,
    optim_state,
    params,
    run_split,
)

from splitrl.loss import LossType


def _snapshot(w):
    return (
        params(w.model),
        optim_state(w),
        copy.deepcopy(w.scheduler.state_dict()),
        None if w.scaler is None else w.scaler.state_dict(),
        (w.steps_finished, w.updates_applied),
    )


def _assert_same(a, b):
    pa, oa, sa, ca, na = a
    pb, ob, sb, cb, nb = b
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)
    assert oa["param_groups"] == ob["param_groups"]
    assert sa == sb and ca == cb and na == nb


@pytest.mark.parametrize(
    "precision,loss_type,detach",
    [
        ("fp32", LossType.TOKEN_LEVEL, True),
        ("fp16", LossType.TOKEN_LEVEL, True),
        ("fp32", LossType.SEQUENCE_LEVEL, False),
    ],
)
def test_abort_mid_step_restores_everything_and_next_step_is_fresh(precision, loss_type, detach):
    b0, b1 = make_batch(16, seed=0), make_batch(16, seed=1)
    w = make_worker(make_model(D=2, detach=detach), precision=precision)
    ref = make_worker(make_model(D=2, detach=detach), precision=precision)
    w.train(b0, make_loss(loss_type))
    ref.train(b0, make_loss(loss_type))
    before = _snapshot(w)
    w.begin_train_step(make_loss(loss_type))
    w.train_microbatch(b1.select(list(range(8))))
    assert any(p.grad is not None for p in w.model.parameters())
    w.abort_train_step()
    w.abort_train_step()  # idempotent
    assert all(p.grad is None for p in w.model.parameters())
    _assert_same(_snapshot(w), before)
    m = w.train(b1, make_loss(loss_type))
    m_ref = ref.train(b1, make_loss(loss_type))
    assert_metrics_close(m, m_ref, rtol=0, atol=0)
    for n, p in params(w.model).items():
        assert torch.equal(p, params(ref.model)[n]), n


def test_wrong_call_order_raises_clear_errors():
    w = make_worker(make_model(D=1))
    with pytest.raises(RuntimeError, match="begin_train_step"):
        w.train_microbatch(make_batch(4))
    with pytest.raises(RuntimeError, match="begin_train_step"):
        w.finish_train_step()
    w.begin_train_step(make_loss())
    with pytest.raises(RuntimeError, match="finish_train_step\\(\\) or abort_train_step\\(\\)"):
        w.begin_train_step(make_loss())
    w.abort_train_step()
    w.train(make_batch(4), make_loss())  # usable afterwards


def test_exception_inside_a_call_leaves_the_step_open_for_abort():
    w = make_worker(make_model(D=1))
    before = _snapshot(w)
    w.begin_train_step(make_loss())
    w.train_microbatch(make_batch(4, seed=1))
    bad = make_batch(4, seed=2)
    bad.input_ids[1] = bad.input_ids[1] + 10_000  # outside the vocabulary
    with pytest.raises(ValueError, match="outside"):
        w.train_microbatch(bad)
    assert w.step_open
    w.abort_train_step()
    _assert_same(_snapshot(w), before)


def test_malformed_chunks_are_rejected_before_any_forward():
    w = make_worker(make_model(D=1))
    w.begin_train_step(make_loss(kl_coef=0.1))
    grads = capture_grads(w)
    b = make_batch(4)
    with pytest.raises(ValueError, match="reference_logprobs"):
        w.train_microbatch(b)
    b2 = make_batch(4)
    b2.token_mask[0] = b2.token_mask[0][:-1]
    with pytest.raises(ValueError, match="token_mask\\[0\\]"):
        w.train_microbatch(b2)
    b3 = make_batch(4)
    b3.advantages[2] = float("nan")
    with pytest.raises(ValueError, match="advantages"):
        w.train_microbatch(b3)
    assert all(p.grad is None for p in w.model.parameters())
    w.abort_train_step()
    assert grads == []


def test_chunk_without_valid_tokens_contributes_nothing():
    batch = make_batch(12, seed=3)
    empty = make_batch(3, seed=4)
    empty.sample_mask[:] = 0.0
    w_a = make_worker(make_model(D=2))
    w_b = make_worker(make_model(D=2))
    m_a = run_split(w_a, make_loss(), [[batch]])[0]
    m_b = run_split(w_b, make_loss(), [[empty, batch, empty.select([])]])[0]
    assert_metrics_close(m_a, m_b, rtol=1e-6)
    for n, p in params(w_a.model).items():
        torch.testing.assert_close(p, params(w_b.model)[n], rtol=0, atol=1e-3 * 1e-3 * 10)


@pytest.mark.parametrize("loss_type", [LossType.TOKEN_LEVEL, LossType.SEQUENCE_LEVEL])
def test_step_with_zero_denominator_makes_no_update_and_says_so(loss_type):
    w = make_worker(make_model(D=1))
    before = _snapshot(w)
    empty = make_batch(5, seed=1)
    empty.sample_mask[:] = 0.0
    m = run_split(w, make_loss(loss_type), [[empty, empty.select([])]])[0]
    assert m["empty_step"] == 1.0 and m["skipped_step"] == 1.0
    assert m["num_valid_tokens"] == 0.0
    assert m["loss"] != m["loss"]  # NaN: nothing to average
    p, o, s, c, n = _snapshot(w)
    _assert_same((p, o, s, c, before[4]), before)
    assert n == (1, 0)  # the step is counted as finished, no update applied
    m2 = w.train(make_batch(4), make_loss(loss_type))
    assert m2["skipped_step"] == 0.0


@pytest.mark.parametrize(
    "loss_type,D,detach,lam,separate",
    [
        (LossType.SEQUENCE_LEVEL, 1, False, 0.1, True),  # the one combination that mixes N_s and N_t
        (LossType.SEQUENCE_LEVEL, 1, True, 0.1, False),
        (LossType.SEQUENCE_LEVEL, 1, False, 0.0, False),
        (LossType.SEQUENCE_LEVEL, 0, False, 0.1, False),
        (LossType.TOKEN_LEVEL, 1, False, 0.1, False),
    ],
)
def test_only_sequence_level_with_attached_trained_heads_pays_a_second_backward(loss_type, D, detach, lam, separate):
    """Formerly rejected (DESIGN §3); now trained exactly (tests/core/test_mtp_normalization.py),
    and only that combination runs two backward passes per microbatch."""
    w = make_worker(make_model(D=D, detach=detach, lam=lam))
    calls = []
    orig = torch.Tensor.backward

    def counting_backward(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)

    w.begin_train_step(make_loss(loss_type))
    assert (w._step.side is not None) == separate
    torch.Tensor.backward = counting_backward
    try:
        w.train_microbatch(make_batch(6))  # mbs=3: two microbatches
        # with coalesce_chunks the last microbatch may run at finish: count the whole step
        m = w.finish_train_step()
    finally:
        torch.Tensor.backward = orig
    assert len(calls) == (4 if separate else 2)
    assert m["skipped_step"] == 0.0 and math.isfinite(m["grad_norm"])


def test_lambda_zero_trains_policy_keeps_heads_and_reports_metrics():
    model = make_model(D=2, lam=0.0)
    mtp_before = {n: p.detach().cpu().clone() for n, p in model.mtp_named_parameters()}
    main_before = {n: p.detach().cpu().clone() for n, p in model.main_named_parameters()}
    w = make_worker(model)
    opt_params = {id(p) for g in w.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in opt_params for _, p in model.mtp_named_parameters())
    for s in range(2):
        m = w.train(make_batch(8, seed=s), make_loss(LossType.SEQUENCE_LEVEL))
    for k in ("mtp/mtp_1_loss", "mtp/mtp_2_loss", "mtp/mtp_1_acceptance_rate", "mtp/mtp_2_acceptance_rate"):
        assert m[k] == m[k] and m[k] >= 0.0
    for n, p in model.mtp_named_parameters():
        assert torch.equal(p.detach().cpu(), mtp_before[n]), n
    assert any(not torch.equal(p.detach().cpu(), main_before[n]) for n, p in model.main_named_parameters())


def test_d_zero_has_no_mtp_metrics():
    m = make_worker(make_model(D=0)).train(make_batch(4), make_loss())
    assert not any(k.startswith("mtp/") for k in m)
