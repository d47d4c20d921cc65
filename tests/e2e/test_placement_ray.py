"""Placement on a local Ray cluster, CPU (issue 9): ``split`` (1 train rank and 2 generation
actors, weights through the torch.distributed gloo group) and ``colocated`` (2 actors, each
hosting a train rank — FSDP2 over gloo — and its generation engine, weights staged on the
device inside the process). Each run finishes, took the intended sync
path (not the object-store fallback), and at the end every generation engine holds exactly the
trainer's weights, MTP heads included, at the final policy version (tolerance: exact, fp32).
"""

import logging

import pytest
import torch
from _tiny import TINY_STEP

from _configs import demo_config
from splitrl.controller.controller import SingleController
from splitrl.models import PolicyModel

pytestmark = pytest.mark.ray


class _Probe(SingleController):
    """Reads the engines' and the trainer's weights just before the workers are killed."""

    def _shutdown(self) -> None:
        import ray

        self.gen_weights = ray.get([a.submit("weights") for a in self.gen_actors])
        outs = ray.get([t.submit("policy_state_dict", True) for t in self.train_actors])  # collective
        self.trainer_weights = outs[0]
        super()._shutdown()


def _run(tmp_path, overrides):
    import asyncio

    cfg = demo_config(
        TINY_STEP
        + ["cluster.backend=ray", "schedule.num_steps=2", "checkpoint.every=0", f"output_dir={tmp_path}", *overrides]
    )
    ctl = _Probe(cfg)
    res = asyncio.run(ctl.run())
    assert res.steps_done == 2
    return cfg, ctl, res


def _check_engines_equal_trainer(cfg, ctl, res):
    want = ctl.trainer_weights
    assert any(k.startswith("mtp.") for k in want)
    initial = PolicyModel.from_config(cfg.model).state_dict()
    # two steps moved the MTP heads and the backbone: equality below is not two initial copies
    assert not torch.equal(want["mtp.depths.0.fc.weight"], initial["mtp.depths.0.fc.weight"])
    assert not torch.equal(
        want["backbone.model.layers.0.mlp.up_proj.weight"], initial["backbone.model.layers.0.mlp.up_proj.weight"]
    )
    assert len(ctl.gen_weights) == cfg.cluster.num_generation_workers
    for got, version in ctl.gen_weights:
        assert version == 2
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    for m in res.metrics:
        assert m["timing/weight_sync_s"] > 0.0


def test_split_placement_syncs_through_the_gloo_group(tmp_path, caplog, ray_cluster):
    caplog.set_level(logging.INFO, logger="splitrl.controller.controller")
    cfg, ctl, res = _run(tmp_path, ["cluster.placement=split", "cluster.num_generation_workers=2"])
    assert ctl.placement == "split" and ctl.sync_path == "group"
    assert "over a torch.distributed gloo group" in caplog.text
    _check_engines_equal_trainer(cfg, ctl, res)


def test_colocated_placement_copies_inside_the_process(tmp_path, caplog, ray_cluster):
    caplog.set_level(logging.INFO, logger="splitrl.controller.controller")
    # two ranks: each actor's copy gathers the FSDP2 shards tensor by tensor
    cfg, ctl, res = _run(
        tmp_path, ["cluster.placement=colocated", "cluster.num_train_workers=2", "cluster.num_generation_workers=2"]
    )
    assert ctl.placement == "colocated" and ctl.sync_path == "colocated"
    assert "on-device copy inside each colocated worker" in caplog.text
    _check_engines_equal_trainer(cfg, ctl, res)
