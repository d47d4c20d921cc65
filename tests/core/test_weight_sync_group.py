"""Weight sync through a torch.distributed group of its own (splitrl/distributed/weight_sync.py),
gloo on CPU: 2 train ranks (FSDP2 over their own default group) and a generation process with a
bf16 rollout engine. After each of 2 real optimizer steps the engine holds exactly the trainer's
fp32 weights rounded to bf16, MTP heads included (tolerance: exact). Several receivers and fp32
engines are covered end to end by tests/e2e/test_placement_ray.py. Small buckets force tensors across several
broadcasts. Guards: a sync that drops tensors (MTP), mixes up the bucket offsets, leaves a tied
tensor stale or copies outside the engine's storage.
"""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _utils import make_batch, make_loss, make_model, make_worker  # noqa: E402

from splitrl.distributed.weight_sync import (  # noqa: E402
    WeightLayout,
    apply_staged,
    WeightSyncGroup,
    listen_socket,
    receive_weights,
    send_weights,
    stage_weights,
    unique_tensors,
)

BUCKET = 64 * 1024  # bytes: the tiny model's 1.4 MB go in ~25 buckets, the embedding alone in one
STEPS = 2
TRAIN, GEN = 2, 1


def _model():
    # tied embedding and output head: the tie travels as one tensor and both names are updated
    return make_model(D=2, detach=False, tie_word_embeddings=True)


def _train_rank(rank, train_port, sync_port_q, layout_q, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{train_port}", rank=rank, world_size=TRAIN)
    try:
        torch.manual_seed(rank)
        w = make_worker(_model(), lr=1e-2)
        layout = layout_q.get() if rank == 0 else None
        group = None
        if rank == 0:
            layout.check_sender(unique_tensors(w.model.state_dict(keep_vars=True)))
            sock, port = listen_socket("127.0.0.1")
            for _ in range(GEN):
                sync_port_q.put(port)
            group = WeightSyncGroup("127.0.0.1", port, 0, 1 + GEN, "cpu", listen_sock=sock, timeout_s=60)
        obj = [layout]
        dist.broadcast_object_list(obj, src=0)  # every train rank walks the layout (FSDP2 gathers)
        layout = obj[0]
        sent = []
        for step in range(STEPS):
            batch = make_batch(16, seed=step)
            w.begin_train_step(make_loss())
            w.train_microbatch(batch.select(list(range(rank, 16, TRAIN))))
            w.finish_train_step()
            send_weights(group, layout, w.model, BUCKET)
            sent.append({k: v.clone() for k, v in w.full_model_state_dict().items()})
        if rank == 0:
            torch.save(sent, out)
            group.close()
    finally:
        dist.destroy_process_group()


def _gen_rank(rank, dtype, sync_port_q, layout_q, out):
    from splitrl.rollout import GenerationConfig, RolloutEngine

    model = _model()
    with torch.no_grad():
        for p in model.parameters():  # weights unlike the trainer's, so a missed tensor shows
            p.fill_(0.5)
    engine = RolloutEngine(model.to(dtype), GenerationConfig(max_new_tokens=4), device="cpu")
    own = engine.weight_tensors()
    layout = WeightLayout.of(own)
    if rank == 1:
        layout_q.put(layout)
    port = sync_port_q.get()
    group = WeightSyncGroup("127.0.0.1", port, rank, 1 + GEN, "cpu", timeout_s=60)
    staging = torch.empty(layout.staging_nbytes(BUCKET), dtype=torch.uint8)
    got, untouched = [], []
    for step in range(STEPS):
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        receive_weights(group, layout, staging, BUCKET)
        # staged only: the engine (which may be generating meanwhile) still has its weights
        untouched.append(all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items()))
        apply_staged(layout, staging, own, BUCKET)
        engine.weights_updated(step + 1)
        # what the engine computes with: its model's state dict, not the receive buffers
        got.append({k: v.clone() for k, v in engine.model.state_dict().items()})
    torch.save({"got": got, "untouched": untouched, "version": engine.policy_version, "ptrs": {k: v.data_ptr() for k, v in own.items()},
                "ptrs_after": {k: v.data_ptr() for k, v in engine.weight_tensors().items()}}, out)
    group.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(role, idx, train_port, gen_dtype, sync_port_q, layout_q, outs):
    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    if role == "train":
        _train_rank(idx, train_port, sync_port_q, layout_q, outs[idx])
    else:
        _gen_rank(idx, gen_dtype, sync_port_q, layout_q, outs[TRAIN + idx - 1])


def _entry(i, train_port, gen_dtype, sync_port_q, layout_q, outs):
    role, idx = ("train", i) if i < TRAIN else ("gen", i - TRAIN + 1)
    _main(role, idx, train_port, gen_dtype, sync_port_q, layout_q, outs)


@pytest.mark.dist
def test_group_sync_equals_trainer_after_each_step(tmp_path):
    gen_dtype = torch.bfloat16
    ctx = mp.get_context("spawn")
    sync_port_q, layout_q = ctx.Queue(), ctx.Queue()
    outs = [str(tmp_path / f"{i}.pt") for i in range(TRAIN + GEN)]
    mp.spawn(_entry, args=(_free_port(), gen_dtype, sync_port_q, layout_q, outs), nprocs=TRAIN + GEN, join=True)
    sent = torch.load(outs[0])
    assert any(k.startswith("mtp.") for k in sent[0])
    # the steps changed the weights: equality below is not the initial weights twice
    assert not torch.equal(sent[0]["mtp.depths.1.fc.weight"], sent[1]["mtp.depths.1.fc.weight"])
    for g in range(GEN):
        res = torch.load(outs[TRAIN + g])
        assert res["version"] == STEPS
        assert res["untouched"] == [True] * STEPS
        assert res["ptrs"] == res["ptrs_after"]  # in place: the engine's storage is the same
        for step in range(STEPS):
            got, want = res["got"][step], sent[step]
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].dtype == gen_dtype, k
                assert torch.equal(got[k], want[k].to(gen_dtype)), (g, step, k)


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
