"""The local Ray cluster's processes start outside the driver's process group, so a signal sent to
that group (GNU ``timeout`` sends one, schedulers may) reaches the driver, which checkpoints and
stops, but not Ray's GCS and raylet, which the final checkpoint still needs (a new user lost 18
steps to ``timeout -s TERM``)."""

import os
import signal
import subprocess
import sys

import pytest


@pytest.mark.skipif(not hasattr(os, "setpgid"), reason="POSIX process groups")
def test_children_started_inside_survive_a_signal_to_the_drivers_group():
    code = r"""
import os, signal, subprocess, sys, time
from splitrl.controller.cluster import children_in_their_own_group as _children_in_their_own_group
own = os.getpgrp()
with _children_in_their_own_group():
    inside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(own, os.getpgrp(), os.getpgid(inside.pid), os.getpgid(outside.pid), inside.pid, outside.pid, flush=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the driver handles the stop; here: stay alive
os.killpg(own, signal.SIGTERM)  # what `timeout` does to its group
# no fixed sleep: wait until the control child has died of the signal (a loaded machine may take
# seconds to schedule it); killpg signalled every member of the group at once, so by then a
# child in the group would have been killed too
try:
    outside.wait(timeout=120)
except subprocess.TimeoutExpired:
    pass
print(inside.poll(), outside.poll(), flush=True)
inside.kill()
outside.kill()
"""
    # a new session: the child is not the test runner's group leader and can move between groups
    res = subprocess.run(
        [sys.executable, "-c", f"import os, signal, subprocess, sys; os.setpgid(0, 0); "
         # a handler (reset by exec, unlike SIG_IGN) keeps this wrapper alive through the group's signal
         f"signal.signal(signal.SIGTERM, lambda *a: None); "
         f"sys.exit(subprocess.run([sys.executable, '-c', {code!r}]).returncode)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    first, second = res.stdout.splitlines()[-2:]
    own, back, inside_group, outside_group, _, _ = map(int, first.split())
    assert back == own  # the driver returned to its group
    assert inside_group != own and outside_group == own
    inside_rc, outside_rc = second.split()
    assert inside_rc == "None"  # untouched by the group's SIGTERM
    assert outside_rc == str(-signal.SIGTERM)  # the control: a child in the group died of it


@pytest.mark.skipif(not hasattr(os, "setpgid"), reason="POSIX process groups")
def test_a_local_gpu_run_starts_inductors_compile_workers_outside_its_group():
    """The pool inductor would start at the first compilation, in the driver's group (where a
    group's SIGTERM killed it and the stop checkpoint failed with BrokenPipeError), is started
    at start-up in a group of its own. torch's pool start is replaced by a process like it (no
    Triton on the CPU); what is checked is the group that process lands in, and that a local
    run on a GPU asks for it while a CPU run does not."""
    code = r"""
import os, subprocess, sys
import torch._inductor.async_compile as ac
started = []
ac.maybe_warm_pool = lambda: started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
from splitrl.controller import run_control
from splitrl.controller.cluster import start_compile_workers_outside_our_group
start_compile_workers_outside_our_group()
calls = []
run_control.start_cluster = lambda config, backend: None
run_control.start_compile_workers_outside_our_group = lambda: calls.append(1)
class Fake(run_control.RunControl):
    def __init__(self, backend, device):
        self.config, self.backend, self.device = None, backend, device
Fake("local", "cuda")._start_cluster(); Fake("local", "cpu")._start_cluster(); Fake("ray", "cuda")._start_cluster()
print(os.getpgrp(), os.getpgid(started[0].pid), len(calls), flush=True)
started[0].kill()
"""
    res = subprocess.run(
        [sys.executable, "-c", f"import os, subprocess, sys; os.setpgid(0, 0); "
         f"sys.exit(subprocess.run([sys.executable, '-c', {code!r}]).returncode)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    own, pool_group, calls = map(int, res.stdout.split()[-3:])
    assert pool_group != own  # outside the group a `timeout` signals
    assert calls == 1  # local + cuda only
