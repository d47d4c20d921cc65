"""Weight sync through a torch.distributed group of its own (splitrl/distributed/weight_sync.py):
train ranks and a generation process with a bf16 rollout engine. After each of 2 real optimizer
steps the engine holds exactly the trainer's fp32 weights rounded to bf16, MTP heads and the tied
embedding included (tolerance: exact). Small buckets force tensors across several broadcasts.

Two setups share one body (:class:`Setup`):
- gloo on CPU (always): 2 train ranks (FSDP2 over their gloo default group) and 1 generation process.
- NCCL on 2 GPUs (``SPLITRL_TEST_DEVICE=cuda`` and 2 GPUs, skipped otherwise), the split placement
  of a 2-GPU run: train rank 0 on cuda:0, the generation process on cuda:1, the weight-sync group
  with device ``cuda`` (NCCL), received on a stream of its own as
  :meth:`GenerationWorker.receive_weights` does. Its trainer holds either FSDP2 weights (an NCCL
  default group of one rank, as every rank of a larger trainer does) or plain weights (no default
  group: what :class:`TrainActor` builds with one train rank).

Several receivers and fp32 engines are covered end to end by tests/e2e/test_placement_ray.py.
Guards: a sync that drops tensors (MTP), mixes up the bucket offsets, leaves a tied tensor stale,
copies outside the engine's storage or reads a bucket before its broadcast finished.
"""

import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _utils import DEVICE, make_batch, make_loss, make_model, make_worker  # noqa: E402

from splitrl.distributed.utils import init_loopback_process_group  # noqa: E402
from splitrl.distributed.weight_sync import (  # noqa: E402
    WeightLayout,
    WeightSyncGroup,
    apply_staged,
    listen_socket,
    receive_weights,
    send_weights,
    stage_weights,
    unique_tensors,
)
from splitrl.train import SpeedConfig  # noqa: E402

BUCKET = 64 * 1024  # bytes: the tiny model's 1.4 MB go in ~25 buckets, the embedding alone in one
STEPS = 2


@dataclass(frozen=True)
class Setup:
    """Where the processes run. ``device``: cpu (gloo groups) or cuda (NCCL; train rank r on
    cuda:r, generation process g on cuda:train+g-1); ``sharded``: the train ranks form a default
    group and hold FSDP2 weights (else one train rank with plain weights, no default group);
    ``wait_s``: how long the rendezvous, the queues and each group's store and collectives wait
    for a peer; ``deadline_s``: the whole spawn must end by then (a hang fails the test, and on
    the GPU machine within 2 minutes; the loaded CPU machine gets more)."""

    device: str
    train: int
    gen: int
    sharded: bool
    wait_s: float
    deadline_s: float

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


GLOO = Setup("cpu", train=2, gen=1, sharded=True, wait_s=300, deadline_s=500)
NCCL_FSDP2 = Setup("cuda", train=1, gen=1, sharded=True, wait_s=60, deadline_s=110)
NCCL_PLAIN = Setup("cuda", train=1, gen=1, sharded=False, wait_s=60, deadline_s=110)

needs_two_gpus = pytest.mark.skipif(
    DEVICE != "cuda" or torch.cuda.device_count() < 2,
    reason="the NCCL weight sync runs with SPLITRL_TEST_DEVICE=cuda on a machine with 2 GPUs",
)


def _model():
    # tied embedding and output head: the tie travels as one tensor and both names are updated
    return make_model(D=2, detach=False, tie_word_embeddings=True)


def _train_rank(rank, setup, train_port, sync_port_q, layout_q, out):
    if setup.device == "cuda":
        # before any group: NCCL binds each rank to the current device (as TrainActor does)
        torch.cuda.set_device(rank)
    if setup.sharded:
        init_loopback_process_group(setup.backend, rank, setup.train, train_port, timeout_s=setup.wait_s)
    group = None
    try:
        torch.manual_seed(rank)
        # no torch.compile (layers, head kernels): a cold compile takes most of the deadline and
        # plays no part in a sync, which reads the same parameters either way
        speed = SpeedConfig(compile_layers=False, fused_head_kernels=False)
        w = make_worker(_model(), lr=1e-2, device=setup.device, speed=speed)
        assert w.distributed == setup.sharded
        layout = layout_q.get(timeout=setup.wait_s) if rank == 0 else None
        if rank == 0:
            layout.check_sender(unique_tensors(w.model.state_dict(keep_vars=True)))
            sock, port = listen_socket("127.0.0.1")
            for _ in range(setup.gen):
                sync_port_q.put(port)
            # TrainActor.join_weight_sync: device "cuda" when the trainer is on a GPU
            group = WeightSyncGroup(
                "127.0.0.1", port, 0, 1 + setup.gen, setup.device, listen_sock=sock, timeout_s=setup.wait_s
            )
            assert group.backend == setup.backend
        if setup.sharded:
            obj = [layout]
            dist.broadcast_object_list(obj, src=0)  # every train rank walks the layout (FSDP2 gathers)
            layout = obj[0]
        sent = []
        for step in range(STEPS):
            batch = make_batch(16, seed=step)
            w.begin_train_step(make_loss())
            w.train_microbatch(batch.select(list(range(rank, 16, setup.train))))
            w.finish_train_step()
            send_weights(group, layout, w.model, BUCKET)
            sent.append({k: v.detach().cpu().clone() for k, v in w.full_model_state_dict().items()})
        if setup.device == "cuda":
            torch.cuda.synchronize()  # the last broadcast is done before the group goes
        if rank == 0:
            torch.save(sent, out)
    finally:
        if group is not None:
            group.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _gen_rank(rank, setup, sync_port_q, layout_q, out):
    import splitrl.rollout.engine as engine_mod
    from splitrl.rollout import GenerationConfig, RolloutEngine

    if setup.device == "cuda":
        torch.cuda.set_device(setup.train + rank - 1)
        # compiling the decode kernels (tens of seconds at engine start) plays no part in a sync
        # either
        engine_mod.COMPILE_KERNELS = False
    model = _model()
    with torch.no_grad():
        for p in model.parameters():  # weights unlike the trainer's, so a missed tensor shows
            p.fill_(0.5)
    engine = RolloutEngine(model.to(torch.bfloat16), GenerationConfig(max_new_tokens=4), device=setup.device)
    own = engine.weight_tensors()
    layout = WeightLayout.of(own)
    if rank == 1:
        layout_q.put(layout)
    port = sync_port_q.get(timeout=setup.wait_s)
    group = WeightSyncGroup("127.0.0.1", port, rank, 1 + setup.gen, engine.device.type, timeout_s=setup.wait_s)
    try:
        assert group.backend == setup.backend
        staging = torch.empty(layout.staging_nbytes(BUCKET), dtype=torch.uint8, device=engine.device)
        # GenerationWorker.receive_weights: the receive runs on a stream of its own, then waits for it
        stream = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
        got, untouched = [], []
        for step in range(STEPS):
            before = {k: v.clone() for k, v in engine.model.state_dict().items()}
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                receive_weights(group, layout, staging, BUCKET)
            if stream is not None:
                stream.synchronize()
            # staged only: the engine (which may be generating meanwhile) still has its weights
            untouched.append(all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items()))
            apply_staged(layout, staging, own, BUCKET)
            engine.weights_updated(step + 1)
            # what the engine computes with: its model's state dict, not the receive buffers
            got.append({k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()})
        torch.save(
            {
                "got": got,
                "untouched": untouched,
                "version": engine.policy_version,
                "device": str(engine.device),
                "ptrs": {k: v.data_ptr() for k, v in own.items()},
                "ptrs_after": {k: v.data_ptr() for k, v in engine.weight_tensors().items()},
            },
            out,
        )
    finally:
        group.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(i, setup, train_port, sync_port_q, layout_q, outs):
    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    if i < setup.train:
        _train_rank(i, setup, train_port, sync_port_q, layout_q, outs[i])
    else:
        _gen_rank(i - setup.train + 1, setup, sync_port_q, layout_q, outs[i])


def _spawn(setup, outs):
    """Run every process of ``setup``; a child's exception is raised here, and a run past
    ``setup.deadline_s`` (a collective that never completes) kills them all and fails."""
    ctx = mp.get_context("spawn")
    sync_port_q, layout_q = ctx.Queue(), ctx.Queue()
    procs = mp.start_processes(
        _entry,
        args=(setup, _free_port(), sync_port_q, layout_q, outs),
        nprocs=setup.train + setup.gen,
        join=False,
        start_method="spawn",
    )
    end = time.monotonic() + setup.deadline_s
    while not procs.join(timeout=5):
        if time.monotonic() > end:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
            for p in procs.processes:
                p.join(10)
            pytest.fail(
                f"the {setup.backend} weight sync did not finish within {setup.deadline_s} s (hung collective?)"
            )


@pytest.mark.dist
@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(GLOO, id="gloo-cpu-fsdp2"),
        pytest.param(NCCL_FSDP2, id="nccl-cuda-fsdp2", marks=needs_two_gpus),
        pytest.param(NCCL_PLAIN, id="nccl-cuda-plain", marks=needs_two_gpus),
    ],
)
def test_group_sync_equals_trainer_after_each_step(tmp_path, setup):
    outs = [str(tmp_path / f"{i}.pt") for i in range(setup.train + setup.gen)]
    _spawn(setup, outs)
    sent = torch.load(outs[0])
    assert any(k.startswith("mtp.") for k in sent[0])
    # the steps changed the weights: equality below is not the initial weights twice
    assert not torch.equal(sent[0]["mtp.depths.1.fc.weight"], sent[1]["mtp.depths.1.fc.weight"])
    for g in range(setup.gen):
        res = torch.load(outs[setup.train + g])
        if setup.device == "cuda":
            assert res["device"] == f"cuda:{setup.train + g}"
        assert res["version"] == STEPS
        assert res["untouched"] == [True] * STEPS
        assert res["ptrs"] == res["ptrs_after"]  # in place: the engine's storage is the same
        for step in range(STEPS):
            got, want = res["got"][step], sent[step]
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].dtype == torch.bfloat16, k
                assert torch.equal(got[k], want[k].to(torch.bfloat16)), (g, step, k)


def test_colocated_stage_then_apply_in_place_and_checked():
    """The colocated hand-over: staging leaves the engine untouched; applying copies exactly into
    the engine's own storage (MTP and the tie included, bf16 engine: the fp32 values rounded);
    a model without MTP heads is refused before anything is staged."""
    from splitrl.rollout import GenerationConfig, RolloutEngine

    src = _model()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    engine = RolloutEngine(_model().to(torch.bfloat16), GenerationConfig(max_new_tokens=4), device="cpu")
    own = engine.weight_tensors()
    layout = WeightLayout.of(own)
    staging = torch.zeros(layout.staging_nbytes(BUCKET), dtype=torch.uint8)
    ptrs = {k: v.data_ptr() for k, v in own.items()}
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    assert stage_weights(layout, src, staging, BUCKET) == layout.nbytes
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    apply_staged(layout, staging, own, BUCKET)
    got = engine.model.state_dict()
    for k, v in src.state_dict().items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k
        assert got[k].data_ptr() == ptrs[k]
    staged = staging.clone()
    with pytest.raises(ValueError, match="MTP tensors must be synced"):
        stage_weights(layout, make_model(D=0, tie_word_embeddings=True), staging, BUCKET)
    assert torch.equal(staging, staged)


def test_buckets_cover_every_byte_once():
    """Bucket offsets: aligned, non-overlapping, each slot in exactly one bucket, no bucket over
    the limit unless it holds a single larger tensor; buckets sit apart in the staging buffer."""
    layout = WeightLayout.of(_model().state_dict(keep_vars=True))
    starts = layout.bucket_starts(BUCKET)
    for (b0, s0), (b1, s1) in zip(starts, starts[1:]):
        assert s0 % 16 == 0 and s1 >= s0 + layout.bucket_nbytes(b0)
    assert layout.staging_nbytes(BUCKET) == starts[-1][1] + layout.bucket_nbytes(starts[-1][0])
    assert layout.staging_nbytes(BUCKET) < layout.nbytes + 16 * (len(layout.slots) + len(starts))
    seen = []
    for b in layout.buckets(BUCKET):
        n = layout.bucket_nbytes(b)
        assert n <= BUCKET or len(b) == 1
        end = 0
        for i, off in b:
            assert off % 16 == 0 and off >= end
            end = off + layout.slots[i].nbytes
            seen.append(i)
    assert seen == list(range(len(layout.slots)))
    tied = [s for s in layout.slots if len(s.names) > 1]
    assert len(tied) == 1 and "lm_head" in " ".join(tied[0].names)
