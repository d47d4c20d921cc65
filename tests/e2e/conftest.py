"""Fixtures of the end-to-end tests."""

import pytest
from _tiny import TINY_STEP


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for a test module, started as ``splitrl train`` starts it (loopback
    only, the same runtime env and logical CPUs for 2 + 2 workers); each run of the module joins it
    (the controller starts none when Ray is up). Starting a cluster costs ~20 s on the 2-core CI
    machine, so a module pays it once."""
    ray = pytest.importorskip("ray")
    from _configs import demo_config
    from splitrl.controller.controller import SingleController

    if ray.is_initialized():
        ray.shutdown()
    cfg = demo_config(
        TINY_STEP + ["cluster.backend=ray", "cluster.num_generation_workers=2", "cluster.num_train_workers=2"]
    )
    SingleController(cfg)._start_cluster()
    yield ray
    ray.shutdown()
