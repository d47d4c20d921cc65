"""Issue 6 item 13: a local Ray cluster (with TransferQueue) listens on loopback only."""

import ipaddress

import pytest
from _tiny import TINY_STEP

from _configs import demo_config

pytestmark = pytest.mark.ray


def _listening(proc) -> list[str]:
    """'address:port' of every TCP socket that ``proc`` or a descendant listens on."""
    import psutil

    out = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="tcp") if hasattr(p, "net_connections") else p.connections(kind="tcp")
        except psutil.Error:
            continue
        out += [f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_a_local_cluster_listens_on_loopback_only(tmp_path):
    """Kind: servers reachable from the network by default. Before the fix a CPU run's cluster
    listened on 21 sockets, 20 of them on all interfaces or the external address."""
    ray = pytest.importorskip("ray")
    psutil = pytest.importorskip("psutil")
    from splitrl.controller.controller import SingleController
    from splitrl.dataplane import make_data_plane

    if ray.is_initialized():
        ray.shutdown()
    cfg = demo_config(TINY_STEP + ["cluster.backend=ray", "dataplane.kind=transferqueue", f"output_dir={tmp_path}"])
    controller = SingleController(cfg)
    me = psutil.Process()
    before = set(_listening(me))
    controller._start_cluster()
    data_plane = make_data_plane(cfg.dataplane)
    try:

        @ray.remote
        class Probe:
            def node_ip(self):
                return ray.util.get_node_ip_address()

        assert ray.get(Probe.remote().node_ip.remote()) == "127.0.0.1"
        opened = [a for a in _listening(me) if a not in before]
    finally:
        data_plane.close()
        ray.shutdown()
    assert len(opened) >= 5, opened  # the cluster's servers were seen at all
    exposed = [a for a in opened if not _loopback(a)]
    assert not exposed, f"{len(exposed)} of {len(opened)} listening sockets are not on loopback: {exposed}"
