"""DESIGN §2 invariants 1, 5, 7 across data-parallel ranks: 2 gloo processes with FSDP2 and an
uneven split (5 + 11 samples, and a chunk one rank gets nothing of) equal one process.

Tolerance: as tests/core/test_chunk_invariance.py (fp32): gradients rtol 1e-5 with a floor of
1e-5 × the tensor's max at the first step (1e-4 later), parameters RMS ≤ 1e-3·lr and
max ≤ 0.1·lr, metrics rtol 1e-5.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _utils import (  # noqa: E402
    DEVICE,
    assert_grads_close,
    assert_metrics_close,
    assert_params_close,
    capture_grads,
    make_batch,
    make_loss,
    make_model,
    make_worker,
)

from splitrl.loss import LossType  # noqa: E402

LR = 1e-3


def _steps():
    """Two steps; each a list of chunks; each chunk a (rank-0 indices, rank-1 indices) split."""
    b0, b1 = make_batch(16, seed=20), make_batch(16, seed=21)
    split0 = [(list(range(0, 5)), list(range(5, 16)))]  # 5 + 11 in one chunk
    split1 = [([0, 1, 2], []), ([3, 4, 5, 6, 7, 8], list(range(9, 16)))]  # rank 1 idle in chunk 1
    return [(b0, split0), (b1, split1)]


def _init_rank(rank, world, store):
    sys.path.insert(0, os.path.dirname(__file__))
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if DEVICE == "cuda" else "gloo", init_method=f"file://{store}", rank=rank, world_size=world
    )


def _rank_main(rank, world, store, cases, out):
    """Every case of ``cases`` in turn, in one process group (spawning the two ranks costs
    seconds of start-up on 2 cores; each case builds its own model and worker)."""
    _init_rank(rank, world, store)
    try:
        results = {}
        for name, (loss_type, D, detach, pack, moe) in cases.items():
            w = make_worker(_model(D, detach, moe), lr=LR, mbs=1 if moe else 2, pack=pack)
            grads = capture_grads(w)
            metrics = []
            for batch, chunks in _steps():
                w.begin_train_step(make_loss(loss_type))
                for split in chunks:
                    w.train_microbatch(batch.select(split[rank]))
                metrics.append(w.finish_train_step())
            state = w.state_dict()
            results[name] = {"metrics": metrics, "grads": grads, "params": state["model"]}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _model(D, detach, moe):
    if moe:  # Qwen3-MoE with the router aux loss on (splitrl/models/moe.py)
        return make_model(D=D, detach=detach, family="qwen3_moe", router_aux_loss_coef=0.05)
    return make_model(D=D, detach=detach)


CASES = {
    "seq-D2-detached-packed": (LossType.SEQUENCE_LEVEL, 2, True, True, False),
    "tok-D1-attached-padded": (LossType.TOKEN_LEVEL, 1, False, False, False),
    # two gradient accumulators, both reduce-scattered by FSDP2 (splitrl.train.side_grads)
    "seq-D2-attached-packed": (LossType.SEQUENCE_LEVEL, 2, False, True, False),
    # router aux loss: one sample per microbatch fixes the routing statistics' composition
    "seq-D1-moe-aux": (LossType.SEQUENCE_LEVEL, 1, True, False, True),
}


def _needs_two_devices():
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """Rank 0's results of every case of ``CASES``, from one spawn of the two ranks."""
    _needs_two_devices()
    tmp = tmp_path_factory.mktemp("two_ranks")
    out = tmp / "rank0.pt"
    mp.start_processes(
        _rank_main, args=(2, str(tmp / "store"), CASES, str(out)), nprocs=2, join=True, start_method="spawn"
    )
    return torch.load(out, weights_only=False)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process(two_rank_results, name):
    loss_type, D, detach, pack, moe = CASES[name]
    res = two_rank_results[name]

    ref = make_worker(_model(D, detach, moe), lr=LR, mbs=1 if moe else 16)
    ref_grads = capture_grads(ref)
    ref_metrics = [ref.train(batch, make_loss(loss_type)) for batch, _ in _steps()]
    for i, (g, rg) in enumerate(zip(res["grads"], ref_grads)):
        assert_grads_close(g, rg, floor=1e-5 if i == 0 else 1e-4)
    for m, rm in zip(res["metrics"], ref_metrics):
        assert_metrics_close(m, rm)
    ref_params = {n: p.detach().cpu() for n, p in ref.model.named_parameters()}
    assert_params_close({n: res["params"][n] for n in ref_params}, ref_params, LR)


class _FailOnRank1:
    """A loss that raises on rank 1 only, after the forward (as a bug in a loss would)."""

    def __init__(self, inner):
        self.inner = inner
        self.loss_type, self.temperature, self.needs_entropy = inner.loss_type, inner.temperature, inner.needs_entropy

    def validate_batch(self, batch):
        self.inner.validate_batch(batch)

    def __call__(self, output, mb):
        if dist.get_rank() == 1:
            raise FloatingPointError("loss exploded on rank 1")
        return self.inner(output, mb)


def _rank_failure_main(rank, world, store, out, wheres):
    """For each of ``wheres`` in turn, in one process group: rank 1 fails (``prepare``: while
    preparing its share; ``loss``: in the loss, after the forward); then both ranks abort and run
    one more step (which also leaves the group ready for the next case)."""
    _init_rank(rank, world, store)
    try:
        results = {}
        for where in wheres:
            w = make_worker(make_model(D=1), lr=LR, mbs=2)
            share = make_batch(8, seed=30).select([0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7])
            w.begin_train_step(_FailOnRank1(make_loss()) if where == "loss" else make_loss())
            raised = None
            try:
                if where == "prepare" and rank == 1:
                    w.train_microbatch(None, error=KeyError("sample not in the data plane"))
                else:
                    w.train_microbatch(share)
            except Exception as e:  # noqa: BLE001
                raised = type(e).__name__
            w.abort_train_step()
            m = w.train(share, make_loss())
            results[where] = {"raised": raised, "loss": m["loss"]}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


FAILURES = [("prepare", "KeyError"), ("loss", "FloatingPointError")]


@pytest.fixture(scope="module")
def failure_results(tmp_path_factory):
    """Both ranks' results of every case of ``FAILURES``, from one spawn of the two ranks."""
    _needs_two_devices()
    tmp = tmp_path_factory.mktemp("rank_failure")
    out = tmp / "res"
    mp.start_processes(
        _rank_failure_main,
        args=(2, str(tmp / "store"), str(out), [where for where, _ in FAILURES]),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return torch.load(f"{out}.0"), torch.load(f"{out}.1")


@pytest.mark.dist
@pytest.mark.parametrize("where,error", FAILURES)
def test_a_failure_on_one_rank_makes_every_rank_raise_instead_of_hanging(failure_results, where, error):
    r0, r1 = (r[where] for r in failure_results)
    assert r0["raised"] == "RuntimeError" and r1["raised"] == error
    assert r0["loss"] == r1["loss"]  # the next step ran on both ranks, after the abort
