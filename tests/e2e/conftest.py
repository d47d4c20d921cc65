"""Fixtures of the end-to-end tests."""

import pytest
from _tiny import TINY_STEP


@pytest.fixture(scope="module")
def _ray_cluster_and_transferqueue():
    """One local Ray cluster for a test module, started as ``splitrl train`` starts it (loopback
    only, the same runtime env), and one TransferQueue on it (the run config's default data
    plane); each run of the module joins the cluster (the controller starts none when Ray is up)
    and attaches to that TransferQueue (a run starts one only where none is running; a run that
    starts its own is tested by test_ray_join.py, in a process of its own). Starting a cluster
    costs ~20 s on the 2-core CI machine and a TransferQueue ~9 s (three actors), so a module
    pays each once. Logical CPUs: those of 2 + 2 workers and of one TransferQueue (the module's;
    a run that attaches to it does not count its CPUs: splitrl.controller.launch)."""
    ray = pytest.importorskip("ray")
    from _configs import demo_config
    from splitrl.controller.controller import SingleController
    from splitrl.dataplane import make_data_plane

    if ray.is_initialized():
        ray.shutdown()
    cfg = demo_config(
        TINY_STEP + ["cluster.backend=ray", "cluster.num_generation_workers=2", "cluster.num_train_workers=2"]
    )
    SingleController(cfg)._start_cluster()
    plane = make_data_plane(cfg.dataplane)
    assert plane.owns_transferqueue
    yield ray, plane
    plane.close()
    ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_cluster_and_transferqueue):
    """The module's Ray cluster (yields the ``ray`` module); the runs' TransferQueue partition is
    emptied before and after each test, so that no test sees another's samples."""
    ray, plane = _ray_cluster_and_transferqueue
    plane.clear()
    yield ray
    plane.clear()
