"""The run's cluster (DESIGN §4): Ray start-up (a local cluster on loopback only, or a joined
one), the checks that the cluster can host the run, the stop signals, and shutdown.

Nothing here knows the RL loop: :class:`~splitrl.controller.controller.SingleController` calls
:func:`start_cluster` before it builds its workers, installs :func:`stop_signal_handlers` for the
run and calls :func:`shutdown` at its end, whatever the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from splitrl.config import RunConfig

# the start-up is told by the controller's logger, as the rest of the run (users and tests follow it)
log = logging.getLogger("splitrl.controller.controller")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(config: RunConfig) -> str:
    if config.cluster.backend != "auto":
        return config.cluster.backend
    try:
        import ray  # noqa: F401

        return "ray"
    except ImportError:
        return "local"


def ray_address(config: RunConfig) -> str | None:
    """The cluster a run joins (``cluster.ray_address``, else ``RAY_ADDRESS``), or None: its own."""
    return config.cluster.ray_address or os.environ.get("RAY_ADDRESS")


def ray_address_source(config: RunConfig) -> str:
    """Where :func:`ray_address` came from, for messages: the config key or the environment."""
    return "config key cluster.ray_address" if config.cluster.ray_address else "environment variable RAY_ADDRESS"


# seconds a joined cluster's GCS gets to complete a gRPC handshake (it takes milliseconds; Ray
# itself retries for minutes against a port where some other service listens)
GCS_PROBE_TIMEOUT_S = 20.0


def start_cluster(config: RunConfig, backend: str) -> None:
    """Start a local Ray cluster, or join the one named by ``cluster.ray_address`` / ``RAY_ADDRESS``.

    A local cluster listens on loopback only (every Ray server, worker and agent, and
    TransferQueue's sockets, bind the node address, here 127.0.0.1) and runs no dashboard:
    nothing of a laptop run is reachable from the network. Joining a cluster is the explicit
    case: then the cluster's own settings apply (a cluster with token authentication needs
    ``RAY_AUTH_MODE=token`` in this process's environment: Ray 2.60 turns it on by itself
    for ``address=auto`` only). A loopback address (``127.0.0.1:6379``) joins a head started
    on this machine with ``--node-ip-address=127.0.0.1``, with 127.0.0.1 as this process's
    node address too. The cluster's processes ignore Ctrl-C (the terminal sends it to the
    whole process group): the controller decides how to stop, and it still needs its
    workers to finish the step and write the checkpoint.
    """
    if backend != "ray":
        return
    import ray

    if ray.is_initialized():
        return
    src = str(Path(__file__).resolve().parents[2])
    runtime_env = {
        "env_vars": {
            "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
            # TransferQueue caps its (de)serialization threads at this and warns on
            # every call when it exceeds the physical cores
            "TQ_NUM_THREADS": str(min(8, os.cpu_count() or 1)),
        }
    }
    address = ray_address(config)
    if address:
        log.info("start-up: joining the Ray cluster at %s", address)
        # a head started on this machine with --node-ip-address=127.0.0.1 listens on loopback
        # only; Ray would otherwise dial it at the machine's external address and never connect
        joining = loopback_only_ray() if is_loopback(address) else contextlib.nullcontext()
        source = ray_address_source(config)
        check_reachable(address, source=source)
        check_gcs(address, source=source)
        try:
            with joining:
                ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
        except ConnectionError as e:  # an OSError: not a file problem, say what it is
            raise ValueError(
                f"could not join the Ray cluster at {address} ({source}; {str(e).strip().splitlines()[0]}). If the "
                "cluster uses token authentication (Ray's default since 2.5x), set RAY_AUTH_MODE=token (and the token, "
                "e.g. RAY_AUTH_TOKEN) in this shell as on the head; otherwise fix the address"
            ) from None
        return
    # transferqueue's controller and storage units ask for a CPU each: give Ray logical
    # CPUs beyond the physical ones (they may exceed the cores), or it waits forever
    need = config.cluster.num_generation_workers + config.cluster.num_train_workers + 4
    log.info("start-up: starting a local Ray cluster")
    with children_ignore_sigint(), children_in_their_own_group(), loopback_only_ray(), workers_at_our_priority():
        ray.init(num_cpus=max(8, need), include_dashboard=False, log_to_driver=True, runtime_env=runtime_env)


def _host_port(address: str, source: str) -> tuple[str, int] | None:
    """(host, port) of a ``host:port`` Ray address; None for ``auto`` and ``ray://`` ones (left to Ray).

    Raises:
        ValueError: the port is not a number.
    """
    if address == "auto" or "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ValueError(f"ray_address={address!r} ({source}): expected host:port, auto or ray://host:port") from None


def check_reachable(address: str, timeout_s: float = 5.0, source: str = "ray_address / RAY_ADDRESS") -> None:
    """Refuse a ``host:port`` Ray address that accepts no connection (Ray itself retries for
    minutes with warnings only). ``auto`` and ``ray://`` addresses are left to Ray.

    Args:
        source: where the address came from, for the message (:func:`ray_address_source`).

    Raises:
        ValueError: naming the address, where it came from and how to fix it.
    """
    found = _host_port(address, source)
    if found is None:
        return
    host, port_n = found
    try:
        socket.create_connection((host, port_n), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(
            f"nothing accepts connections at {address} ({source}: {e.strerror or e}); start the "
            f"head there (`ray start --head --port={port_n}`) or fix the address"
        ) from None


def check_gcs(address: str, source: str, timeout_s: float | None = None) -> None:
    """Refuse a ``host:port`` Ray address where something listens that is not a Ray cluster's
    GCS: the GCS is a gRPC server, so a gRPC channel to it is ready within milliseconds, while
    against another service (a web server, a database, a port that accepts and stays silent)
    ``ray.init`` retried "Failed to connect to GCS" for minutes. ``auto`` and ``ray://``
    addresses, and clusters with TLS (``RAY_USE_TLS``), are left to Ray.

    Args:
        source: where the address came from, for the message (:func:`ray_address_source`).
        timeout_s: how long to wait for the handshake (default ``GCS_PROBE_TIMEOUT_S``).

    Raises:
        ValueError: no gRPC handshake within ``timeout_s``: one line naming the address, where it
            came from and what to point it at.
    """
    found = _host_port(address, source)
    if found is None or os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return
    import grpc

    timeout_s = GCS_PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    # straight to the address, as Ray's own channels go (no HTTP proxy of the environment)
    channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise ValueError(
            f"{address} ({source}) accepts connections but is not a Ray cluster: no gRPC handshake (Ray's GCS speaks "
            f"gRPC) within {timeout_s:g} s; point it at the head's GCS port (`ray start --head` prints it, 6379 by "
            f"default), or unset it to start a local cluster"
        ) from None
    finally:
        channel.close()


def check_cluster_cpus(need: int, resources: Mapping[str, float]) -> None:
    """Refuse a cluster with fewer free CPUs than the run's actors ask for (each asks for one;
    Ray would wait forever for the missing ones). ``resources``: ``ray.available_resources()``."""
    have = resources.get("CPU", 0.0)
    if have < need:
        raise ValueError(
            f"the run's actors need {need} CPUs of the Ray cluster (one per train / generation worker, 3 for the "
            f"TransferQueue data plane) but {have:g} are free; lower num_train_workers / num_generation_workers, "
            "free the cluster, or start its nodes with more --num-cpus (logical CPUs may exceed the cores)"
        )


# signals that stop a run cleanly: Ctrl-C, and what schedulers and container runtimes send
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# a second stop signal this soon after the first is the same one delivered twice (`timeout` and a
# terminal reach the process and its group within milliseconds), not a request to exit at once;
# a person's double Ctrl-C takes longer (1 s here ignored a 0.3 s double tap: a new user's trial)
SIGNAL_ECHO_S = 0.2


@contextlib.contextmanager
def loopback_only_ray():
    """Make the Ray cluster started inside a single-node one whose node address is 127.0.0.1:
    its servers, workers and agents (and TransferQueue, which binds Ray's node address) then
    listen on loopback only.

    Ray 2.60 turns ``_node_ip_address="127.0.0.1"`` into the machine's external address (on
    Linux, ``services.resolve_ip_for_localhost``); it keeps loopback only where clusters are
    switched off, as on macOS. That switch is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``: read at
    import (hence the constant, for this process) and by every Ray process started here (hence
    the environment, which they inherit).
    """
    from ray._private import ray_constants

    env_key = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    old_env, old_const = os.environ.get(env_key), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[env_key] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_const
        if old_env is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = old_env


def is_loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``, ``ray://host:port``, or ``auto`` with ``RAY_ADDRESS``
    set to one of those) names this machine's loopback interface (127.0.0.0/8, ``localhost``, ::1)."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "auto")
        if address == "auto":
            return False  # Ray finds the cluster of this machine itself
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


@contextlib.contextmanager
def children_in_their_own_group():
    """Processes started inside (the local Ray cluster's GCS, raylet and, through them, every
    worker) land in a new process group, and this process returns to its own afterwards. GNU
    ``timeout`` signals its whole process group, and schedulers may too: in this process's group,
    Ray's processes died of the stop signal before the final checkpoint was gathered (a new user
    lost 18 steps). Not possible for a session leader (EPERM): then nothing changes."""
    if not hasattr(os, "setpgid"):
        yield
        return
    own = os.getpgrp()
    try:
        os.setpgid(0, 0)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        try:
            os.setpgid(0, own)
        except OSError as err:  # the old group is gone (its other members exited): stay where we are
            log.warning("could not return to process group %d (%s); signals to that group miss this run", own, err)


def start_compile_workers_outside_our_group() -> None:
    """Start torch inductor's compile worker pool now, in a process group of its own.

    A local run (``cluster.backend: local``) on a GPU compiles in this process, and inductor
    starts its pool of compile worker processes lazily, at the first compilation, in this
    process's group. GNU ``timeout`` and schedulers signal the whole group: the workers died of
    the SIGTERM that asked the run to finish its step and checkpoint, the step's next
    compilation (a new shape, a graph capture) failed with ``BrokenPipeError`` and the stop
    checkpoint was never written (one H200, 2026-12-02: 95 steps were trained again). Started
    here, the pool stays alive until this process exits (its workers watch their parent).
    Nothing happens without Triton (CPU builds) or when inductor's pool is off
    (``TORCHINDUCTOR_COMPILE_THREADS=1``, ``TORCH_WARM_POOL=0``)."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without inductor
        return
    with children_in_their_own_group():
        maybe_warm_pool()


@contextlib.contextmanager
def workers_at_our_priority():
    """The local cluster's workers run at this process's niceness instead of Ray's default 15
    (``RAY_worker_niceness``, read when the raylet starts; a value the user set is kept). At
    niceness 15 the workers get about 1/28 of the CPU share of an ordinary process (the kernel's
    weights 36 vs 1024), so on a busy machine the run's workers starved behind any other load
    (bench/RESULTS.md, "CPU timings")."""
    key = "RAY_worker_niceness"
    old = os.environ.get(key)
    if old is None:
        os.environ[key] = str(os.nice(0))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)


@contextlib.contextmanager
def children_ignore_sigint():
    """Processes started inside inherit an ignored SIGINT (kept across exec; Python keeps it
    too), so a terminal's Ctrl-C reaches only this process."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to change
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def flush_console() -> None:
    for stream in (sys.stderr, sys.stdout):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def wait_for_free_cpus(need: int, wait_s: float) -> None:
    """Wait up to ``wait_s`` for the Ray cluster's free CPUs to cover ``need`` (the actors of a run
    that just ended free theirs lazily), then refuse a cluster that still has too few.

    Raises:
        ValueError: see :func:`check_cluster_cpus`.
    """
    import ray

    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0.0) < need and time.monotonic() < deadline:
        time.sleep(0.5)
    check_cluster_cpus(need, ray.available_resources())


def install_stop_signals(loop: asyncio.AbstractEventLoop, on_signal: Callable[[int], None]) -> None:
    """Call ``on_signal(sig)`` on the event loop for each of :data:`STOP_SIGNALS` (nothing is
    installed where the loop cannot: not the main thread); :func:`remove_stop_signals` undoes it."""
    for sig in STOP_SIGNALS:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass


def remove_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    for sig in STOP_SIGNALS:
        try:
            loop.remove_signal_handler(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass


def shutdown(actors: list[Any], data_plane: Any, placement_group: Any) -> None:
    """Kill the workers, close the data plane and give back the placement group (best effort:
    whatever is missing or already gone is skipped)."""
    for a in actors:
        try:
            a.kill()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
    try:
        data_plane.close()
    except Exception:  # noqa: BLE001
        pass
    if placement_group is not None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(placement_group)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
