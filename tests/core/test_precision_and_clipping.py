"""fp16 loss scaling (DESIGN §2 invariant 6) and per-group gradient clipping (DESIGN §3)."""

import math

import pytest
import torch
from _utils import capture_grads, make_batch, make_loss, make_model, make_worker, params, partition

from splitrl.loss import ClippedPGLoss, GRPOLossConfig, LossType


def _rel(a, b):
    return float((a - b).norm() / (b.norm() + 1e-30))


def _check_fp16_matches_fp32(model_kwargs: dict, loss, metric_keys: tuple[str, ...]) -> None:
    """One step in fp32 (synchronous) and in fp16 (loss-scaled, chunks [7, 9]) on the same batch:
    ‖g16 − g32‖ ≤ 2 % of ‖g32‖ over the policy and over the MTP parameters; metrics rtol 1e-2."""
    batch = make_batch(16, seed=1)
    w32 = make_worker(make_model(**model_kwargs), max_grad_norm=None)
    w16 = make_worker(make_model(**model_kwargs), precision="fp16", max_grad_norm=None)
    g32, g16 = capture_grads(w32), capture_grads(w16)
    m32 = w32.train(batch, loss)
    # expected_num_tokens keeps fp16 activation gradients in range; finish divides it out
    w16.begin_train_step(loss, expected_num_tokens=batch.num_tokens)
    for c in partition(batch, [7, 9]):
        w16.train_microbatch(c)
    m16 = w16.finish_train_step()
    assert m16["skipped_step"] == 0.0 and m16["loss_scale"] == 2.0**16
    for group in ("main", "mtp"):
        names = [n for n in g32[0] if n.startswith("mtp.") == (group == "mtp")]
        a = torch.cat([g16[0][n].flatten() for n in names])
        b = torch.cat([g32[0][n].flatten() for n in names])
        assert _rel(a, b) <= 2e-2, group
    for k in metric_keys:
        assert m16[k] == pytest.approx(m32[k], rel=1e-2), k


def test_fp16_with_loss_scaling_matches_fp32_including_mtp():
    """Tolerance: over all policy parameters ‖g16 − g32‖ ≤ 2 % of ‖g32‖, the same over the MTP
    parameters (fp16 compute keeps 11 mantissa bits); metrics rtol 1e-2."""
    _check_fp16_matches_fp32(
        dict(D=2), make_loss(), ("loss", "mtp/mtp_1_loss", "mtp/mtp_2_loss", "mtp/grad_norm", "grad_norm")
    )


def test_fp16_sequence_level_attached_heads_matches_fp32():
    """Both backward passes of the side-loss path (splitrl.train.side_grads) are loss-scaled and
    unscaled alike. Tolerance as above: ‖g16 − g32‖ ≤ 2 % of ‖g32‖ over the policy and over the
    MTP parameters; metrics rtol 1e-2."""
    _check_fp16_matches_fp32(
        dict(D=2, detach=False, lam=0.3),
        make_loss(LossType.SEQUENCE_LEVEL),
        ("loss", "mtp/mtp_1_loss", "mtp/mtp_2_loss", "grad_norm"),
    )


class _PoisonedLoss(ClippedPGLoss):
    """Multiplies the loss by inf: a non-finite gradient, as an fp16 overflow would produce."""

    def __call__(self, output, mb):
        out = super().__call__(output, mb)
        out.loss = out.loss * float("inf")
        return out


@pytest.mark.parametrize("loss_type,detach", [(LossType.TOKEN_LEVEL, True), (LossType.SEQUENCE_LEVEL, False)])
def test_nonfinite_gradient_skips_update_and_lowers_scale(loss_type, detach):
    w = make_worker(make_model(D=1, detach=detach), precision="fp16")
    w.train(make_batch(8, seed=0), make_loss(loss_type))
    before = params(w.model)
    opt_before = {i: {k: v.clone() for k, v in s.items()} for i, s in w.optimizer.state.items()}
    scale, epoch = w.scaler.scale, w.scheduler.last_epoch
    m = w.train(make_batch(8, seed=1), _PoisonedLoss(GRPOLossConfig(loss_type=loss_type)))
    assert m["skipped_step"] == 1.0 and m["nonfinite_grad"] == 1.0 and m["empty_step"] == 0.0
    assert w.scaler.scale == scale / 2 and m["loss_scale"] == scale / 2
    assert w.scheduler.last_epoch == epoch  # the LR schedule did not step either
    for n, p in params(w.model).items():
        assert torch.equal(p, before[n]), n
    for i, s in w.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, opt_before[i][k])
    assert all(p.grad is None for p in w.model.parameters())
    m = w.train(make_batch(8, seed=2), make_loss(loss_type))
    assert m["skipped_step"] == 0.0


def _norm(grads, names):
    return math.sqrt(sum(float(grads[n].double().pow(2).sum()) for n in names))


def test_clipping_norms_match_hand_computation_and_groups_clip_independently():
    batch = make_batch(16, seed=4)
    free = make_worker(make_model(D=2), max_grad_norm=None)
    g_free = capture_grads(free)
    m_free = free.train(batch, make_loss())
    main = [n for n in g_free[0] if not n.startswith("mtp.")]
    mtp = [n for n in g_free[0] if n.startswith("mtp.")]
    n_main, n_mtp = _norm(g_free[0], main), _norm(g_free[0], mtp)
    assert m_free["grad_norm"] == pytest.approx(n_main, rel=1e-6)
    assert m_free["mtp/grad_norm"] == pytest.approx(n_mtp, rel=1e-6)

    limit_main, limit_mtp = 0.5 * n_main, 0.25 * n_mtp
    clipped = make_worker(make_model(D=2), max_grad_norm=limit_main, mtp_max_grad_norm=limit_mtp)
    g_clip = capture_grads(clipped)
    m_clip = clipped.train(batch, make_loss())
    assert m_clip["grad_norm"] == pytest.approx(n_main, rel=1e-6)  # reported pre-clip
    assert m_clip["mtp/grad_norm"] == pytest.approx(n_mtp, rel=1e-6)
    # the clip coefficient is limit / (norm + 1e-6), as in torch.nn.utils.clip_grad_norm_; the
    # 1e-6 matters at rtol 1e-5 for the per-depth MTP group, whose norm is ~0.1 here
    coef_main, coef_mtp = limit_main / (n_main + 1e-6), limit_mtp / (n_mtp + 1e-6)
    assert _norm(g_clip[0], main) == pytest.approx(coef_main * n_main, rel=1e-5)
    assert _norm(g_clip[0], mtp) == pytest.approx(coef_mtp * n_mtp, rel=1e-5)
    for n in main:
        torch.testing.assert_close(g_clip[0][n], g_free[0][n] * coef_main, rtol=1e-5, atol=1e-12)
    for n in mtp:
        torch.testing.assert_close(g_clip[0][n], g_free[0][n] * coef_mtp, rtol=1e-5, atol=1e-12)

    # MTP clipping off while the policy is clipped: the MTP group keeps its own norm
    only_main = make_worker(make_model(D=2), max_grad_norm=limit_main, mtp_max_grad_norm=float("inf"))
    g_om = capture_grads(only_main)
    only_main.train(batch, make_loss())
    assert _norm(g_om[0], mtp) == pytest.approx(n_mtp, rel=1e-5)


def test_attached_heads_clip_one_group_and_omit_mtp_grad_norm():
    batch = make_batch(16, seed=4)
    free = make_worker(make_model(D=1, detach=False), max_grad_norm=None)
    g_free = capture_grads(free)
    m_free = free.train(batch, make_loss())
    assert "mtp/grad_norm" not in m_free
    total = _norm(g_free[0], list(g_free[0]))
    assert m_free["grad_norm"] == pytest.approx(total, rel=1e-6)
    w = make_worker(make_model(D=1, detach=False), max_grad_norm=0.5 * total)
    g = capture_grads(w)
    w.train(batch, make_loss())
    assert _norm(g[0], list(g[0])) == pytest.approx(0.5 * total, rel=1e-5)
