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


def _sliced(worker, steps, m):
    worker.config = worker.config.model_copy(update={"mtp_warmup_steps": steps, "mtp_warmup_update_samples": m})
    return worker


@pytest.mark.parametrize("detach", [True, False])
def test_a_sliced_warmup_step_is_one_update_per_slice_of_its_samples(detach):
    """mtp_warmup_update_samples=m: a warm-up step of 8 samples (2 filtered) is 3 updates, on
    samples 0-2, 3-5 and 6-7, each exactly a heads-only step of its own; fed as three chunks of
    other sizes it is the same, bit for bit; the schedule and the step count advance once."""
    model = make_model(D=2, detach=detach, seed=3)
    ref_model, split_model = copy.deepcopy(model), copy.deepcopy(model)
    loss, batch = make_loss(), make_batch(8, seed=4)
    before = params(model)

    sliced = _sliced(make_worker(model), 1, 3)
    m = sliced.train(batch, loss)
    assert m["mtp_warmup_updates"] == 3.0 and m["mtp_warmup"] == 1.0
    assert sliced.steps_finished == 1 and sliced.scheduler.last_epoch == 1

    ref = _with_warmup(make_worker(ref_model), 10**6)  # each slice a whole warm-up step of its own
    per_slice = [ref.train(batch.select(list(idx)), loss) for idx in (range(0, 3), range(3, 6), range(6, 8))]
    after, expect = params(model), params(ref_model)
    for n, p in after.items():
        if n.startswith("mtp."):
            assert torch.equal(p, expect[n]), n
            assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), n  # the policy did not move
    # metrics: counts summed, per-depth figures weighted by their counted targets
    assert m["num_valid_tokens"] == sum(r["num_valid_tokens"] for r in per_slice)
    for k in (1, 2):
        cnt = [r[f"mtp/mtp_{k}_num_tokens"] for r in per_slice]
        assert m[f"mtp/mtp_{k}_num_tokens"] == sum(cnt)
        for x in ("loss", "acceptance_rate"):
            want = sum(r[f"mtp/mtp_{k}_{x}"] * c for r, c in zip(per_slice, cnt)) / sum(cnt)
            assert m[f"mtp/mtp_{k}_{x}"] == pytest.approx(want, rel=1e-12), (k, x)

    split = _sliced(make_worker(split_model), 1, 3)
    split.begin_train_step(loss)
    for idx in (range(0, 1), range(1, 5), range(5, 8)):  # chunks that do not align with the slices
        split.train_microbatch(batch.select(list(idx)))
    m_split = split.finish_train_step()
    assert all(torch.equal(p, after[n]) for n, p in params(split_model).items())
    assert m_split == pytest.approx(m, nan_ok=True)

    # the next step is a normal RL step: one update, the policy moves
    m2 = sliced.train(make_batch(8, seed=5), loss)
    assert m2["mtp_warmup"] == 0.0 and "mtp_warmup_updates" not in m2
    assert any(not torch.equal(params(model)[n], before[n]) for n in before if not n.startswith("mtp."))


def test_a_bad_chunk_in_a_sliced_warmup_step_is_refused_before_anything_changes():
    model = make_model(D=1, seed=5)
    worker = _sliced(make_worker(model), 2, 4)
    before = params(model)
    worker.begin_train_step(make_loss())
    bad = make_batch(4, seed=6)
    bad.input_ids[0] = bad.input_ids[0] + 10**6
    with pytest.raises(ValueError, match="outside"):
        worker.train_microbatch(bad)
    worker.abort_train_step()
    assert all(torch.equal(p, before[n]) for n, p in params(model).items())
    assert worker.steps_finished == 0
