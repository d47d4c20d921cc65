"""MoE backbones (transformers' Qwen3-MoE) and the router load-balancing loss in the split step
(splitrl/models/moe.py: each microbatch contributes n_t·L_aux, finish divides once by N_t).

Checked against an independent per-sample reference: transformers' own
``Qwen3MoeForCausalLM(output_router_logits=True).aux_loss`` of each sample (with
micro_batch_size=1 every sample is its own microbatch, so a microbatch's routing statistics are
the sample's). Tolerances as tests/core/test_mtp_normalization.py: gradients rtol 1e-4 with a
floor of 1e-5 × the tensor's max (padded SDPA vs per-sample attention), metrics rtol 1e-5;
invariance tests as tests/core/test_chunk_invariance.py.
"""

import pytest
import torch
from _reference import mtp_raw_sum, per_sample_terms, sequence_level_pg
from _utils import (
    assert_grads_close,
    assert_metrics_close,
    assert_params_close,
    capture_grads,
    make_batch,
    make_loss,
    make_model,
    make_worker,
    params,
    partition,
    run_split,
    shuffled,
)

from splitrl.loss import ClippedPGLoss, GRPOLossConfig, LossType

LR = 1e-3


def _moe(D=0, detach=True, coef=0.05, seed=0):
    return make_model(D=D, detach=detach, family="qwen3_moe", seed=seed, router_aux_loss_coef=coef)


def _close(a, b, name):
    atol = 1e-5 * float(b.abs().max()) + 1e-12
    torch.testing.assert_close(a, b, rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


def _reference_aux(model, batch):
    """(Σ_s n_t(s)·aux(s), Σ_s n_t(s)·load_max(s)) with transformers' own aux loss per sample."""
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    aux_sum, load_sum = 0.0, 0.0
    for i in range(len(batch)):
        n_t = float((batch.token_mask[i][1:] * batch.sample_mask[i]).sum())
        out = model.backbone(input_ids=batch.input_ids[i][None], output_router_logits=True)
        aux_sum = aux_sum + n_t * out.aux_loss
        shares = []
        for logits in out.router_logits:
            counts = torch.bincount(logits.topk(k, -1).indices.reshape(-1), minlength=E).float()
            shares.append(float(counts.max() / counts.sum()))
        load_sum += n_t * sum(shares) / len(shares)
    return aux_sum, load_sum


@pytest.mark.parametrize(
    "loss_type,D,detach",
    [(LossType.TOKEN_LEVEL, 0, True), (LossType.SEQUENCE_LEVEL, 0, True), (LossType.SEQUENCE_LEVEL, 1, False)],
)
def test_router_aux_loss_matches_an_independent_reference(loss_type, D, detach):
    coef, lam = 0.05, 0.1
    batch = make_batch(10, seed=3, prev=False)
    loss = ClippedPGLoss(GRPOLossConfig(loss_type=loss_type))
    w = make_worker(_moe(D, detach, coef), mbs=1, max_grad_norm=None)
    grads = capture_grads(w)
    m = run_split(w, loss, [partition(batch, [3, 7])])[0]

    ref_model = _moe(D, detach, coef)
    terms = per_sample_terms(ref_model, batch)
    n_t = sum(float(s["mask"].sum()) for s in terms)
    if loss_type == LossType.TOKEN_LEVEL:
        main = sum((-(batch.advantages[i]) * s["logprobs"] * s["mask"]).sum() for i, s in enumerate(terms)) / n_t
    else:
        main = sequence_level_pg(terms, batch)
    aux_sum, load_sum = _reference_aux(ref_model, batch)
    total = main + coef * aux_sum / n_t
    if D > 0:
        total = total + mtp_raw_sum(terms, D) * (lam / D) / n_t
    total.backward()
    for n, p in ref_model.named_parameters():
        if p.grad is not None:
            _close(grads[0][n], p.grad, n)
    assert m["moe/aux_loss"] == pytest.approx(float(aux_sum.detach()) / n_t, rel=1e-5)
    assert m["moe/expert_load_max"] == pytest.approx(load_sum / n_t, rel=1e-5)
    assert 1.0 / ref_model.config.num_experts <= m["moe/expert_load_max"] <= 1.0


def test_aux_coefficient_zero_is_the_dense_loss_step():
    """c_aux = 0 gives exactly the policy-loss gradient; c_aux > 0 does not (the test can fail)."""
    batch = make_batch(10, seed=4, prev=False)
    got = {}
    for coef in (0.0, 0.05):
        w = make_worker(_moe(coef=coef), mbs=1, max_grad_norm=None)
        g = capture_grads(w)
        m = run_split(w, make_loss(), [[batch]])[0]
        assert m["moe/aux_loss"] > 0  # reported either way
        got[coef] = g[0]
    ref_model = _moe(coef=0.0)
    terms = per_sample_terms(ref_model, batch)
    n_t = sum(float(s["mask"].sum()) for s in terms)
    w_ref = make_worker(_moe(coef=0.0), mbs=16, max_grad_norm=None)
    g_ref = capture_grads(w_ref)
    w_ref.train(batch, make_loss())
    assert_grads_close(got[0.0], g_ref[0], rtol=1e-5, floor=1e-5)  # composition does not matter at c = 0
    router = "backbone.model.layers.0.mlp.gate.weight"
    assert float((got[0.05][router] - got[0.0][router]).abs().max()) > 1e-3 * float(got[0.0][router].abs().max())
    assert n_t > 0


@pytest.mark.parametrize("loss_type", [LossType.TOKEN_LEVEL, LossType.SEQUENCE_LEVEL])
def test_chunking_and_order_do_not_change_the_step_with_aux_loss_on(loss_type):
    """At fixed microbatch composition (micro_batch_size=1) the step is chunk-invariant."""
    batches = [make_batch(16, seed=s) for s in range(2)]
    ref = make_worker(_moe(D=1), lr=LR, mbs=1)
    ref_grads = capture_grads(ref)
    ref_metrics = [ref.train(b, make_loss(loss_type)) for b in batches]
    for chunker in (lambda b: partition(b, [4, 4, 4, 4]), lambda b: partition(b, [1, 7, 3, 5], order=shuffled(16, 5))):
        w = make_worker(_moe(D=1), lr=LR, mbs=1)
        grads = capture_grads(w)
        metrics = run_split(w, make_loss(loss_type), [chunker(b) for b in batches])
        for i, (g, rg) in enumerate(zip(grads, ref_grads)):
            assert_grads_close(g, rg, floor=1e-5 if i == 0 else 3e-4)
        assert_params_close(params(w.model), params(ref.model), LR)
        for m, rm in zip(metrics, ref_metrics):
            assert_metrics_close(m, rm)
            assert "moe/aux_loss" in m and "moe/expert_load_max" in m


def test_moe_checkpoint_round_trip_and_mtp_depth_uses_the_family_layer(tmp_path):
    model = _moe(D=2, seed=2)
    assert type(model.mtp.depths[1].layer).__name__ == "Qwen3MoeDecoderLayer"
    make_worker(model).train(make_batch(6), make_loss())
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(str(tmp_path))
    assert again.is_moe and again.moe_aux_loss_coef == pytest.approx(0.05)
    for (n, p), (n2, p2) in zip(model.named_parameters(), again.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
