"""The data-plane contract, run against every adapter, plus TransferQueue's multi-process use.

The TransferQueue cases start one local Ray cluster for this module (marked ``ray``; ~10 s to
start). ``-m "not ray"`` runs the in-process adapter only.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

import splitrl
from splitrl.dataplane import (
    DataPlaneConfig,
    InProcessDataPlane,
    TransferQueueConfig,
    TransferQueueDataPlane,
    make_data_plane,
)
from splitrl.dataplane.transferqueue import check_free_cpus

LENGTHS = [5, 1, 9, 0, 3]


def _make_samples(lengths: list[int], seed: int = 0) -> tuple[list[str], dict[str, list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    ids = [f"s{seed}-{i}" for i in range(len(lengths))]
    fields = {
        "input_ids": [torch.randint(0, 1000, (n,), generator=g) for n in lengths],
        "generation_logprobs": [-torch.rand(n, generator=g) for n in lengths],
        "token_mask": [torch.rand(n, generator=g) > 0.5 for n in lengths],
        "reward": [torch.rand((), generator=g) for _ in lengths],
    }
    return ids, fields


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        assert g.shape == w.shape
        assert g.device.type == "cpu"
        assert torch.equal(g, w)


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tq_plane():
    """One Ray cluster and one TransferQueue for the module; the module owns both."""
    import ray

    started_ray = not ray.is_initialized()
    if started_ray:
        # Ray workers must import splitrl (the plane is unpickled there) wherever the tests run from.
        src = str(Path(splitrl.__file__).resolve().parents[1])
        pythonpath = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
        ray.init(
            num_cpus=8,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "TQ_NUM_THREADS": "1"}},
        )
    plane = TransferQueueDataPlane(TransferQueueConfig(partition_id="test"))
    assert plane.owns_transferqueue == started_ray
    yield plane
    plane.close()
    if started_ray:
        ray.shutdown()


@pytest.fixture(params=["inprocess", pytest.param("transferqueue", marks=pytest.mark.ray)])
def plane(request):
    if request.param == "inprocess":
        p = InProcessDataPlane()
        yield p
        p.close()
    else:
        p = request.getfixturevalue("tq_plane")
        p.clear()
        yield p
        p.clear()


@pytest.fixture
def second_handle(plane):
    """Another handle of the kind under test that may be closed without harming ``plane``."""
    if isinstance(plane, InProcessDataPlane):
        return InProcessDataPlane()
    return TransferQueueDataPlane.connect(plane.config)


# ---- the contract, for every adapter ----------------------------------------------------------


def test_jagged_round_trip_keeps_values_dtypes_and_lengths(plane):
    ids, fields = _make_samples(LENGTHS)
    plane.put(ids, fields)
    got = plane.get(ids, list(fields))
    assert set(got) == set(fields)
    for name in fields:
        _assert_same(got[name], fields[name])
    assert [t.shape for t in got["input_ids"]] == [torch.Size([n]) for n in LENGTHS]
    assert got["reward"][0].dim() == 0


def test_get_follows_the_requested_order_and_subset(plane):
    ids, fields = _make_samples(LENGTHS)
    plane.put(ids, fields)
    order = [3, 0, 4, 2]
    got = plane.get([ids[i] for i in order], ["generation_logprobs", "input_ids"])
    _assert_same(got["input_ids"], [fields["input_ids"][i] for i in order])
    _assert_same(got["generation_logprobs"], [fields["generation_logprobs"][i] for i in order])


def test_get_returns_only_the_selected_fields(plane):
    ids, fields = _make_samples(LENGTHS)
    plane.put(ids, fields)
    got = plane.get(ids[:2], ["reward"])
    assert list(got) == ["reward"]
    _assert_same(got["reward"], fields["reward"][:2])


def test_single_sample_and_uniform_lengths(plane):
    ids, fields = _make_samples([4, 4, 4])
    plane.put(ids, fields)
    got = plane.get([ids[1]], ["input_ids", "reward"])
    _assert_same(got["input_ids"], [fields["input_ids"][1]])
    _assert_same(got["reward"], [fields["reward"][1]])
    _assert_same(plane.get(ids, ["token_mask"])["token_mask"], fields["token_mask"])


def test_trailing_dims_and_bfloat16(plane):
    topk = [torch.randn(n, 3) for n in (2, 5)]
    half = [torch.randn(n).to(torch.bfloat16) for n in (7, 1)]
    plane.put(["a", "b"], {"topk_logprobs": topk, "logits_bf16": half})
    got = plane.get(["a", "b"], ["topk_logprobs", "logits_bf16"])
    _assert_same(got["topk_logprobs"], topk)
    _assert_same(got["logits_bf16"], half)


def test_put_on_a_stored_id_adds_and_replaces_fields(plane):
    ids, fields = _make_samples([3, 6])
    plane.put(ids, fields)
    advantages = [torch.tensor(0.5), torch.tensor(-1.5)]
    plane.put(ids, {"advantages": advantages})
    new_ids = torch.arange(11)  # a different length than before
    plane.put([ids[1]], {"input_ids": [new_ids]})
    got = plane.get(ids, ["input_ids", "advantages", "generation_logprobs"])
    _assert_same(got["input_ids"], [fields["input_ids"][0], new_ids])
    _assert_same(got["advantages"], advantages)
    _assert_same(got["generation_logprobs"], fields["generation_logprobs"])


def test_a_field_may_differ_between_calls(plane):
    plane.put(["a"], {"v": [torch.tensor(2.0)]})
    plane.put(["b"], {"v": [torch.arange(3)]})
    _assert_same(plane.get(["b", "a"], ["v"])["v"], [torch.arange(3), torch.tensor(2.0)])


def test_stored_values_are_copies(plane):
    src = torch.arange(6)
    plane.put(["a"], {"input_ids": [src]})
    src.add_(100)
    first = plane.get(["a"], ["input_ids"])["input_ids"][0]
    first.add_(1000)
    _assert_same(plane.get(["a"], ["input_ids"])["input_ids"], [torch.arange(6)])


def test_detached_from_autograd(plane):
    x = torch.randn(4, requires_grad=True)
    plane.put(["a"], {"generation_logprobs": [x * 2]})
    (got,) = plane.get(["a"], ["generation_logprobs"])["generation_logprobs"]
    assert not got.requires_grad
    assert torch.equal(got, (x * 2).detach())


def test_delete_removes_only_those_ids(plane):
    ids, fields = _make_samples(LENGTHS)
    plane.put(ids, fields)
    plane.delete([ids[0], ids[2]])
    with pytest.raises(KeyError, match=ids[0]):
        plane.get([ids[0]], ["input_ids"])
    with pytest.raises(KeyError, match=ids[2]):
        plane.get([ids[1], ids[2]], ["input_ids"])
    rest = [1, 3, 4]
    got = plane.get([ids[i] for i in rest], ["input_ids"])
    _assert_same(got["input_ids"], [fields["input_ids"][i] for i in rest])


def test_delete_unknown_id_raises_and_deletes_nothing(plane):
    ids, fields = _make_samples([2, 3])
    plane.put(ids, fields)
    with pytest.raises(KeyError, match="nope"):
        plane.delete([ids[0], "nope"])
    _assert_same(plane.get(ids, ["input_ids"])["input_ids"], fields["input_ids"])


def test_clear_removes_everything_and_the_plane_stays_usable(plane):
    ids, fields = _make_samples(LENGTHS)
    plane.put(ids, fields)
    plane.clear()
    for sample_id in ids:
        with pytest.raises(KeyError, match=sample_id):
            plane.get([sample_id], ["reward"])
    plane.put(ids[:1], {"reward": fields["reward"][:1]})
    _assert_same(plane.get(ids[:1], ["reward"])["reward"], fields["reward"][:1])


def test_empty_calls(plane):
    plane.put([], {"input_ids": []})
    assert plane.get([], ["input_ids", "reward"]) == {"input_ids": [], "reward": []}
    plane.delete([])


def test_unknown_id_is_a_key_error_naming_it(plane):
    ids, fields = _make_samples([2])
    plane.put(ids, fields)
    with pytest.raises(KeyError, match="ghost"):
        plane.get([ids[0], "ghost"], ["input_ids"])


def test_unknown_field_is_a_key_error_naming_it(plane):
    ids, fields = _make_samples([2, 3])
    plane.put(ids, fields)
    with pytest.raises(KeyError, match="advantages"):
        plane.get(ids, ["input_ids", "advantages"])


def test_field_missing_on_some_ids_names_them(plane):
    ids, fields = _make_samples([2, 3, 4])
    plane.put(ids, fields)
    plane.put([ids[1]], {"advantages": [torch.tensor(1.0)]})
    with pytest.raises(KeyError) as err:
        plane.get(ids, ["advantages"])
    message = str(err.value)
    assert "advantages" in message and ids[0] in message and ids[2] in message and ids[1] not in message


@pytest.mark.parametrize(
    ("sample_ids", "fields", "match"),
    [
        (["a", "b"], {"x": [torch.zeros(2)]}, "1 tensor.*2 sample id"),
        (["a", "a"], {"x": [torch.zeros(2), torch.zeros(2)]}, "duplicate sample id"),
        (["a", "b"], {"x": [torch.zeros(2), torch.zeros(2, dtype=torch.int64)]}, "mixes tensor types"),
        (["a", "b"], {"x": [torch.zeros(2), torch.zeros(())]}, "mixes tensor types"),
        (["a", "b"], {"x": [torch.zeros(2, 3), torch.zeros(2, 4)]}, "mixes tensor types"),
        (["a"], {"x": [[1, 2]]}, "not a torch.Tensor"),
        (["a", "b"], {"x": torch.zeros(2, 3)}, "list with one tensor per sample"),
        (["a"], {}, "at least one field"),
        ("a", {"x": [torch.zeros(1)]}, "list of str"),
        ([1], {"x": [torch.zeros(1)]}, "must be str"),
    ],
)
def test_malformed_put_is_a_value_error_and_stores_nothing(plane, sample_ids, fields, match):
    with pytest.raises(ValueError, match=match):
        plane.put(sample_ids, fields)
    with pytest.raises(KeyError):
        plane.get(["a"], ["x"])


def test_malformed_get_and_delete_are_value_errors(plane):
    ids, fields = _make_samples([2, 3])
    plane.put(ids, fields)
    with pytest.raises(ValueError, match="duplicate sample id"):
        plane.get([ids[0], ids[0]], ["input_ids"])
    with pytest.raises(ValueError, match="duplicate field"):
        plane.get(ids, ["input_ids", "input_ids"])
    with pytest.raises(ValueError, match="at least one field"):
        plane.get(ids, [])
    with pytest.raises(ValueError, match="duplicate sample id"):
        plane.delete([ids[1], ids[1]])
    _assert_same(plane.get(ids, ["input_ids"])["input_ids"], fields["input_ids"])


def test_a_closed_handle_refuses_calls(plane, second_handle):
    second_handle.close()
    second_handle.close()  # idempotent
    assert second_handle.closed
    with pytest.raises(RuntimeError, match="closed"):
        second_handle.get(["a"], ["x"])
    with pytest.raises(RuntimeError, match="closed"):
        second_handle.put(["a"], {"x": [torch.zeros(1)]})
    # Closing another handle leaves the plane under test working.
    plane.put(["a"], {"x": [torch.ones(2)]})
    _assert_same(plane.get(["a"], ["x"])["x"], [torch.ones(2)])


# ---- in-process specifics ---------------------------------------------------------------------


def test_inprocess_refuses_to_be_pickled():
    with pytest.raises(TypeError, match="transferqueue"):
        pickle.dumps(InProcessDataPlane())


def test_factory_and_config():
    inprocess = make_data_plane(DataPlaneConfig(kind="inprocess"))
    assert isinstance(inprocess, InProcessDataPlane)
    inprocess.put(["a", "b"], {"x": [torch.zeros(1), torch.zeros(2)]})
    assert len(inprocess) == 2
    config = DataPlaneConfig.model_validate({"kind": "transferqueue", "transferqueue": {"partition_id": "p"}})
    assert config.transferqueue.partition_id == "p"
    assert config.transferqueue.num_storage_units == 2
    with pytest.raises(ValueError, match="extra"):
        DataPlaneConfig.model_validate({"kind": "inprocess", "typo": 1})
    with pytest.raises(ValueError, match="kind"):
        DataPlaneConfig.model_validate({"kind": "redis"})
    with pytest.raises(ValueError, match="num_storage_units"):
        TransferQueueConfig(num_storage_units=0)
    with pytest.raises(ValueError, match="partition_id"):
        TransferQueueConfig(partition_id="")


# ---- TransferQueue specifics --------------------------------------------------------------------


def test_too_few_ray_cpus_is_an_error_not_a_hang():
    config = TransferQueueConfig(num_storage_units=2)
    check_free_cpus(3.0, config)
    with pytest.raises(RuntimeError, match="needs 3 free logical Ray CPUs.*only 2 are free"):
        check_free_cpus(2.0, config)


def test_transferqueue_without_ray_says_to_init_it(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"ray.init"):
        TransferQueueDataPlane(TransferQueueConfig())
    with pytest.raises(RuntimeError, match=r"ray.init"):
        TransferQueueDataPlane.connect(TransferQueueConfig())


@pytest.mark.ray
def test_partitions_are_isolated(tq_plane):
    other = make_data_plane(DataPlaneConfig(transferqueue=TransferQueueConfig(partition_id="other")))
    assert isinstance(other, TransferQueueDataPlane) and not other.owns_transferqueue
    try:
        tq_plane.put(["a"], {"x": [torch.arange(2)]})
        other.put(["only-in-other"], {"x": [torch.arange(5)]})
        with pytest.raises(KeyError, match="only-in-other"):
            tq_plane.get(["only-in-other"], ["x"])
        _assert_same(other.get(["only-in-other"], ["x"])["x"], [torch.arange(5)])
        other.clear()
        _assert_same(tq_plane.get(["a"], ["x"])["x"], [torch.arange(2)])
    finally:
        other.close()
        tq_plane.clear()


@pytest.mark.ray
def test_caller_torch_threads_survive_transferqueue_calls(tq_plane):
    # transfer_queue sets torch's thread count around each (de)serialization and then restores its
    # own import-time value; that must not leak into a train worker that tuned its threads.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        tq_plane.put(["a"], {"x": [torch.arange(4)]})
        tq_plane.get(["a"], ["x"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        tq_plane.clear()


@pytest.mark.ray
def test_ray_actor_puts_and_the_driver_gets(tq_plane):
    import ray

    @ray.remote(num_cpus=1)
    class Generator:
        def __init__(self, plane):
            self.plane = plane  # unpickled here: attaches to the driver's TransferQueue

        def generate(self, n: int) -> list[str]:
            ids = [f"gen-{i}" for i in range(n)]
            lengths = [3 + 2 * i for i in range(n)]
            self.plane.put(
                ids,
                {
                    "input_ids": [torch.arange(k) * 7 for k in lengths],
                    "reward": [torch.tensor(float(i)) for i in range(n)],
                },
            )
            return ids

        def read(self, ids: list[str]) -> list[list[int]]:
            return [t.tolist() for t in self.plane.get(ids, ["input_ids"])["input_ids"]]

        def close(self) -> bool:
            owned = self.plane.owns_transferqueue
            self.plane.close()
            return owned

    try:
        actor = Generator.remote(tq_plane)
        ids = ray.get(actor.generate.remote(4))
        got = tq_plane.get(ids[::-1], ["input_ids", "reward"])
        _assert_same(got["input_ids"], [torch.arange(3 + 2 * i) * 7 for i in (3, 2, 1, 0)])
        _assert_same(got["reward"], [torch.tensor(float(i)) for i in (3, 2, 1, 0)])

        tq_plane.put(["from-driver"], {"input_ids": [torch.tensor([4, 5])]})
        assert ray.get(actor.read.remote(["from-driver"])) == [[4, 5]]

        # Closing the actor's attached copy must not shut TransferQueue down for the driver.
        assert ray.get(actor.close.remote()) is False
        _assert_same(tq_plane.get(["from-driver"], ["input_ids"])["input_ids"], [torch.tensor([4, 5])])
        ray.kill(actor)
    finally:
        tq_plane.clear()


@pytest.mark.ray
def test_ray_task_connects_explicitly(tq_plane):
    import ray

    @ray.remote(num_cpus=1)
    def read_lengths(config: TransferQueueConfig, ids: list[str]) -> list[int]:
        plane = TransferQueueDataPlane.connect(config)
        return [t.numel() for t in plane.get(ids, ["input_ids"])["input_ids"]]

    try:
        ids, fields = _make_samples(LENGTHS)
        tq_plane.put(ids, fields)
        assert ray.get(read_lengths.remote(tq_plane.config, ids)) == LENGTHS
    finally:
        tq_plane.clear()


@pytest.mark.ray
def test_a_pickled_copy_attaches_without_owning(tq_plane):
    try:
        tq_plane.put(["a"], {"x": [torch.arange(3)]})
        copy = pickle.loads(pickle.dumps(tq_plane))
        assert not copy.owns_transferqueue and copy.config == tq_plane.config
        _assert_same(copy.get(["a"], ["x"])["x"], [torch.arange(3)])
        copy.close()
        _assert_same(tq_plane.get(["a"], ["x"])["x"], [torch.arange(3)])
    finally:
        tq_plane.clear()


def test_handles_from_an_earlier_ray_session_are_forgotten(monkeypatch):
    import ray
    from transfer_queue import interface

    from splitrl.dataplane.transferqueue import _forget_stale_transferqueue

    class DeadActorMethod:
        def remote(self):
            raise RuntimeError("Can't find actor: it might be dead or from a different cluster")

    class DeadController:
        get_config = DeadActorMethod()

    class Client:
        closed = False

        def close(self):
            Client.closed = True

    monkeypatch.setattr(interface, "_TQ_CONTROLLER", DeadController())
    monkeypatch.setattr(interface, "_TQ_CLIENT", Client())
    monkeypatch.setattr(interface, "_TQ_STORAGE", {"SimpleStorage": {}})
    _forget_stale_transferqueue(ray)
    assert (interface._TQ_CONTROLLER, interface._TQ_CLIENT, interface._TQ_STORAGE) == (None, None, None)
    assert Client.closed
