"""End to end on a local Ray cluster with TransferQueue: generation and train workers are Ray
actors, token tensors travel through TransferQueue, the controller sees ids and rewards only."""

import sys
import time
from pathlib import Path

import pytest
from _tiny import TINY_STEP

from _configs import demo_config
from splitrl.controller.controller import train
from splitrl.logging import read_metrics
from splitrl.workers.generation import GenerationWorker

pytestmark = pytest.mark.ray


class _HeldGenerationWorker(GenerationWorker):
    """A generation worker that, after its call's first group, holds generation until the
    controller has started training (a file the driver writes), and records whether it did
    (a line per call: True, or False after waiting 120 s in vain)."""

    signal_dir: str = ""

    def _finished_groups(self, prompt_indices, group_size, metrics):
        held = False
        for item in super()._finished_groups(prompt_indices, group_size, metrics):
            yield item
            if not held:
                held = True
                started = Path(self.signal_dir) / "training_started"
                deadline = time.monotonic() + 120  # generous: a loaded machine starts training late
                while not started.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                with open(Path(self.signal_dir) / "waited", "a") as f:  # one line per generation call
                    f.write(f"{started.exists()}\n")


def test_three_steps_on_ray_and_transferqueue_with_groups_streamed_into_training(tmp_path, ray_cluster, monkeypatch):
    """Three steps; and a Ray generation worker streams each group as it finishes (a Ray
    streaming call), so the first chunk trains while the call that generates the whole step is
    still running. Measured on 2 H200s before streaming: async at max_staleness 0 ran exactly as
    fast as schedule=sync (1.00x), because a Ray worker returned its groups only with the call.
    Without streaming the held worker below waits in vain (120 s) and records False."""
    import ray.cloudpickle

    from splitrl.controller import launch as controller_mod  # where the workers are started
    from splitrl.controller.policy_client import PolicyClient

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class travels by value
    monkeypatch.setattr(_HeldGenerationWorker, "signal_dir", str(tmp_path))
    monkeypatch.setattr(controller_mod, "GenerationWorker", _HeldGenerationWorker)
    real_train = PolicyClient.train_chunk

    async def train_chunk(self, groups):
        (tmp_path / "training_started").touch()
        return await real_train(self, groups)

    monkeypatch.setattr(PolicyClient, "train_chunk", train_chunk)
    cfg = demo_config(
        TINY_STEP
        + [
            "cluster.backend=ray",
            "cluster.placement=split",
            "dataplane.kind=transferqueue",
            "schedule.num_steps=3",
            "checkpoint.every=0",
            "schedule.generation_groups_per_call=4",
            "schedule.min_groups_per_chunk=1",
            "buffer.max_staleness=1",
            f"output_dir={tmp_path}",
        ],
    )
    res = train(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/mtp/mtp_1_loss",
        "train/mtp/mtp_1_acceptance_rate",
        "train/mtp/grad_norm",
        "train/reward",
        "timing/generation_s",
        "timing/weight_sync_s",
    ):
        assert key in rows[-1], key
    for r, m in zip(rows, res.metrics):
        # what the logger wrote is what the train workers computed and the policy client returned
        assert r["train/mtp/mtp_1_loss"] == pytest.approx(m["train/mtp/mtp_1_loss"], rel=1e-12)
        assert r["train/num_valid_samples"] == 16
        assert 0.0 < r["train/mtp/mtp_1_loss"] < 10.0
    assert res.steps_done == 3
    assert (tmp_path / "checkpoints" / "step_000003" / "COMPLETE").exists()
    waited = (tmp_path / "waited").read_text().split()
    assert waited and all(w == "True" for w in waited), waited


def test_two_train_workers_equal_one_and_resume_a_sharded_checkpoint_with_two_or_one(tmp_path, ray_cluster):
    """Two data-parallel train actors (FSDP2 over gloo, samples split by tokens) compute the same
    first step as one: same rollouts (on-policy, per-sample seeds), so the same metrics (rtol 1e-5:
    a reordered fp32 reduction). The checkpoint of step 1 of the two-worker run (each worker wrote
    its FSDP2 shards, in the background while step 2 trained) resumes step 2 with two workers
    exactly as the uninterrupted run computed it (max_staleness 0), and with one worker
    (resharded 2 -> 1) up to the reduction order of two ranks (rtol 1e-5). The one-worker runs use
    the local backend: the same trainer in this process, without two more actors to start."""
    import shutil

    base = TINY_STEP + ["cluster.backend=ray", "buffer.max_staleness=0", "checkpoint.every=1", "schedule.num_steps=2"]
    full = train(demo_config(base + ["cluster.num_train_workers=2", f"output_dir={tmp_path / 'full'}"])).metrics
    one = train(
        demo_config(
            base
            + [
                "cluster.backend=local",  # one train worker in this process: the same math, no actors to start
                "checkpoint.every=0",
                "schedule.num_steps=1",
                f"output_dir={tmp_path / 'one'}",
            ]
        )
    ).metrics
    keys = (
        "train/loss",
        "train/grad_norm",
        "train/mtp/mtp_1_loss",
        "train/mtp/mtp_1_acceptance_rate",
        "train/mtp/grad_norm",
    )
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
        workers = "cluster.num_train_workers=2" if n == 2 else "cluster.backend=local"
        res = train(demo_config(base + [workers, f"output_dir={out}"]))
        assert res.steps_done == 2 and len(res.metrics) == 1
        resumed[n] = res.metrics[0]
    for k in (*keys, "train/num_valid_tokens", "train/reward"):
        assert resumed[2][k] == full[1][k], k
        assert resumed[1][k] == pytest.approx(full[1][k], rel=1e-5), k


def test_the_local_clusters_workers_run_at_the_drivers_priority(ray_cluster):
    """Ray starts workers at niceness 15 unless told otherwise: on a busy machine they starved
    (the CPU demo's start-up took over 10 minutes under two busy loops). The cluster splitrl
    starts runs them at the driver's niceness."""
    import os

    @ray_cluster.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray_cluster.get(niceness.remote(), timeout=120) == os.nice(0)
    assert "RAY_worker_niceness" not in os.environ  # set only while the raylet started
