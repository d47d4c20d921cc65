"""Issue 6 item 13 (ports): the train workers' process group listens on loopback only. Before:
rank 0's rendezvous store listened on every interface (``::``) although MASTER_ADDR was
127.0.0.1."""

import ipaddress
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _wait import wait_until
from splitrl.distributed.utils import init_loopback_process_group

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.dist


def _rank(rank: int, port: int, queue) -> None:
    init_loopback_process_group(
        "gloo", rank, 2, port, timeout_s=300
    )  # generous: spawned ranks start slowly on a loaded machine
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    if rank == 0:
        me = psutil.Process(os.getppid())
        listening = []
        for p in [me, *me.children(recursive=True)]:
            conns = p.net_connections(kind="tcp") if hasattr(p, "net_connections") else p.connections(kind="tcp")
            listening += [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
        queue.put((t.item(), listening))
    dist.barrier()
    dist.destroy_process_group()


def test_the_process_group_listens_on_loopback_only():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    ctx = mp.spawn(_rank, args=(port, queue), nprocs=2, join=False)
    total, listening = queue.get()
    wait_until(lambda: ctx.join(1), timeout_s=300, what="both ranks to exit")  # join raises if a rank failed
    assert total == 3.0  # the group works: 1 + 2
    assert any(p == port for _, p in listening), listening  # the store was seen
    exposed = [(ip, p) for ip, p in listening if not ipaddress.ip_address(ip).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed} (all: {listening})"
