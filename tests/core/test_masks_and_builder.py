"""DESIGN §3 targets and masks; the shared microbatch builder and the capability flags."""

import pytest
import torch
from _utils import capture_grads, make_batch, make_loss, make_model, make_worker, run_split

from splitrl.models import ModelCapabilities
from splitrl.train import MicrobatchConfig, TrainBatch, build_microbatches


def _step(batch, pack, D=2, mbs=4):
    w = make_worker(make_model(D=D), mbs=mbs, pack=pack, max_grad_norm=None)
    g = capture_grads(w)
    m = w.train(batch, make_loss())
    return m, g[0]


def _assert_step_equal(a, b, rtol=1e-5):
    (ma, ga), (mb, gb) = a, b
    for k in ma:
        if k.startswith("mtp/") or k in ("loss", "num_valid_tokens", "entropy"):
            assert ma[k] == pytest.approx(mb[k], rel=rtol, abs=1e-9), k
    for n in ga:
        atol = rtol * float(gb[n].abs().max()) + 1e-12
        torch.testing.assert_close(ga[n], gb[n], rtol=rtol, atol=atol)


@pytest.mark.parametrize("pack", [False, True])
def test_masked_out_sample_tokens_change_nothing(pack):
    batch = make_batch(8, seed=11, masked=(2, 5))
    other = make_batch(8, seed=11, masked=(2, 5))
    for i in (2, 5):  # every token of the filtered samples, and their logprobs
        other.input_ids[i] = torch.randint(0, 128, other.input_ids[i].shape, generator=torch.Generator().manual_seed(i))
        other.generation_logprobs[i] = other.generation_logprobs[i] - 1.0
    _assert_step_equal(_step(batch, pack), _step(other, pack))


def test_padding_tokens_change_nothing():
    batch = make_batch(8, seed=12)
    mbs = build_microbatches(batch, MicrobatchConfig(micro_batch_size=8))
    model = make_model(D=2)
    mb = mbs[0]
    ids2 = mb.input_ids.clone()
    ids2[mb.segment_ids < 0] = 77
    a = model(mb.input_ids, mb.segment_ids, mb.position_ids, mtp_loss_mask=mb.mtp_loss_mask)
    b = model(ids2, mb.segment_ids, mb.position_ids, mtp_loss_mask=mb.mtp_loss_mask)
    valid = mb.segment_ids >= 0
    torch.testing.assert_close(a.logprobs[valid], b.logprobs[valid], rtol=1e-6, atol=1e-6)
    for x, y in zip(a.mtp_loss_sums + a.mtp_counts, b.mtp_loss_sums + b.mtp_counts):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_packed_rows_equal_padded_rows():
    batch = make_batch(16, seed=13)
    _assert_step_equal(_step(batch, pack=True, mbs=16), _step(batch, pack=False, mbs=16))


def test_mtp_targets_never_cross_samples_and_skip_prompt_and_tail():
    """Per depth k, the counted targets are the response tokens at index ≥ k+1 of each kept
    sample: none in the prompt, none past a sample's end (its last k+1 positions carry no
    depth-k target), none in the next sample of a packed row."""
    batch = make_batch(10, seed=14, masked=(4,))
    D = 3
    model = make_model(D=D)
    for pack in (False, True):
        mbs = build_microbatches(batch, MicrobatchConfig(micro_batch_size=10, pack_sequences=pack))
        mb = mbs[0]
        out = model(mb.input_ids, mb.segment_ids, mb.position_ids, mtp_loss_mask=mb.mtp_loss_mask)
        for k in range(1, D + 1):
            expect = sum(float(batch.token_mask[i][k + 1 :].sum() * batch.sample_mask[i]) for i in range(len(batch)))
            assert float(out.mtp_counts[k - 1]) == expect, (pack, k)
    # changing the *next* sample of a packed row does not change the first sample's MTP terms
    two = batch.select([0, 1])
    two_b = batch.select([0, 1])
    two_b.input_ids[1] = torch.randint(0, 128, two_b.input_ids[1].shape, generator=torch.Generator().manual_seed(3))
    two.sample_mask[1] = two_b.sample_mask[1] = 0.0
    cfg = MicrobatchConfig(micro_batch_size=2, pack_sequences=True)
    ra = [
        model(m.input_ids, m.segment_ids, m.position_ids, mtp_loss_mask=m.mtp_loss_mask)
        for m in build_microbatches(two, cfg)
    ]
    rb = [
        model(m.input_ids, m.segment_ids, m.position_ids, mtp_loss_mask=m.mtp_loss_mask)
        for m in build_microbatches(two_b, cfg)
    ]
    for x, y in zip(ra[0].mtp_loss_sums, rb[0].mtp_loss_sums):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_token_budget_and_count_plans():
    batch = make_batch(16, seed=15)
    by_count = build_microbatches(batch, MicrobatchConfig(micro_batch_size=5))
    assert [m.num_samples for m in by_count] == [5, 5, 5, 1]
    budget = 30
    packed = build_microbatches(batch, MicrobatchConfig(max_tokens_per_microbatch=budget, pack_sequences=True))
    assert sum(m.num_samples for m in packed) == 16
    for m in packed:
        assert m.input_ids.shape[0] == 1
        assert m.num_tokens <= budget or m.num_samples == 1
    padded = build_microbatches(batch, MicrobatchConfig(max_tokens_per_microbatch=budget))
    for m in padded:
        assert m.input_ids.numel() <= budget or m.num_samples == 1
    assert len(build_microbatches(batch, MicrobatchConfig(micro_batch_size=8), num_microbatches=5)) == 5
    with pytest.raises(ValueError, match="num_microbatches"):
        build_microbatches(batch, MicrobatchConfig(micro_batch_size=8), num_microbatches=1)


def test_capabilities_travel_unchanged_and_owned_packing_disables_builder_packing():
    batch = make_batch(6, seed=16)
    caps = ModelCapabilities(owns_sequence_packing=True, owns_mtp_loss_mask_packing=True)
    mbs = build_microbatches(batch, MicrobatchConfig(micro_batch_size=3, pack_sequences=True), caps)
    assert all(m.capabilities == caps and not m.packed for m in mbs)
    assert mbs[0].input_ids.shape[0] == 3  # padded samples, one per row
    # the unpacked MTP mask is token_mask * sample_mask per sample
    for r, i in enumerate(range(3)):
        L = batch.lengths[i]
        torch.testing.assert_close(mbs[0].mtp_loss_mask[r, :L], batch.token_mask[i] * batch.sample_mask[i])
    # the sync and the split path hand the model the same flags
    model = make_model(D=1)
    model.capabilities = ModelCapabilities(slices_context_parallel_inputs=True)
    w = make_worker(model, pack=True)
    import splitrl.train.worker as worker_mod

    seen = []
    real = worker_mod.build_microbatches

    def recording(*a, **k):
        out = real(*a, **k)
        seen.extend(m.capabilities for m in out)
        return out

    worker_mod.build_microbatches = recording
    try:
        w.train(batch, make_loss())
        run_split(w, make_loss(), [[batch.select([0, 1]), batch.select([2, 3, 4, 5])]])
    finally:
        worker_mod.build_microbatches = real
    assert seen and all(c == model.capabilities for c in seen)


def test_impossible_capability_combinations_raise():
    with pytest.raises(ValueError, match="owns_sequence_packing"):
        ModelCapabilities(owns_mtp_loss_mask_packing=True)
    with pytest.raises(ValueError, match="slices_context_parallel_inputs"):
        ModelCapabilities(owns_sequence_packing=True, slices_context_parallel_inputs=True)


def test_from_padded_handles_left_and_right_padding():
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 0, 0]])
    att = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    tm = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]).float()
    b = TrainBatch.from_padded(ids, att, tm, advantages=torch.tensor([1.0, -1.0]))
    assert [x.tolist() for x in b.input_ids] == [[5, 6, 7], [5, 6, 7]]
    assert [x.tolist() for x in b.token_mask] == [[0, 1, 1], [0, 1, 1]]


def test_one_token_samples_are_accepted_and_contribute_nothing():
    batch = make_batch(6, seed=17)
    one = TrainBatch(
        [torch.tensor([5])],
        [torch.tensor([1.0])],
        torch.tensor([0.7]),
        generation_logprobs=[torch.tensor([-1.0])],
        prev_logprobs=[torch.tensor([-1.0])],
    )
    w_a = make_worker(make_model(D=2))
    w_b = make_worker(make_model(D=2))
    m_a = run_split(w_a, make_loss(), [[batch]])[0]
    m_b = run_split(w_b, make_loss(), [[one, batch, one]])[0]
    assert m_a["num_valid_tokens"] == m_b["num_valid_tokens"]
    assert m_a["loss"] == pytest.approx(m_b["loss"], rel=1e-6)
