"""``train.optim.offload: cpu`` (splitrl.train.offload): fp32 masters and AdamW state on the host,
compute copies and gradients on the device, the step streamed bucket by bucket.

On CPU host and device are one memory, but the path is CUDA's: the compute copies and the
gradient accumulators are tensors of their own, gradients are copied into the staging buffers,
the AdamW step runs per bucket and the updated masters are cast and copied back.

Tolerances: with the same AdamW kernel (the fused CPU one) on both sides the offloaded step is
bit-identical to the on-device step (the same forward on the same compute copies, the same fp32
accumulation, norms and scaling; elementwise AdamW per bucket). Against the default on-device
optimizer on CPU (torch's single-tensor AdamW) only AdamW's rounding differs: parameters within
1e-3·lr per tensor RMS and 0.1·lr worst element after 3 steps (DESIGN §2's fp32 unit), metrics to
rtol 1e-5. With ``SPLITRL_TEST_DEVICE=cuda`` (the streams, events and pinned staging of the CUDA
path) the on-device reference runs the fused CUDA kernel, so the comparisons that are exact on
CPU take that tolerance there; offloaded workers among themselves stay exact.
"""

import pytest
import torch
from _utils import (
    DEVICE,
    assert_metrics_close,
    assert_optim_close,
    assert_params_close,
    make_batch,
    make_loss,
    make_model,
    make_worker,
    optim_state,
    params,
    partition,
)

from splitrl.loss import LossType
from splitrl.train import worker as worker_module
from splitrl.train.offload import HostOffload, bucket_indices

LR = 1e-3
TINY_BUCKET_MB = 2**-10  # 1 KiB: every tensor of the tiny model a bucket of its own, or nearly


def _same(pa: dict, pb: dict, exact: bool) -> None:
    if exact:
        assert all(torch.equal(pa[n], pb[n]) for n in pb)
    else:
        assert_params_close(pa, pb, LR, rms=1e-3, worst=0.1)


def _same_metrics(ma: dict, mb: dict, exact: bool) -> None:
    if exact:
        assert ma == mb
    else:
        assert_metrics_close(ma, mb, rtol=1e-5)


CPU = DEVICE == "cpu"  # the on-device reference uses the offloaded step's AdamW kernel only on CPU


def _steps(worker, n=3, chunks=(5, 11)):
    loss, out = make_loss(), []
    for s in range(n):
        batch = make_batch(seed=s)
        worker.begin_train_step(loss)
        for c in partition(batch, list(chunks)):
            worker.train_microbatch(c)
        out.append(worker.finish_train_step())
    return out


@pytest.fixture
def fused_reference(monkeypatch):
    """On-device workers built while this fixture is active use the fused CPU AdamW, the kernel
    the offloaded step uses."""
    build = worker_module.build_optimizer

    def fused(*args, fused=False, **kw):
        return build(*args, fused=True, **kw)

    monkeypatch.setattr(worker_module, "build_optimizer", fused)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offloaded_step_is_bit_identical_with_the_same_adamw_kernel(precision, fused_reference):
    ref = make_worker(make_model(D=1), lr=LR, precision=precision)
    off = make_worker(make_model(D=1), lr=LR, precision=precision, offload="cpu", offload_bucket_mb=TINY_BUCKET_MB)
    assert len(off.offload.buckets) > 5
    m_ref, m_off = _steps(ref), _steps(off)
    for a, b in zip(m_off, m_ref):
        _same_metrics(a, b, CPU)
    _same(params(off.model), params(ref.model), CPU)
    sa, sb = optim_state(off), optim_state(ref)
    if not CPU:
        assert_optim_close(sa, sb, rtol=1e-5, floor=1e-4)
        return
    for i in sb["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][i][k], sb["state"][i][k])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offloaded_step_equals_the_default_on_device_step(precision):
    ref = make_worker(make_model(D=1), lr=LR, precision=precision)
    off = make_worker(make_model(D=1), lr=LR, precision=precision, offload="cpu")
    m_ref, m_off = _steps(ref), _steps(off)
    for a, b in zip(m_off, m_ref):
        assert_metrics_close(a, b, rtol=1e-5)
    assert_params_close(params(off.model), params(ref.model), LR, rms=1e-3, worst=0.1)
    assert_optim_close(optim_state(off), optim_state(ref), rtol=1e-5, floor=1e-4)


def test_the_offloaded_path_keeps_masters_on_the_host_and_copies_back():
    """The parameters are the fp32 masters (CPU); the compute copies are tensors of their own,
    updated after each step to the cast of the updated masters; no gradient stays in ``.grad``."""
    w = make_worker(make_model(D=1), lr=LR, precision="bf16", offload="cpu", offload_bucket_mb=TINY_BUCKET_MB)
    off = w.offload
    assert w.compute_weights is None and isinstance(off, HostOffload)
    before = [lo.clone() for lo in off.low]
    _steps(w, n=1)
    for p, low, old in zip(off.params, off.low, before):
        assert p.dtype == torch.float32 and p.device.type == "cpu" and p.grad is None
        assert low.dtype == torch.bfloat16 and low.data_ptr() != p.data_ptr()
        assert low.device.type == DEVICE and torch.equal(low.cpu(), p.detach().to(torch.bfloat16))
    assert any(not torch.equal(a, b) for a, b in zip(before, off.low))  # the step reached the copies
    assert all(a is None for a in off.acc)  # the accumulators are dropped after the step
    # a master written from outside reaches its copy at the next step's start (version counter)
    master = off.params[0]
    with torch.no_grad():
        master.add_(1.0)
    w.begin_train_step(make_loss())
    assert torch.equal(off.low[0].cpu(), master.detach().to(torch.bfloat16))
    w.abort_train_step()
    # the plan counts the optimizer state off the device
    assert w.memory_plan.layout.device_trainable == 6 and w.memory_plan.layout.host_trainable == 12


def test_checkpoints_round_trip_with_offload(tmp_path):
    """state_dict / load_state_dict and the sharded checkpoint: a worker restored from an offloaded
    one (offloaded or not) continues bit-identically (the on-device one with the same fused kernel)."""
    a = make_worker(make_model(D=1), lr=LR, precision="bf16", offload="cpu")
    _steps(a, n=2)
    state = a.state_dict()
    a.save_checkpoint(str(tmp_path / "ckpt"), blocking=True)
    b = make_worker(make_model(D=1, seed=7), lr=LR, precision="bf16", offload="cpu")
    b.load_state_dict(state)
    c = make_worker(make_model(D=1, seed=8), lr=LR, precision="bf16", offload="cpu")
    c.load_checkpoint(str(tmp_path / "ckpt"))
    loss, batch = make_loss(), make_batch(seed=9)
    ma, mb, mc = a.train(batch, loss), b.train(batch, loss), c.train(batch, loss)
    assert ma == mb == mc  # the loaded masters reached the compute copies before the forward
    pa, pb, pc = params(a.model), params(b.model), params(c.model)
    assert all(torch.equal(pa[n], pb[n]) and torch.equal(pa[n], pc[n]) for n in pa)
    assert a.steps_finished == b.steps_finished == c.steps_finished == 3


def test_an_offloaded_checkpoint_loads_on_the_device(tmp_path, fused_reference):
    a = make_worker(make_model(D=1), lr=LR, precision="bf16", offload="cpu")
    _steps(a, n=2)
    state = a.state_dict()
    d = make_worker(make_model(D=1, seed=7), lr=LR, precision="bf16")
    d.load_state_dict(state)
    loss, batch = make_loss(), make_batch(seed=9)
    _same_metrics(a.train(batch, loss), d.train(batch, loss), CPU)
    _same(params(a.model), params(d.model), CPU)


def test_mtp_warmup_drops_the_policy_gradients_with_offload(fused_reference):
    ref = make_worker(make_model(D=1), lr=LR, precision="bf16")
    ref.config.mtp_warmup_steps = 1
    kw = dict(lr=LR, precision="bf16", offload="cpu", offload_bucket_mb=TINY_BUCKET_MB)
    off = make_worker(make_model(D=1), **kw)
    off.config.mtp_warmup_steps = 1
    before = params(off.model)
    m_ref, m_off = _steps(ref, n=2), _steps(off, n=2)
    assert m_off[0]["mtp_warmup"] == 1.0
    for a, b in zip(m_off, m_ref):
        _same_metrics(a, b, CPU)
    _same(params(off.model), params(ref.model), CPU)
    # after the warm-up step alone the policy's weights were still the initial ones: checked via a fresh run
    one = make_worker(make_model(D=1), **kw)
    one.config.mtp_warmup_steps = 1
    _steps(one, n=1)
    after = params(one.model)
    assert all(torch.equal(after[n], before[n]) for n in before if not n.startswith("mtp."))


def test_offload_refuses_what_it_does_not_run(monkeypatch):
    w = make_worker(make_model(D=1, detach=False), lr=LR, precision="bf16", offload="cpu")
    with pytest.raises(ValueError, match="offload=cpu does not run the second backward"):
        w.begin_train_step(make_loss(LossType.SEQUENCE_LEVEL))
    assert not w.step_open
    w.train(make_batch(), make_loss())  # a TOKEN_LEVEL step runs
    monkeypatch.setattr(worker_module.du, "is_distributed", lambda: True)
    with pytest.raises(ValueError, match="offload=cpu runs on one process"):
        make_worker(make_model(D=1), precision="bf16", offload="cpu")


def test_bucket_indices():
    assert bucket_indices([3, 3, 3, 10, 1, 1], 6) == [[0, 1], [2], [3], [4, 5]]
    assert bucket_indices([], 6) == []
