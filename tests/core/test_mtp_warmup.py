"""``train.mtp_warmup_steps``: the first steps train only the MTP heads (issue 10, item 6).

Guards against a warmup that still moves the policy (weight decay or Adam state on zero
gradients) or that trains the heads differently from a normal step."""

import copy

import pytest
import torch
from _utils import make_batch, make_loss, make_model, make_worker, params

from splitrl.train import TrainWorker


def _with_warmup(worker, steps):
    worker.config = worker.config.model_copy(update={"mtp_warmup_steps": steps})
    return worker


def test_detached_heads_warmup_keeps_the_policy_and_trains_heads_like_a_normal_step():
    model = make_model(D=2, detach=True, seed=1)
    ref_model = copy.deepcopy(model)
    warm = _with_warmup(make_worker(model), 1)
    plain = make_worker(ref_model)
    before = params(model)
    loss, batch = make_loss(), make_batch(8)
    m = warm.train(batch, loss)
    plain.train(batch, loss)
    after, ref = params(model), params(ref_model)
    assert m["mtp_warmup"] == 1.0
    for n, p in after.items():
        if n.startswith("mtp."):
            # detached heads get only MTP gradients: the same update as in a normal step, exactly
            assert torch.equal(p, ref[n]), n
            assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), n  # the policy did not move (no decay either)
            assert not warm.optimizer.state.get(dict(model.named_parameters())[n]), n  # no AdamW state
    # the next step trains everything again
    m2 = warm.train(make_batch(8, seed=1), loss)
    assert m2["mtp_warmup"] == 0.0
    moved = params(model)
    assert any(not torch.equal(moved[n], before[n]) for n in before if not n.startswith("mtp."))


def test_attached_heads_warmup_moves_only_the_heads():
    model = make_model(D=1, detach=False, seed=2)
    warm = _with_warmup(make_worker(model), 2)
    before = params(model)
    for s in range(2):
        m = warm.train(make_batch(8, seed=s), make_loss())
        assert m["mtp_warmup"] == 1.0
        assert m["mtp/mtp_1_loss"] > 0
    after = params(model)
    assert all(torch.equal(after[n], before[n]) for n in before if not n.startswith("mtp."))
    assert all(not torch.equal(after[n], before[n]) for n in before if n.startswith("mtp.") and "norm" not in n)


def test_warmup_without_training_heads_is_rejected():
    from _configs import demo_config

    with pytest.raises(ValueError, match="mtp_warmup_steps"):
        TrainWorker(make_model(D=0), make_worker(make_model(D=1)).config.model_copy(update={"mtp_warmup_steps": 1}))
    with pytest.raises(ValueError, match="mtp_num_layers >= 1"):
        demo_config(["train.mtp_warmup_steps=3", "model.mtp.mtp_num_layers=0"])
