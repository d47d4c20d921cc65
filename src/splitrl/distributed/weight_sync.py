"""Weight sync from the trainer to generation engines without Ray's object store (issue 9).

Two ways, both copying into the engine's tensors in place (captured CUDA graphs keep reading
them) and both carrying the MTP tensors with the rest of the state dict:

- **colocated** (trainer and engine in one process): :func:`stage_weights` copies the trainer's
  tensors one by one on the device into a staging buffer; with FSDP2 each tensor is all-gathered
  first (``DTensor.full_tensor``), so the full fp32 model is never materialized.
- **split** (engines in other processes, on other GPUs): a :class:`WeightSyncGroup` — a
  torch.distributed group of its own whose rank 0 is train rank 0 and whose ranks 1..G are the
  generation workers — carries the weights in flat byte buckets (:func:`send_weights` /
  :func:`receive_weights`); NCCL on GPU, gloo on CPU. The receiver stages the buckets in a buffer
  of its own while its engine keeps generating, and copies them into the engine between two
  generation calls (:func:`apply_staged`): generation stops for that on-device copy only. The
  colocated path stages the same way, so the trainer need not wait for a generation call to end.

The group is a backend object built directly from its own ``TCPStore`` (``ProcessGroupNCCL`` /
``ProcessGroupGloo``, public classes in torch 2.11 and 2.13): train rank 0 already belongs to the
train ranks' default group, which cannot be extended to processes of another world, and the
generation workers have no default group at all.

Layout. The receiver's tensors define what travels: a :class:`WeightLayout` lists the engine's
distinct tensors (tied ones, e.g. a tied embedding and output head, travel once) sorted by name,
with their shapes and the engine's dtypes. The trainer walks its own tensors in the same order
(the same architecture gives the same names), casts each to the layout's dtype and packs it into
the current bucket: a bucket holds consecutive tensors up to ``bucket_bytes`` (one larger tensor
goes alone), each at a 16-byte aligned offset so that its bytes can be viewed in its dtype.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 * 2**20
_ALIGN = 16


@dataclass(frozen=True)
class TensorSlot:
    """One distinct tensor of the layout.

    Attributes:
        names: every state-dict name that holds this tensor (more than one when tied), sorted.
        shape: its shape.
        dtype: its dtype on the receiver, as ``str(torch.dtype)`` (e.g. ``"torch.bfloat16"``).
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()


def unique_tensors(tensors: dict[str, torch.Tensor]) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """The distinct tensors of a ``state_dict(keep_vars=True)``, each with all its names (sorted),
    ordered by the first name. Tied parameters are one object under several names."""
    names: dict[int, list[str]] = {}
    first: dict[int, torch.Tensor] = {}
    for name, t in tensors.items():
        names.setdefault(id(t), []).append(name)
        first.setdefault(id(t), t)
    out = [(tuple(sorted(names[k])), first[k]) for k in names]
    return sorted(out, key=lambda item: item[0][0])


@dataclass(frozen=True)
class WeightLayout:
    """What a sync carries and in which order: the receiver's distinct tensors sorted by name."""

    slots: tuple[TensorSlot, ...]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> "WeightLayout":
        """The layout of a receiver's ``state_dict(keep_vars=True)``."""
        return cls(tuple(TensorSlot(n, tuple(t.shape), str(t.dtype)) for n, t in unique_tensors(tensors)))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def buckets(self, bucket_bytes: int) -> list[list[tuple[int, int]]]:
        """Slot indices per bucket with each slot's byte offset in its bucket: consecutive slots
        up to ``bucket_bytes`` (a larger slot is a bucket of its own)."""
        out: list[list[tuple[int, int]]] = [[]]
        used = 0
        for i, s in enumerate(self.slots):
            if out[-1] and used + s.nbytes > bucket_bytes:
                out.append([])
                used = 0
            out[-1].append((i, used))
            used += -(-s.nbytes // _ALIGN) * _ALIGN
        return [b for b in out if b]

    def bucket_nbytes(self, bucket: list[tuple[int, int]]) -> int:
        i, off = bucket[-1]
        return off + self.slots[i].nbytes

    def bucket_starts(self, bucket_bytes: int) -> list[tuple[list[tuple[int, int]], int]]:
        """Each bucket with its byte offset in a staging buffer that holds them all, aligned."""
        out, start = [], 0
        for b in self.buckets(bucket_bytes):
            out.append((b, start))
            start += -(-self.bucket_nbytes(b) // _ALIGN) * _ALIGN
        return out

    def staging_nbytes(self, bucket_bytes: int) -> int:
        """Bytes of a staging buffer that holds every bucket (the weights, plus alignment)."""
        b, start = self.bucket_starts(bucket_bytes)[-1]
        return start + self.bucket_nbytes(b)

    def check_sender(self, sender: list[tuple[tuple[str, ...], torch.Tensor]]) -> None:
        """Check that a sender's :func:`unique_tensors` match this layout name for name.

        Raises:
            ValueError: names or shapes differ (another architecture, or the MTP tensors missing
                on one side), naming the first difference.
        """
        mine = [(s.names, s.shape) for s in self.slots]
        theirs = [(n, tuple(t.shape)) for n, t in sender]
        if mine == theirs:
            return
        a = {n for s in self.slots for n in s.names}
        b = {n for names, _ in sender for n in names}
        missing, unexpected = sorted(a - b), sorted(b - a)
        hint = (
            " (the MTP tensors must be synced too)" if any(k.startswith("mtp.") for k in missing + unexpected) else ""
        )
        if missing or unexpected:
            raise ValueError(
                f"weight sync: the trainer's tensors do not match the generation engine's: {len(missing)} missing on "
                f"the trainer (e.g. {missing[:3]}), {len(unexpected)} the engine lacks (e.g. {unexpected[:3]}){hint}; "
                "both sides must build the same model config"
            )
        diff = [(m, t) for m, t in zip(mine, theirs) if m != t]
        raise ValueError(
            f"weight sync: the trainer's tensors differ from the generation engine's in shape or tying, first at "
            f"{diff[0][0]} vs {diff[0][1]}; both sides must build the same model config"
        )


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` unsharded: an FSDP2 ``DTensor`` is all-gathered (a collective of the train ranks'
    group: every rank calls it, in the same order); a plain tensor is returned as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def stage_weights(layout: WeightLayout, source: torch.nn.Module, staging: torch.Tensor, bucket_bytes: int) -> int:
    """Colocated side of a sync: copy ``source``'s weights (cast to the layout's dtypes) into
    ``staging`` (uint8 ``[layout.staging_nbytes(bucket_bytes)]``, on the same device), tensor by
    tensor; with FSDP2 each tensor is gathered just before its copy (collective: every train rank
    calls this). :func:`apply_staged` then copies them into the engine between two generation
    calls. Returns the bytes staged.

    Raises:
        ValueError: names or shapes differ from ``layout`` (nothing is staged then).
    """
    mine = unique_tensors(source.state_dict(keep_vars=True))
    layout.check_sender(mine)
    with torch.no_grad():
        for bucket, start in layout.bucket_starts(bucket_bytes):
            for (slot, view), (i, _) in zip(_views(staging[start:], layout, bucket), bucket):
                view.copy_(full_tensor(mine[i][1].detach()))
    return layout.nbytes


def _broadcast(pg, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    pg.broadcast([buf], opts).wait()


def _views(
    buf: torch.Tensor, layout: WeightLayout, bucket: list[tuple[int, int]]
) -> Iterator[tuple[TensorSlot, torch.Tensor]]:
    for i, off in bucket:
        s = layout.slots[i]
        yield s, buf[off : off + s.nbytes].view(s.torch_dtype).view(s.shape)


def send_weights(
    group: "WeightSyncGroup | None", layout: WeightLayout, source: torch.nn.Module, bucket_bytes: int
) -> int:
    """Train side of a sync: walk ``source``'s tensors in layout order, gather each (FSDP2: a
    collective of the train ranks, so every train rank calls this; ``group`` is None on ranks
    other than 0, which only take part in the gathers), pack them into buckets in the layout's
    dtypes and broadcast each bucket from rank 0 of ``group``. Returns the bytes broadcast.

    Rank 0 checked ``layout`` against ``source`` (:meth:`WeightLayout.check_sender`) before the
    group was built; the other ranks walk the same model in the same order.
    """
    mine = unique_tensors(source.state_dict(keep_vars=True))
    buckets = layout.buckets(bucket_bytes)
    buf = None
    if group is not None:
        buf = torch.empty(max(layout.bucket_nbytes(b) for b in buckets), dtype=torch.uint8, device=group.device)
    with torch.no_grad():
        for bucket in buckets:
            fulls = [full_tensor(mine[i][1].detach()) for i, _ in bucket]
            if group is None:
                continue
            n = layout.bucket_nbytes(bucket)
            for (slot, view), full in zip(_views(buf, layout, bucket), fulls):
                view.copy_(full)
            _broadcast(group.pg, buf[:n])
    return layout.nbytes


def receive_weights(group: "WeightSyncGroup", layout: WeightLayout, staging: torch.Tensor, bucket_bytes: int) -> None:
    """Generation side of a sync, first half: receive every bucket into ``staging`` (uint8
    ``[layout.staging_nbytes(bucket_bytes)]`` on the group's device). The engine's own tensors are
    not touched, so this may run while the engine generates; :func:`apply_staged` then copies
    the staged weights in between two generation calls."""
    with torch.no_grad():
        for bucket, start in layout.bucket_starts(bucket_bytes):
            _broadcast(group.pg, staging[start : start + layout.bucket_nbytes(bucket)])


def apply_staged(
    layout: WeightLayout, staging: torch.Tensor, target: dict[str, torch.Tensor], bucket_bytes: int
) -> None:
    """Generation side, second half: copy the weights staged by :func:`receive_weights` in place
    into ``target`` (the engine's ``state_dict(keep_vars=True)``, whose layout ``layout`` is)."""
    with torch.no_grad():
        for bucket, start in layout.bucket_starts(bucket_bytes):
            for slot, view in _views(staging[start:], layout, bucket):
                for name in slot.names:
                    target[name].copy_(view)


def listen_socket(host: str) -> tuple[socket.socket, int]:
    """A listening TCP socket on ``host`` and a free port, for rank 0's store (binding it here,
    rather than handing a port number around, leaves no window in which another process takes
    the port, and keeps a loopback store off the network)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock, sock.getsockname()[1]


class WeightSyncGroup:
    """A process group of its own: rank 0 sends (train rank 0), ranks 1.. receive.

    Args:
        host / port: where rank 0's TCPStore listens (127.0.0.1 on one host, the node's IP
            across nodes).
        rank / world_size: this process's rank and the group's size (1 + generation workers).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL, on the current CUDA device).
        listen_sock: rank 0 only, the socket from :func:`listen_socket`.
        timeout_s: how long building the group and each collective may wait for the others.

    Raises:
        RuntimeError / DistStoreError / TimeoutError: the others did not join within ``timeout_s``
            (the caller falls back to another path and says so).
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: str,
        listen_sock: socket.socket | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        timeout = timedelta(seconds=timeout_s)
        if rank == 0:
            assert listen_sock is not None, "rank 0 hosts the store: pass its listening socket"
            store = dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listen_sock.detach())
        else:
            store = dist.TCPStore(host, port, world_size, False, timeout)
        self.store = store
        self.rank = rank
        self.world_size = world_size
        prefixed = dist.PrefixStore("splitrl_weight_sync", store)
        if device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        # the first collective builds the communicators (NCCL lazily): pay it here, not in a step
        _broadcast(self.pg, torch.zeros(1, dtype=torch.uint8, device=self.device))

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
