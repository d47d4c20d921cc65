"""Sharded, asynchronous checkpoints of a train worker's model and optimizer (issue 9, item 3).

Every data-parallel rank writes its own shards with ``torch.distributed.checkpoint`` (DCP):
FSDP2 parameters and optimizer moments as DTensors (each rank its local shard), or plain tensors
with one rank and no process group. The directory ``trainer/`` then holds ``.metadata`` and one
``__{rank}_0.distcp`` per rank; the metadata records every tensor's global shape, so a checkpoint
written by R ranks loads into any other number of ranks (DCP reads the slices each rank now owns).
The small state beside it (LR schedule, loss scaler, step counters) is identical on every rank;
rank 0 writes it to ``trainer_state.pt``.

Saving is asynchronous: the call returns once the tensors are copied into CPU memory (the
staging copy, into buffers kept from one checkpoint to the next: pinned memory on CUDA); a
background thread writes the files. Training may change the live tensors right after the call
returns. The caller must wait for one save (:meth:`ShardedCheckpointer.wait`) before the next
one reuses the staging buffers, and must not trust the files before then.

The background writer meets the other ranks in collectives (the save plan, the final metadata)
on a gloo group of its own: the training thread's collectives run on the default group at the
same time, and two threads must not interleave collectives on one group; async save also needs a
CPU backend.
"""

from __future__ import annotations

import math
import time
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from splitrl.distributed import utils as du

# one process without a process group is a supported case here (no_dist=True), not a mistake
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized", category=UserWarning
)

SHARDS_DIR = "trainer"
TRAINER_STATE = "trainer_state.pt"


_ALIGN = 64  # bytes: every tensor carved from the flat buffer starts on this boundary


def _layout(obj: Any, path: str = "") -> list[tuple]:
    """Every tensor of a (nested) state dict as (path, local shape, dtype, is a DTensor): when it
    changes (e.g. the optimizer's moments appear after the first step) the kept staging buffers
    no longer fit."""
    if isinstance(obj, torch.Tensor):
        dtensor = hasattr(obj, "to_local")
        local = obj.to_local() if dtensor else obj
        return [(path, tuple(local.shape), local.dtype, dtensor)]
    if isinstance(obj, dict):
        return [x for k in sorted(obj, key=str) for x in _layout(obj[k], f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _layout(v, f"{path}/{i}")]
    return []


def _aligned_nbytes(numel: int, dtype: torch.dtype) -> int:
    return -(-numel * dtype.itemsize // _ALIGN) * _ALIGN


def _flat_buffers(state_dict: dict[str, Any], layout: list[tuple], pin: bool) -> dict[str, Any]:
    """CPU tensors shaped like every tensor of ``state_dict`` (whose :func:`_layout` is
    ``layout``), carved out of one allocation (one pinned allocation instead of one per tensor,
    which made the first save block far longer: bench/RESULTS.md). Non-tensor values are copied
    through. DCP's writer clones a view before writing it, so each tensor's file holds its own
    bytes only."""
    total = sum(_aligned_nbytes(math.prod(shape), dtype) for _, shape, dtype, _ in layout)
    flat = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    offset = 0

    def carve(obj):
        nonlocal offset
        if isinstance(obj, torch.Tensor):
            view = flat[offset : offset + obj.numel() * obj.element_size()].view(obj.dtype).view(obj.shape)
            offset += _aligned_nbytes(obj.numel(), obj.dtype)
            return view
        if isinstance(obj, dict):
            return {k: carve(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(carve(v) for v in obj)
        return obj

    return carve(state_dict)


class _KeptStager:
    """A DCP async stager whose CPU buffers outlive one save.

    The first save allocates them (pinned on CUDA: 5 s for the 0.6 B model's 7.5 GB of model +
    optimizer state), later saves copy into them, so a checkpoint blocks training for the copy
    only; they are allocated again when the state's layout changes (:func:`_layout`).
    ``DefaultStager`` does not fit: ``dcp.async_save`` of torch 2.11 empties its copy tables when
    a save ends, and the next save with it fails inside staging (``KeyError: <class 'type'>``,
    seen on the H200 even with DCP's ``close`` ignored). ``BlockingAsyncStager`` keeps its cache
    but always pins it, which CPU-only builds cannot. So this class does what that one does, with
    DCP's own state-dict copy helpers (``torch.distributed._state_dict_utils``, which those
    stagers use; DTensor shards are copied as local shards). :meth:`release` frees the buffers.
    """

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._buffers: dict[str, Any] | None = None
        self._layout: list[tuple] | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # staging is done when stage() returns

    def stage(self, state_dict, **kwargs):
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)
        if self._buffers is None or layout != self._layout:
            self._buffers = None  # the old buffers go before the new ones are allocated
            if any(dtensor for *_, dtensor in layout):
                self._buffers = _create_cpu_state_dict(state_dict, pin_memory=self._pin)
            else:
                self._buffers = _flat_buffers(state_dict, layout, self._pin)
            self._layout = layout
        # scalars (step counters, learning rates) come from state_dict, tensors land in the buffers
        return _copy_state_dict(state_dict, self._buffers, non_blocking=False)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass  # DCP calls this after each save; the buffers are for the next one

    def release(self) -> None:
        self._buffers = None
        self._layout = None


@contextmanager
def _plain_errors(shards: Path | None = None):
    """Re-raise DCP's ``CheckpointException`` (a ``BaseException`` holding each failed rank's
    error) as the lowest failed rank's own exception: an ``OSError`` for a full disk, a
    ``RuntimeError`` for a truncated file, which callers catch as any other write/read error.

    A write that failed in the operating system surfaces through ``torch.save`` as
    ``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos`` with the
    ``OSError`` only as its context; that ``OSError`` is raised instead (its errno and words:
    "No space left on device"), named after this rank's files in ``shards`` (the directory
    being written) when it names no file itself.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = e.failures
        first = failures[min(failures)] if failures else None
        cause = first[0] if isinstance(first, tuple) else first
        if isinstance(cause, Exception):
            os_error = os_error_in(cause)
            if os_error is not None:
                raise _named(os_error, shards) from None
            raise cause from None
        raise RuntimeError(str(e)) from None


def os_error_in(e: BaseException | None) -> OSError | None:
    """The first ``OSError`` in ``e``'s chain (itself, its causes and contexts), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _named(e: OSError, shards: Path | None) -> OSError:
    """``e`` with a file name: its own, else this rank's DCP files in ``shards``
    (``__{rank}_{i}.distcp``), else ``shards`` itself."""
    if e.filename is not None or shards is None or e.errno is None:
        return e
    mine = sorted(shards.glob(f"__{du.rank()}_*")) if shards.is_dir() else []
    name = ", ".join(str(f) for f in mine) if mine else str(shards)
    return OSError(e.errno, e.strerror, name)


class ShardedCheckpointer:
    """Writes and reads a model + optimizer as DCP shards of this rank (see the module docstring).

    Args:
        model: the (possibly FSDP2-sharded) policy.
        optimizer: its optimizer (parameter names, not ids, key the saved state).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # imported here, at start-up, rather than inside the first save (about 2 s on a busy CPU)
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.staging  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401

        self.model = model
        self.optimizer = optimizer
        self._future: Future | None = None
        self._writing: Path | None = None  # the shard directory of the pending save
        self._stager = None
        self._group = None  # the writer's gloo group (data parallelism only)

    # ---------------------------------------------------------------------------- helpers
    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # sharded (full_state_dict=False): each rank's DTensor shards, on their device
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=False))
        return {"model": model_sd, "optimizer": optim_sd}

    def _dist_kwargs(self) -> dict[str, Any]:
        if not du.is_distributed():
            return {"no_dist": True}
        if self._group is None:
            # collective: every rank reaches its first save/load together
            self._group = dist.new_group(backend="gloo")
        return {"process_group": self._group}

    # ---------------------------------------------------------------------------- saving
    def save(self, directory: str | Path, extra: dict[str, Any], *, blocking: bool = False) -> float:
        """Start writing this rank's shards into ``directory/trainer/`` (collective).

        Args:
            directory: the checkpoint directory (shared by all ranks; created if missing).
            extra: small picklable state identical on every rank; rank 0 writes it to
                ``directory/trainer_state.pt`` before returning.
            blocking: wait for the files as well (the last checkpoint of a run).

        Returns:
            the seconds this call blocked the caller (the staging copy, plus the write when
            ``blocking``).

        Raises:
            RuntimeError: the previous save has not been waited for (:meth:`wait`); its staging
                buffers are still being written.
        """
        import torch.distributed.checkpoint as dcp

        if self._future is not None:
            raise RuntimeError("a checkpoint is still being written; call wait() before the next save")
        t0 = time.perf_counter()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if du.rank() == 0:
            torch.save(extra, directory / TRAINER_STATE)
        kwargs = self._dist_kwargs()
        if self._stager is None:
            self._stager = _KeptStager(pin=next(self.model.parameters()).is_cuda)
        self._writing = directory / SHARDS_DIR
        with _plain_errors(self._writing):
            self._future = dcp.async_save(
                self._state(), checkpoint_id=str(self._writing), async_stager=self._stager, **kwargs
            )
        if blocking:
            self.wait()
        return time.perf_counter() - t0

    def done(self) -> bool:
        """Whether the files of the last save are written (True when none is pending).

        Raises:
            Exception: the background write failed (e.g. ``OSError`` for a full disk); the
                save is then no longer pending.
        """
        if self._future is None:
            return True
        if not self._future.done():
            return False
        self.wait()
        return True

    def wait(self) -> None:
        """Block until the last save's files are written (no-op when none is pending).

        Raises:
            Exception: the background write's error (an ``OSError`` naming the file and the
                operating system's words when it failed there, e.g. ENOSPC).
        """
        future, self._future = self._future, None
        if future is not None:
            with _plain_errors(self._writing):
                future.result()

    # ---------------------------------------------------------------------------- loading
    def load(self, directory: str | Path) -> dict[str, Any]:
        """Load ``directory/trainer/`` into the model and optimizer, resharded to this run's
        ranks (collective), and return the ``extra`` state saved with it.

        Raises:
            FileNotFoundError: ``directory`` holds no sharded trainer state.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        directory = Path(directory)
        if not (directory / SHARDS_DIR / ".metadata").is_file():
            raise FileNotFoundError(f"{directory} holds no sharded trainer state ({SHARDS_DIR}/.metadata)")
        self.wait()
        # the optimizer's state is created (zero moments) by get_state_dict, then filled in place
        state = self._state()
        with _plain_errors():
            dcp.load(state, checkpoint_id=str(directory / SHARDS_DIR), **self._dist_kwargs())
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=False),
        )
        return torch.load(directory / TRAINER_STATE, weights_only=False)

    def close(self) -> None:
        """Finish a pending write and free the staging buffers."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.release()
                self._stager = None
