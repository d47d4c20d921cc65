"""TransferQueue data plane: samples live in TransferQueue storage actors on the Ray cluster.

TransferQueue (``transferqueue`` on PyPI, imported as ``transfer_queue``) runs one controller
actor (ids and metadata) and ``num_storage_units`` SimpleStorage actors (the tensors); processes
talk to them over ZMQ, so bulk tensors go straight from the producer to a storage unit and from
there to the consumer, never through the splitrl controller. There is one TransferQueue per Ray
cluster; data planes with different ``partition_id`` values share it but never see each other's
samples.

Lifecycle:

1. The driver (or the splitrl controller actor) calls ``ray.init(...)`` with enough logical CPUs:
   TransferQueue's actors ask for 1 CPU each and otherwise wait forever (the check below turns that
   into an error). Logical CPUs may exceed the physical cores, e.g. ``ray.init(num_cpus=8)``.
2. ``TransferQueueDataPlane(config)`` starts the controller and storage units, or attaches when
   they are already running (the running system's storage settings then win). The process that
   started them owns them: they die when it calls ``close()`` or exits.
3. Other processes attach. The adapter is picklable: pass it to a Ray actor or task, and the copy
   attaches to the running TransferQueue when unpickled. ``TransferQueueDataPlane.connect(config)``
   does the same explicitly. ``close()`` on an attached copy only closes that copy.

TransferQueue returns a field of several samples as a jagged NestedTensor (dense when every sample
holds a 0-d tensor); ``get`` turns it back into one tensor per sample.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

import torch

from splitrl.dataplane.base import DataPlane, missing_field_error, unknown_ids_error
from splitrl.dataplane.config import TransferQueueConfig  # noqa: F401 - defined there, torch-free

# Name and namespace under which transfer_queue registers its controller actor (interface.py).
_TQ_CONTROLLER_NAME = "TransferQueueController"
_TQ_NAMESPACE = "transfer_queue"
# How long a live TransferQueue controller may take to answer a config request.
_LIVENESS_TIMEOUT_S = 30.0


class TransferQueueDataPlane(DataPlane):
    """:class:`~splitrl.dataplane.base.DataPlane` on TransferQueue (SimpleStorage backend).

    Creating one starts TransferQueue on the current Ray cluster, or attaches to the one already
    running. See the module docstring for how other processes attach.

    A ``put`` that the backend rejects (storage full) raises ``RuntimeError`` and may leave the ids
    registered without those fields: ``get`` then raises ``KeyError`` for the field; ``delete`` the
    ids or ``put`` them again.

    Raises (constructor):
        RuntimeError: Ray is not initialized in this process, or it has fewer free logical CPUs
            than TransferQueue's actors need (``1 + num_storage_units``).
    """

    def __init__(self, config: TransferQueueConfig | None = None) -> None:
        super().__init__()
        self._config = config if config is not None else TransferQueueConfig()
        self._owner = _start_or_attach(self._config)

    @classmethod
    def connect(cls, config: TransferQueueConfig | None = None) -> TransferQueueDataPlane:
        """Attach to the TransferQueue already running on this Ray cluster; never starts one.

        Raises:
            RuntimeError: Ray is not initialized, or no TransferQueue is running.
        """
        plane = cls.__new__(cls)
        DataPlane.__init__(plane)
        plane._config = config if config is not None else TransferQueueConfig()
        _attach(plane._config)
        plane._owner = False
        return plane

    @property
    def config(self) -> TransferQueueConfig:
        return self._config

    @property
    def owns_transferqueue(self) -> bool:
        """True when this object started TransferQueue (its ``close`` then shuts it down)."""
        return self._owner

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The copy attaches in the receiving process and never owns the actors.
        return (TransferQueueDataPlane.connect, (self._config,))

    # ---- adapter hooks ----------------------------------------------------------------------

    def _put(self, sample_ids: list[str], fields: dict[str, list[torch.Tensor]]) -> None:
        from tensordict import TensorDict

        tq = _import_tq()
        batch = TensorDict(
            {name: _to_batched(values) for name, values in fields.items()},
            batch_size=[len(sample_ids)],
        )
        tq.kv_batch_put(keys=sample_ids, partition_id=self._config.partition_id, fields=batch)

    def _get(self, sample_ids: list[str], fields: list[str]) -> dict[str, list[torch.Tensor]]:
        client = _import_tq().get_client()
        meta = self._retrieve_meta(client, sample_ids)
        stored = list(meta.field_names)
        for name in fields:
            if name not in stored:
                raise missing_field_error(name, self._ids_lacking(client, sample_ids, name), stored)
        batch = client.get_data(meta.select_fields(fields))
        return {name: _unbatch(batch[name], len(sample_ids)) for name in fields}

    def _delete(self, sample_ids: list[str]) -> None:
        client = _import_tq().get_client()
        meta = self._retrieve_meta(client, sample_ids)
        client.clear_samples(meta)

    def _clear(self) -> None:
        _import_tq().get_client().clear_partition(self._config.partition_id)

    def _close(self) -> None:
        if self._owner:
            _import_tq().close()

    # ---- helpers ----------------------------------------------------------------------------

    def _retrieve_meta(self, client: Any, sample_ids: list[str]) -> Any:
        """TransferQueue's BatchMeta of the ids, in their order; KeyError naming unknown ids."""
        meta = client.kv_retrieve_meta(keys=sample_ids, partition_id=self._config.partition_id, create=False)
        if meta.size != len(sample_ids):
            # TransferQueue silently drops unknown keys from the meta; name them.
            known: set[str] = set()
            if meta.size:
                known = set(client.kv_retrieve_keys(list(meta.global_indexes), self._config.partition_id))
            raise unknown_ids_error([i for i in sample_ids if i not in known])
        return meta

    def _ids_lacking(self, client: Any, sample_ids: list[str], name: str) -> list[str]:
        """The ids among ``sample_ids`` that do not store field ``name`` (error path only)."""
        lacking = []
        for sample_id in sample_ids:
            meta = client.kv_retrieve_meta(keys=[sample_id], partition_id=self._config.partition_id)
            if name not in meta.field_names:
                lacking.append(sample_id)
        return lacking


# ---- TransferQueue plumbing ------------------------------------------------------------------


def _import_tq() -> ModuleType:
    """Import transfer_queue lazily: it pulls in Ray, ZMQ and tensordict, which the in-process
    adapter does not need."""
    # TransferQueue caps torch's threads at TQ_NUM_THREADS (default 8) while it (de)serializes and
    # warns on every call when that exceeds the physical cores; default it to what the machine has.
    if "TQ_NUM_THREADS" not in os.environ:
        import psutil

        os.environ["TQ_NUM_THREADS"] = str(min(8, psutil.cpu_count(logical=False) or 1))
    import transfer_queue

    return transfer_queue


def _require_ray() -> Any:
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            "TransferQueueDataPlane needs a running Ray cluster: call ray.init(num_cpus=8) (logical CPUs "
            "may exceed the physical cores) or connect to a cluster before creating the data plane."
        )
    return ray


def _controller_running(ray: Any) -> bool:
    try:
        ray.get_actor(_TQ_CONTROLLER_NAME, namespace=_TQ_NAMESPACE)
    except ValueError:
        return False
    return True


def cpus_to_start(config: TransferQueueConfig) -> int:
    """Logical Ray CPUs that creating a :class:`TransferQueueDataPlane` from ``config`` will take
    now: its actors' (``config.num_actor_cpus``), or 0 when a TransferQueue already runs on this
    Ray cluster (the data plane attaches to it; without ``ray.init`` none can be running)."""
    import ray

    if not ray.is_initialized():
        return config.num_actor_cpus
    _forget_stale_transferqueue(ray)
    return 0 if _controller_running(ray) else config.num_actor_cpus


def _start_or_attach(config: TransferQueueConfig) -> bool:
    """Start TransferQueue, or attach to the running one; True when this call started it."""
    ray = _require_ray()
    _forget_stale_transferqueue(ray)
    if _controller_running(ray):
        _attach(config)
        return False
    check_free_cpus(ray.available_resources().get("CPU", 0.0), config)
    from omegaconf import OmegaConf

    tq = _import_tq()
    conf = OmegaConf.create(
        {
            "backend": {
                "storage_backend": "SimpleStorage",
                "SimpleStorage": {
                    "num_data_storage_units": config.num_storage_units,
                    "total_storage_size": config.storage_capacity,
                },
            }
        }
    )
    tq.init(conf)
    return True


def _attach(config: TransferQueueConfig) -> None:
    ray = _require_ray()
    _forget_stale_transferqueue(ray)
    if not _controller_running(ray):
        raise RuntimeError(
            "No TransferQueue is running on this Ray cluster. Create TransferQueueDataPlane(config) in the "
            "driver (or controller) first, then pass it, or its config, to the other processes."
        )
    _import_tq().init()  # with a running controller this only creates this process's client


def _forget_stale_transferqueue(ray: Any) -> None:
    """Drop transfer_queue's process-wide handles when they point into an earlier Ray session.

    After ``ray.shutdown()`` without ``close()`` (a crashed run, a test module), transfer_queue still
    holds its old controller, storage and client, and ``tq.init`` would talk to dead actors instead
    of starting or attaching afresh. transfer_queue has no public reset, hence the private globals.
    """
    if "transfer_queue" not in sys.modules:
        return
    from transfer_queue import interface

    held = interface._TQ_CONTROLLER
    if held is None:
        return
    try:
        ray.get(held.get_config.remote(), timeout=_LIVENESS_TIMEOUT_S)
        return
    except Exception:  # noqa: BLE001 - any failure means the handle is unusable
        pass
    if interface._TQ_CLIENT is not None:
        try:
            interface._TQ_CLIENT.close()
        except Exception:  # noqa: BLE001 - its sockets point at dead actors; nothing to save
            pass
    interface._TQ_CLIENT = None
    interface._TQ_STORAGE = None
    interface._TQ_CONTROLLER = None


def check_free_cpus(free_cpus: float, config: TransferQueueConfig) -> None:
    """Raise ``RuntimeError`` when Ray lacks the logical CPUs TransferQueue's actors ask for,
    instead of letting their creation wait forever."""
    if free_cpus < config.num_actor_cpus:
        raise RuntimeError(
            f"TransferQueue needs {config.num_actor_cpus} free logical Ray CPUs (1 controller + "
            f"{config.num_storage_units} storage units) but only {free_cpus:g} are free. Start Ray with "
            "more, e.g. ray.init(num_cpus=8) (logical CPUs may exceed the physical cores), or lower "
            "num_storage_units."
        )


def _to_batched(values: list[torch.Tensor]) -> torch.Tensor:
    """One field of B samples as TransferQueue wants it: a dense [B] tensor when every sample holds
    a 0-d tensor, else a jagged NestedTensor [B, j, ...] (no padding goes on the wire)."""
    values = [t.detach().cpu() for t in values]
    if values[0].dim() == 0:
        return torch.stack(values)
    return torch.nested.as_nested_tensor(values, layout=torch.jagged)


def _unbatch(value: Any, num_samples: int) -> list[torch.Tensor]:
    """Inverse of :func:`_to_batched`: one tensor per sample, with its stored shape and dtype."""
    if isinstance(value, torch.Tensor):
        tensors = list(value.unbind(0))
    else:
        # Samples put by different calls with different types come back as a NonTensorStack of
        # per-sample tensors, which may share memory with ZMQ frames: copy them.
        tensors = [torch.as_tensor(t).clone() for t in value.tolist()]
    assert len(tensors) == num_samples, (len(tensors), num_samples)
    return tensors
