"""Sharded asynchronous checkpoints of the train worker (splitrl.train.checkpoint; issue 9 item 3).

- An asynchronous save is a snapshot: training that changes the live tensors right after the
  call returns does not reach the files (guards against a staging step that hands the live
  tensors to the background writer).
- Resharding: a checkpoint written by 2 gloo ranks (FSDP2 shards) loads into 1 process, and one
  written by 1 process loads into 2 ranks, with bit-identical parameters, Adam moments and step
  counts, the same LR schedule and counters; the step after a resharded load equals the step
  after loading the full state dict (tolerance: exact, both are the same arithmetic).
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _utils import DEVICE, make_batch, make_loss, make_model, make_worker  # noqa: E402

LR = 1e-2


def _assert_state_equal(a: dict, b: dict) -> None:
    """Model tensors, optimizer moments and steps, param-group hyperparameters, schedule, counters."""
    assert set(a["model"]) == set(b["model"])
    for k, v in a["model"].items():
        assert torch.equal(v.cpu(), b["model"][k].cpu()), f"parameter {k} differs"
    assert set(a["optimizer"]["state"]) == set(b["optimizer"]["state"])
    for k, st in a["optimizer"]["state"].items():
        for n, v in st.items():
            assert torch.equal(torch.as_tensor(v).cpu(), torch.as_tensor(b["optimizer"]["state"][k][n]).cpu()), (
                f"optimizer {k}.{n} differs"
            )
    for ga, gb in zip(a["optimizer"]["param_groups"], b["optimizer"]["param_groups"], strict=True):
        assert ga["lr"] == gb["lr"] and sorted(ga["params"]) == sorted(gb["params"])
    assert (
        a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]
        and a["scheduler"]["_last_lr"] == b["scheduler"]["_last_lr"]
    )
    assert (a["steps_finished"], a["updates_applied"]) == (b["steps_finished"], b["updates_applied"])


def _train_steps(w, seeds, select=None):
    for s in seeds:
        batch = make_batch(8, seed=s)
        w.train(batch if select is None else batch.select(select), make_loss())


def test_async_save_is_a_snapshot_of_the_call(tmp_path):
    w = make_worker(make_model(D=1), lr=LR)
    _train_steps(w, [1])
    before = w.state_dict()
    w.save_checkpoint(str(tmp_path / "ck"))
    _train_steps(w, [2])  # changes parameters and moments in place while the files are written
    w.wait_checkpoint()
    after = w.state_dict()
    assert not torch.equal(before["model"]["backbone.lm_head.weight"], after["model"]["backbone.lm_head.weight"])

    fresh = make_worker(make_model(D=1, seed=7), lr=LR)
    fresh.load_checkpoint(str(tmp_path / "ck"))
    _assert_state_equal(fresh.state_dict(), before)


def test_consecutive_saves_reuse_the_staging_buffers_and_each_checkpoint_is_its_own(tmp_path, monkeypatch):
    """The stager keeps its CPU buffers from one save to the next (the first save's allocation,
    pinned on CUDA, is what made the first checkpoint block for 5 s), even though DCP calls its
    ``close`` after every save as torch 2.11 does (a reused DefaultStager then failed in the
    second save on the H200: "KeyError: <class 'type'>"). Three saves, before and after optimizer
    steps, share one set of buffers, and every checkpoint loads exactly: a reused buffer never
    leaks one save's values into another's files."""
    import torch.distributed.checkpoint as dcp

    real = dcp.async_save

    def closing_async_save(*args, async_stager=None, **kwargs):
        out = real(*args, async_stager=async_stager, **kwargs)
        if async_stager is not None:
            async_stager.close()
        return out

    monkeypatch.setattr(dcp, "async_save", closing_async_save)
    w = make_worker(make_model(D=1), lr=LR)
    stager = lambda: w.checkpointer._stager  # noqa: E731
    states, buffers = [], []
    for i, seeds in enumerate([[], [1], [2]]):
        _train_steps(w, seeds)
        states.append(w.state_dict())
        w.save_checkpoint(str(tmp_path / f"ck{i}"))
        w.wait_checkpoint()
        buffers.append(stager()._buffers["model"]["backbone.lm_head.weight"])
    assert buffers[1] is buffers[0] and buffers[2] is buffers[0], "a later save allocated its staging buffers again"
    for i, state in enumerate(states):
        fresh = make_worker(make_model(D=1, seed=7), lr=LR)
        fresh.load_checkpoint(str(tmp_path / f"ck{i}"))
        _assert_state_equal(fresh.state_dict(), state)


def test_stager_allocates_again_when_the_layout_changes_and_copies_scalars_from_the_state():
    from splitrl.train.checkpoint import _KeptStager

    st = _KeptStager(pin=False)
    a = st.stage({"w": torch.ones(3), "opt": {"lr": 0.1}})
    b = st.stage({"w": torch.full((3,), 2.0), "opt": {"lr": 0.2}})
    assert b["w"] is a["w"] and torch.equal(b["w"], torch.full((3,), 2.0)) and b["opt"]["lr"] == 0.2
    c = st.stage({"w": torch.zeros(4), "opt": {"lr": 0.2}})  # another shape: new buffers
    assert c["w"] is not a["w"] and torch.equal(c["w"], torch.zeros(4)) and torch.equal(a["w"], torch.full((3,), 2.0))
    d = st.stage({"w": torch.zeros(4), "m": torch.ones(2), "opt": {"lr": 0.2}})  # a new entry: new buffers
    assert torch.equal(d["m"], torch.ones(2))
    st.release()
    assert st._buffers is None


def test_save_refuses_while_the_previous_one_is_pending_and_a_missing_checkpoint_is_named(tmp_path):
    w = make_worker(make_model(D=0), lr=LR)
    w.save_checkpoint(str(tmp_path / "a"))
    with pytest.raises(RuntimeError, match="still being written"):
        w.checkpointer.save(tmp_path / "b", {})
    w.wait_checkpoint()
    assert w.checkpoint_written()
    with pytest.raises(FileNotFoundError, match="no sharded trainer state"):
        w.load_checkpoint(str(tmp_path / "b"))


def _rank_main(rank, world, store, tmp):
    sys.path.insert(0, os.path.dirname(__file__))
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if DEVICE == "cuda" else "gloo", init_method=f"file://{store}", rank=rank, world_size=world
    )
    try:
        share = [list(range(0, 3)), list(range(3, 8))][rank]
        # 2 -> 1: two steps, save (async), one more step while the files are written
        w = make_worker(make_model(D=1), lr=LR)
        _train_steps(w, [11, 12], share)
        full = w.state_dict()
        w.save_checkpoint(f"{tmp}/two")
        _train_steps(w, [13], share)
        w.wait_checkpoint()
        if rank == 0:
            torch.save(full, f"{tmp}/two_full.pt")
        # 1 -> 2: load the parent's one-process checkpoint into fresh sharded workers
        w1 = make_worker(make_model(D=1, seed=3), lr=LR)
        w1.load_checkpoint(f"{tmp}/one")
        loaded = w1.state_dict()
        if rank == 0:
            torch.save(loaded, f"{tmp}/one_loaded_by_two.pt")
        w1.checkpointer.close()
        w.checkpointer.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_checkpoint_reshards_two_ranks_to_one_and_one_to_two(tmp_path):
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    one = make_worker(make_model(D=1, seed=1), lr=LR)
    _train_steps(one, [21, 22])
    one.save_checkpoint(str(tmp_path / "one"), blocking=True)
    one_full = one.state_dict()

    mp.start_processes(
        _rank_main, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )

    # every rank wrote its own shard
    shards = sorted(p.name for p in (tmp_path / "two" / "trainer").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert all((tmp_path / "two" / "trainer" / s).stat().st_size > 0 for s in shards)

    # 2 -> 1
    full = torch.load(tmp_path / "two_full.pt", weights_only=False)
    assert full["steps_finished"] == 2
    resumed = make_worker(make_model(D=1, seed=9), lr=LR)
    resumed.load_checkpoint(str(tmp_path / "two"))
    _assert_state_equal(resumed.state_dict(), full)
    reference = make_worker(make_model(D=1, seed=9), lr=LR)
    reference.load_state_dict(full)
    _train_steps(resumed, [13])
    _train_steps(reference, [13])
    _assert_state_equal(resumed.state_dict(), reference.state_dict())

    # 1 -> 2
    _assert_state_equal(torch.load(tmp_path / "one_loaded_by_two.pt", weights_only=False), one_full)
