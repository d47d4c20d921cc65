"""End to end on a local Ray cluster with TransferQueue: generation and train workers are Ray
actors, token tensors travel through TransferQueue, the controller sees ids and rewards only."""

import pytest
from _tiny import TINY_STEP

from splitrl.config import load_config
from splitrl.controller.controller import train
from splitrl.logging import read_metrics

pytestmark = pytest.mark.ray


def test_three_steps_on_ray_and_transferqueue(tmp_path, ray_cluster):
    cfg = load_config(
        None,
        TINY_STEP + ["backend=ray", "dataplane.kind=transferqueue", "num_steps=3", "checkpoint_every=0", f"output_dir={tmp_path}"],
    )
    res = train(cfg)
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


def test_two_train_workers_equal_one_and_resume_a_sharded_checkpoint_with_two_or_one(tmp_path, ray_cluster):
    """Two data-parallel train actors (FSDP2 over gloo, samples split by tokens) compute the same
    first step as one: same rollouts (on-policy, per-sample seeds), so the same metrics (rtol 1e-5:
    a reordered fp32 reduction). The checkpoint of step 1 of the two-worker run (each worker wrote
    its FSDP2 shards, in the background while step 2 trained) resumes step 2 with two workers
    exactly as the uninterrupted run computed it (max_staleness 0), and with one worker
    (resharded 2 -> 1) up to the reduction order of two ranks (rtol 1e-5)."""
    import shutil

    base = TINY_STEP + ["backend=ray", "buffer.max_staleness=0", "checkpoint_every=1", "num_steps=2"]
    full = train(load_config(None, base + ["num_train_workers=2", f"output_dir={tmp_path / 'full'}"])).metrics
    one = train(load_config(None, base + ["num_train_workers=1", "checkpoint_every=0", "num_steps=1",
                                          f"output_dir={tmp_path / 'one'}"])).metrics
    keys = ("train/loss", "train/grad_norm", "train/mtp/mtp_1_loss", "train/mtp/mtp_1_acceptance_rate",
            "train/mtp/grad_norm")
    assert one[0]["train/num_valid_tokens"] == full[0]["train/num_valid_tokens"]
    for k in keys:
        assert full[0][k] == pytest.approx(one[0][k], rel=1e-5), k
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
    for k in (*keys, "train/num_valid_tokens", "train/reward"):
        assert resumed[2][k] == full[1][k], k
        assert resumed[1][k] == pytest.approx(full[1][k], rel=1e-5), k
