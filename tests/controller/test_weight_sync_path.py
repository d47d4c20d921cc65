"""Which way weights reach the generation engines (SingleController._open_weight_sync, issue 9):
the torch.distributed group when every member joins; Ray's object store — with a warning that
names the cause — only when the group cannot be built; a model mismatch is an error, not a
reason to fall back. Fake actors stand in for the workers."""

import asyncio
import logging

import pytest

from _configs import demo_config
from splitrl.controller.controller import SingleController
from splitrl.distributed.weight_sync import WeightLayout


class _Fake:
    """An actor whose methods are plain functions; a returned exception is raised."""

    def __init__(self, **methods):
        self.methods = methods
        self.calls = []

    async def call(self, method, *args):
        self.calls.append(method)
        out = self.methods[method](*args)
        if isinstance(out, BaseException):
            raise out
        return out


LAYOUT = WeightLayout(())


def _controller(tmp_path, placement="split", backend="ray", trainer=None, gens=None):
    ctl = SingleController(demo_config([f"cluster.backend={backend}", f"output_dir={tmp_path}"]))
    ctl.placement = placement
    ctl.train_actors = [
        trainer or _Fake(open_weight_sync=lambda *a: ("127.0.0.1", 1234), join_weight_sync=lambda *a: "gloo")
    ]
    ctl.gen_actors = gens or [_Fake(weight_layout=lambda: LAYOUT, join_weight_sync=lambda *a: "gloo") for _ in range(2)]
    return ctl


def test_group_when_every_member_joins(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    ctl = _controller(tmp_path)
    assert asyncio.run(ctl._open_weight_sync()) == "group"
    assert "2 generation worker(s) over a torch.distributed gloo group (127.0.0.1:1234)" in caplog.text


def test_object_store_when_the_trainer_cannot_listen(tmp_path, caplog):
    trainer = _Fake(open_weight_sync=lambda *a: OSError("Cannot assign requested address"))
    ctl = _controller(tmp_path, trainer=trainer)
    assert asyncio.run(ctl._open_weight_sync()) == "object_store"
    assert (
        "could not be built (OSError: Cannot assign requested address); falling back to Ray's object store"
        in caplog.text
    )


def test_object_store_when_a_worker_does_not_join_and_every_member_returned(tmp_path, caplog):
    ok = _Fake(weight_layout=lambda: LAYOUT, join_weight_sync=lambda *a: "gloo")
    late = _Fake(weight_layout=lambda: LAYOUT, join_weight_sync=lambda *a: TimeoutError("store timed out"))
    trainer = _Fake(open_weight_sync=lambda *a: ("127.0.0.1", 1), join_weight_sync=lambda *a: "gloo")
    ctl = _controller(tmp_path, trainer=trainer, gens=[ok, late])
    assert asyncio.run(ctl._open_weight_sync()) == "object_store"
    assert "TimeoutError: store timed out" in caplog.text
    assert trainer.calls == ["open_weight_sync", "join_weight_sync"]
    assert ok.calls == ["weight_layout", "join_weight_sync"] and late.calls == ["join_weight_sync"]


def test_a_model_mismatch_is_raised_not_fallen_back_from(tmp_path):
    trainer = _Fake(open_weight_sync=lambda *a: ValueError("weight sync: the trainer's tensors do not match"))
    ctl = _controller(tmp_path, trainer=trainer)
    with pytest.raises(ValueError, match="do not match"):
        asyncio.run(ctl._open_weight_sync())


@pytest.mark.parametrize(
    "placement, backend, want", [("colocated", "ray", "colocated"), ("colocated", "local", "in_process")]
)
def test_in_process_paths(tmp_path, placement, backend, want):
    ctl = _controller(tmp_path, placement=placement, backend=backend)
    assert asyncio.run(ctl._open_weight_sync()) == want
    assert ctl.train_actors[0].calls == []  # no group is built
