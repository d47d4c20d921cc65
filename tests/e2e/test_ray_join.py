"""Issue 9, item 4: ``ray_address`` joins a running Ray cluster instead of starting one.

The test starts a head node itself (``ray start --head``, loopback only, its own temp dir and
ports, its own process group) and stops only that cluster: other Ray clusters on the machine are
left alone (``ray stop`` would stop every one of them).

Kind of bug guarded: a run that cannot join the cluster it is pointed at (before the fix, a head
on 127.0.0.1 was dialled at the machine's external address and the run never connected), or that
silently starts a cluster of its own.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _tiny import TINY_STEP

from splitrl.controller.cluster import is_loopback as _is_loopback
from splitrl.logging import read_metrics

pytestmark = pytest.mark.ray
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the head's process group (only the processes ``ray start`` started), SIGKILL
    what is left after 5 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
    try:  # the group outlives its leader when a child ignored SIGTERM
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def ray_head():
    """A one-node Ray cluster on 127.0.0.1 started from the command line: yields (port, temp dir)."""
    if shutil.which("ray") is None:
        pytest.skip("the `ray` command line is not on PATH (pip install 'ray[default]')")
    pytest.importorskip("ray")
    port = _free_port()
    # Ray's unix socket paths must fit in 107 bytes: a short directory, not pytest's tmp_path
    temp_dir = tempfile.mkdtemp(prefix="rayhead_", dir="/tmp")
    env = dict(
        os.environ,
        # keep the node address 127.0.0.1 (see cluster.loopback_only_ray): loopback only
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        # a throwaway loopback cluster: without token authentication, whether or not this
        # machine has a ~/.ray/auth_token (Ray 2.60 then turns it on for `ray start`)
        RAY_AUTH_MODE="disabled",
        # no idle Python workers started ahead (one per CPU, seconds of CPU each on 2 cores)
        RAY_enable_worker_prestart="0",
    )
    cmd = [
        "ray", "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=8",
        "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
        # the ports that default to fixed numbers: free ones, so another cluster cannot clash
        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
        "--block",
    ]
    log_path = Path(temp_dir) / "ray_start.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180  # generous: `ray start` is slow on a loaded machine
        while True:
            if proc.poll() is not None:
                pytest.fail(f"`ray start --head` exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the head's GCS did not listen on 127.0.0.1:{port} within 180 s")
                time.sleep(0.25)
        yield port, Path(temp_dir)
    finally:
        _stop_group(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_run_joins_a_running_cluster(ray_head, tmp_path):
    """``splitrl train ... ray_address=127.0.0.1:<port>`` in a process of its own, as a user runs
    it, with the cluster's authentication mode. (A local ``ray.init()`` of an earlier test sets
    ``RAY_AUTH_MODE=token`` in the pytest process for good; a driver in token mode on a cluster
    without it sees its actors "cancelled before it started running".)"""
    port, temp_dir = ray_head
    args = TINY_STEP + ["cluster.backend=ray", "schedule.num_steps=2", "checkpoint.every=0", f"cluster.ray_address=127.0.0.1:{port}",
                        f"output_dir={tmp_path}", "logging.tensorboard=false"]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RAY_ADDRESS", None)
    env["RAY_AUTH_MODE"] = "disabled"  # the head's (see the fixture)
    cmd = [sys.executable, "-c", f"import sys\nfrom splitrl.cli import main\nsys.exit(main({['train', *args]!r}))"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert all(r["train/num_valid_samples"] == 16 for r in read_metrics(tmp_path / "metrics.jsonl"))
    # it joined that cluster and started none of its own
    assert f"joining the Ray cluster at 127.0.0.1:{port}" in out
    assert "Connected to Ray cluster" in out and "Started a local Ray instance" not in out, out[-3000:]
    # the run's actors ran on that head (their logs are in its temp dir), and the head is still up
    workers = list(temp_dir.glob("session_*/logs/worker-*.out"))
    assert any("TrainActor" in w.read_text(errors="replace") for w in workers), [w.name for w in workers]
    assert any("GenerationWorker" in w.read_text(errors="replace") for w in workers), [w.name for w in workers]
    socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_loopback_addresses_are_recognized(monkeypatch):
    """Which addresses the driver joins as a loopback-only node (the others keep Ray's own
    node-address resolution)."""
    for address in ("127.0.0.1:6379", "localhost:6379", "ray://127.0.0.1:10001", "[::1]:6379"):
        assert _is_loopback(address), address
    for address in ("10.0.0.2:6379", "head-node:6379", "ray://head:10001"):
        assert not _is_loopback(address), address
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not _is_loopback("auto")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert _is_loopback("auto")
