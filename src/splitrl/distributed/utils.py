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
