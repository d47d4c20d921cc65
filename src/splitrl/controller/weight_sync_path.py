"""How weights reach the generation engines after each step (DESIGN §4 "weight sync", issue 9):
the path is chosen once, at the first sync (:func:`open_weight_sync`), and every sync then
follows it (:func:`push_weights`). The controller only says when; these say how.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from splitrl.config import RunConfig
from splitrl.controller.cluster import is_loopback, ray_address

# the run's progress is told by the controller's logger (users and tests follow it)
log = logging.getLogger("splitrl.controller.controller")

Bounded = Callable[[Awaitable[Any], str], Awaitable[Any]]


async def open_weight_sync(
    config: RunConfig, backend: str, placement: str, device: str, train_actors: list, gen_actors: list
) -> str:
    """Choose how weights reach the generation engines, and say which (issue 9):

    - ``in_process`` (``cluster.backend=local``): the train actor stages a copy on the device for each
      engine of this process;
    - ``colocated``: each colocated actor stages a copy on its device
      (:class:`~splitrl.controller.placement.ColocatedWorker`);
    - ``group``: a torch.distributed group from train rank 0 to the engines (NCCL / gloo);
    - ``object_store``: the fallback where that group cannot be built — the full weights go
      through CPU and Ray's object store at every sync (slow for large models).

    Raises:
        ValueError: the trainer's and the engines' tensors do not match (another model).
    """
    if backend == "local":
        log.info("weight sync: in-process copy on %s, staged beside generation", device)
        return "in_process"
    if placement == "colocated":
        log.info(
            "weight sync: on-device copy inside each colocated worker (%d), staged beside generation", len(gen_actors)
        )
        return "colocated"
    from splitrl.distributed.weight_sync import DEFAULT_BUCKET_BYTES

    timeout = config.faults.watchdog_timeout_s
    layout = await gen_actors[0].call("weight_layout")
    address = ray_address(config)
    # our own local cluster, or a joined head on this machine's loopback: the group stays there
    loopback = not address or is_loopback(address)
    try:
        host, port = await train_actors[0].call("open_weight_sync", loopback, layout)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. no address to listen on: fall back below
        results: list = [e]
    else:
        world = 1 + len(gen_actors)
        calls = [
            t.call("join_weight_sync", host, port, world, layout, DEFAULT_BUCKET_BYTES, timeout) for t in train_actors
        ]
        calls += [
            g.call("join_weight_sync", host, port, i + 1, world, layout, DEFAULT_BUCKET_BYTES, timeout)
            for i, g in enumerate(gen_actors)
        ]
        # every member returns (joined or timed out) before the choice: none is left blocked
        results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        log.info(
            "weight sync: train rank 0 -> %d generation worker(s) over a torch.distributed %s group (%s:%d), "
            "%.0f MB in %d MB buckets",
            len(gen_actors),
            results[0],
            host,
            port,
            layout.nbytes / 2**20,
            DEFAULT_BUCKET_BYTES // 2**20,
        )
        return "group"
    e = errors[0]
    log.warning(
        "weight sync: the torch.distributed group could not be built (%s: %s); falling back to Ray's object "
        "store: the full weights go through CPU at every sync (slow for large models)",
        type(e).__name__,
        e,
    )
    return "object_store"


async def push_weights(
    path: str, version: int, policy: Any, train_actors: list, gen_actors: list, bounded: Bounded
) -> None:
    """Bring the generation engines to the trainer's weights as ``version`` along ``path`` (see
    :func:`open_weight_sync`); ``bounded(coro, what)`` awaits a call under the watchdog."""
    from splitrl.distributed.weight_sync import DEFAULT_BUCKET_BYTES

    if path == "in_process":
        # on the train actor's thread: staged beside generation, taken at each engine's next call
        gens = [a.obj for a in gen_actors]
        await bounded(train_actors[0].call("stage_weights_into", gens, version, DEFAULT_BUCKET_BYTES), "weight sync")
    elif path == "colocated":
        # in the train parts' thread: staged beside generation, taken at each engine's next call
        stage = [a.submit_host("sync_weights", version, DEFAULT_BUCKET_BYTES) for a in train_actors]
        await bounded(asyncio.gather(*stage), "weight sync")
    elif path == "group":
        # staged beside generation; each engine switches at the start of its next call
        receive = [a.submit_in("sync", "receive_weights", version) for a in gen_actors]
        await bounded(asyncio.gather(policy.broadcast_weights(), *receive), "weight sync")
    else:  # object_store: the fallback of split placement
        sd = await bounded(policy.policy_state_dict(to_cpu=True), "policy_state_dict")
        await asyncio.gather(*(a.call("load_weights", sd, version) for a in gen_actors))
