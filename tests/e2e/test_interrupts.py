"""Issue 6 item 8: a run stopped by a signal finishes its step, writes a checkpoint and exits
with 128 + the signal's number, even when nobody reads its console any more; a second signal
exits at once. Each test runs ``splitrl train`` (local backend) in a subprocess of its own."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _tiny import TINY_STEP

from _wait import wait_until

SRC = str(Path(__file__).resolve().parents[2] / "src")
RUN = TINY_STEP + [
    "cluster.backend=local",
    "dataplane.kind=inprocess",
    "logging.tensorboard=false",
    "schedule.num_steps=1000",
]


def _start(out: Path, *extra: str, code: str | None = None, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [*RUN, f"output_dir={out}", *extra]
    cmd = [
        sys.executable,
        "-c",
        (code or "") + f"\nimport sys\nfrom splitrl.cli import main\nsys.exit(main({['train', *args]!r}))",
    ]
    # a session of its own: killpg then reaches the run and its children, as a terminal's Ctrl-C does
    return subprocess.Popen(cmd, env=env, start_new_session=True, **popen)


def _wait_for(pred, what: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Wait until ``pred()`` (generous: a loaded machine starts the run slowly); fail at once if
    the run exits first."""

    def done():
        if pred():
            return True
        assert proc.poll() is None, f"the run exited with {proc.returncode} before {what}"
        return False

    wait_until(done, what=what, timeout_s=timeout_s, poll_s=0.2)


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0


def _checkpoints(out: Path) -> dict[str, int]:
    root = out / "checkpoints"
    if not root.is_dir():
        return {}
    return {
        p.name: json.loads((p / "COMPLETE").read_text())["step"] for p in root.iterdir() if (p / "COMPLETE").exists()
    }


def test_ctrl_c_through_a_dead_pipe_still_checkpoints(tmp_path):
    """Kind: a dead console stops the final checkpoint. ``splitrl train 2>&1 | tee log`` + Ctrl-C:
    the terminal interrupts tee too, so every later write of the run fails with EPIPE."""
    out = tmp_path / "run"
    proc = _start(
        out, "checkpoint.every=1000", "logging.progress_bar=true", stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        _wait_for(lambda: _steps_logged(out) >= 1, "the first step in metrics.jsonl", proc)
        proc.stdout.close()  # the reader (tee) is gone
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=300)  # the step and its checkpoint; generous for a loaded machine
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 130
    steps = _steps_logged(out)
    assert _checkpoints(out) == {f"step_{steps:06d}": steps}, (steps, _checkpoints(out))


def test_sigterm_stops_like_ctrl_c(tmp_path):
    """Kind: a signal other than Ctrl-C kills the run without a checkpoint (SIGTERM is what
    schedulers and containers send). checkpoint_every=0: the stop's checkpoint is the only one."""
    out = tmp_path / "run"
    log = open(tmp_path / "log", "w")
    proc = _start(out, "checkpoint.every=0", stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _steps_logged(out) >= 1, "the first step in metrics.jsonl", proc)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)  # the step and its checkpoint; generous for a loaded machine
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143, (tmp_path / "log").read_text()[-2000:]
    steps = _steps_logged(out)
    assert _checkpoints(out) == {f"step_{steps:06d}": steps}
    assert "SIGTERM: finishing the current step" in (tmp_path / "log").read_text()


SLOW_STEP = """
import asyncio, pathlib
from splitrl.controller.policy_client import PolicyClient
_real = PolicyClient.finish
async def _slow_finish(self):
    pathlib.Path({marker!r}).touch()
    await asyncio.sleep(600)  # a long step: longer than any wait below
    return await _real(self)
PolicyClient.finish = _slow_finish
"""


def test_a_second_interrupt_exits_at_once(tmp_path):
    """Kind: an interrupt that cannot be escalated. The first Ctrl-C waits for a 600 s step to
    finish; the second one must end the process within seconds, with no checkpoint written."""
    out, marker = tmp_path / "run", tmp_path / "in_step"
    log = open(tmp_path / "log", "w")
    proc = _start(
        out, "checkpoint.every=0", code=SLOW_STEP.format(marker=str(marker)), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        _wait_for(marker.exists, "the run inside its slow step", proc)
        os.killpg(proc.pid, signal.SIGINT)
        # the run has handled the first signal (not merely been sent it: on a loaded machine two
        # signals sent before the run is scheduled arrive as one) ...
        _wait_for(
            lambda: "SIGINT: finishing the current step" in (tmp_path / "log").read_text(),
            "the run's notice of the first SIGINT",
            proc,
        )
        time.sleep(1.0)  # ... and the second comes beyond SIGNAL_ECHO_S: a real second signal, not an echo
        assert proc.poll() is None  # the first one waits for the step
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=90)  # well inside the 600 s step it must not wait for
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 130 and time.monotonic() - t0 < 90
    assert _checkpoints(out) == {}
    assert "SIGINT again: exiting now" in (tmp_path / "log").read_text()


def test_one_signal_delivered_twice_still_checkpoints():
    """Kind: one signal counted twice. `timeout -s INT` (and a terminal's Ctrl-C) can deliver the
    same SIGINT twice within milliseconds; the run took the echo for a second Ctrl-C and exited
    without a checkpoint (a new user's trial, 76 steps lost). A repeat within SIGNAL_ECHO_S is the
    same signal; a later one still forces the exit."""
    import threading
    import types

    from splitrl.controller import controller as ctl

    stub = types.SimpleNamespace(
        _interrupted=False,
        _interrupt_signal=None,
        _interrupted_at=0.0,
        _stop=threading.Event(),
        _wake_pumps=lambda: None,
    )
    exits = []
    orig_exit = ctl.os._exit
    ctl.os._exit = exits.append
    try:
        ctl.SingleController._on_interrupt(stub, signal.SIGINT)
        ctl.SingleController._on_interrupt(stub, signal.SIGINT)  # the echo, milliseconds later
        assert stub._stop.is_set() and stub._interrupt_signal == signal.SIGINT and exits == []
        stub._interrupted_at -= ctl.SIGNAL_ECHO_S + 0.1  # the user presses Ctrl-C again later
        ctl.SingleController._on_interrupt(stub, signal.SIGINT)
        assert exits == [128 + signal.SIGINT]
    finally:
        ctl.os._exit = orig_exit
