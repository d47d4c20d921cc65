"""torch.distributed helpers that switch themselves off when there is no process group.

The same code runs on one process (no group: every collective is the identity) and on several.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``t`` with ``sum``/``min``/``max``; identity without a group.

    gloo reduces CPU tensors only and NCCL CUDA ones only, so the tensor is moved to the backend's
    device and back.
    """
    if not is_distributed():
        return t
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    buf = t.to(dev)
    dist.all_reduce(buf, op=ops[op])
    t.copy_(buf.to(t.device))
    return t


def init_loopback_process_group(backend: str, rank: int, world_size: int, port: int, timeout_s: float = 600.0) -> None:
    """Start the default process group of ``world_size`` ranks on this host, with its rendezvous
    store listening on 127.0.0.1 only.

    ``init_process_group`` with ``MASTER_ADDR=127.0.0.1`` still makes rank 0's TCPStore listen on
    every interface (``::``); here rank 0 binds the listening socket itself and hands it to the
    store (``master_listen_fd``), so nothing of the rendezvous is reachable from the network.

    Raises:
        OSError: rank 0 cannot bind ``127.0.0.1:port``.
    """
    import socket
    from datetime import timedelta

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(max(128, world_size))
        store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout, master_listen_fd=sock.detach())
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
