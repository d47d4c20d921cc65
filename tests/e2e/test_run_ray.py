"""End to end on a local Ray cluster with TransferQueue: generation and train workers are Ray
actors, token tensors travel through TransferQueue, the controller sees ids and rewards only."""

import pytest
from _tiny import TINY_STEP

from splitrl.config import load_config
from splitrl.controller.controller import train
from splitrl.logging import read_metrics

pytestmark = pytest.mark.ray


def test_three_steps_on_ray_and_transferqueue(tmp_path):
    ray = pytest.importorskip("ray")
    cfg = load_config(
        None,
        TINY_STEP + ["backend=ray", "dataplane.kind=transferqueue", "num_steps=3", "checkpoint_every=0", f"output_dir={tmp_path}"],
    )
    try:
        res = train(cfg)
    finally:
        ray.shutdown()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("train/loss", "train/grad_norm", "train/mtp/mtp_1_loss", "train/mtp/mtp_1_acceptance_rate",
                "train/mtp/grad_norm", "train/reward", "timing/generation_s", "timing/weight_sync_s"):
        assert key in rows[-1], key
    for r, m in zip(rows, res.metrics):
        # what the logger wrote is what the train workers computed and the policy client returned
        assert r["train/mtp/mtp_1_loss"] == pytest.approx(m["train/mtp/mtp_1_loss"], rel=1e-12)
        assert r["train/num_valid_samples"] == 16
        assert 0.0 < r["train/mtp/mtp_1_loss"] < 10.0
    assert res.steps_done == 3
    assert (tmp_path / "checkpoints" / "step_000003" / "COMPLETE").exists()


def test_two_train_workers_equal_one(tmp_path):
    """Two data-parallel train actors (FSDP2 over gloo, samples split by tokens) compute the
    same first step as one: same rollouts (on-policy, per-sample seeds), so the same metrics.
    Tolerance rtol 1e-5 (a reordered fp32 reduction)."""
    ray = pytest.importorskip("ray")
    runs = {}
    try:
        for n in (1, 2):
            cfg = load_config(
                None,
                TINY_STEP
                + ["backend=ray", "num_steps=2", "buffer.max_staleness=0", "checkpoint_every=0",
                   f"num_train_workers={n}", f"output_dir={tmp_path / str(n)}"],
            )
            runs[n] = train(cfg).metrics
    finally:
        ray.shutdown()
    one, two = runs[1][0], runs[2][0]
    assert one["train/num_valid_tokens"] == two["train/num_valid_tokens"]
    for k in ("train/loss", "train/grad_norm", "train/mtp/mtp_1_loss", "train/mtp/mtp_1_acceptance_rate", "train/mtp/grad_norm"):
        assert two[k] == pytest.approx(one[k], rel=1e-5), k


def test_two_train_workers_resume_a_sharded_checkpoint_with_two_or_one(tmp_path):
    """The checkpoint of step 1 of a run with two train workers (each wrote its FSDP2 shards, in
    the background while step 2 trained) resumes step 2 with two workers exactly as the
    uninterrupted run computed it (max_staleness 0), and with one worker (resharded 2 -> 1) up
    to the reduction order of two ranks (rtol 1e-5, as test_two_train_workers_equal_one)."""
    import shutil

    ray = pytest.importorskip("ray")
    base = TINY_STEP + ["backend=ray", "buffer.max_staleness=0", "checkpoint_every=1", "num_steps=2"]
    try:
        full = train(load_config(None, base + ["num_train_workers=2", f"output_dir={tmp_path / 'full'}"])).metrics
        step1 = tmp_path / "full" / "checkpoints" / "step_000001"
        assert sorted(p.name for p in (step1 / "trainer").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert not (step1 / "policy").exists()  # an intermediate checkpoint: no export
        resumed = {}
        for n in (2, 1):
            out = tmp_path / f"resume{n}"
            shutil.copytree(step1, out / "checkpoints" / step1.name)
            res = train(load_config(None, base + [f"num_train_workers={n}", f"output_dir={out}"]))
            assert res.steps_done == 2 and len(res.metrics) == 1
            resumed[n] = res.metrics[0]
    finally:
        ray.shutdown()
    keys = ("train/loss", "train/grad_norm", "train/mtp/mtp_1_loss", "train/mtp/mtp_1_acceptance_rate",
            "train/mtp/grad_norm", "train/num_valid_tokens", "train/reward")
    for k in keys:
        assert resumed[2][k] == full[1][k], k
        assert resumed[1][k] == pytest.approx(full[1][k], rel=1e-5), k
