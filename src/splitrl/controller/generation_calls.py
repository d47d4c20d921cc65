"""The controller's calls to the generation workers: a generation request, whose groups go to the
buffer as they finish (or with the call), and a held-out evaluation split over the workers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from splitrl.types import Group

if TYPE_CHECKING:
    from splitrl.config import RunConfig
    from splitrl.eval_config import EvalConfig

Deliver = Callable[[list[Group]], Awaitable[None]]


async def generate(
    actor, indices: list[int], cfg: RunConfig, deliver: Deliver, streamed: dict[int, concurrent.futures.Future]
) -> tuple[list[Group], dict]:
    """One generation call for ``indices``: its groups not yet delivered and its metrics.

    Under ``schedule.mode: async`` each group is handed over as soon as its last sample finishes
    (the train pump's chunks stream from them): an in-process worker calls ``on_group`` on its
    thread (the delivery's future lands in ``streamed``), a Ray worker yields the group from a
    streaming call. ``schedule.mode: sync`` takes them with the call: the step trains only once
    every generation call of it returned.
    """
    on_group = None
    if getattr(actor, "in_process", False) and cfg.schedule.mode == "async":
        loop = asyncio.get_running_loop()

        def on_group(group: Group) -> None:  # on the worker's thread
            streamed[group.prompt_index] = asyncio.run_coroutine_threadsafe(deliver([group]), loop)

    if cfg.schedule.mode == "async" and hasattr(actor, "stream"):
        groups, metrics = [], {}
        async for item in actor.stream("generate_groups_stream", indices, cfg.schedule.group_size):
            if isinstance(item, Group):
                await deliver([item])  # back-pressure holds this loop, not the worker
            else:
                metrics = item
        return groups, metrics
    return await actor.call("generate_groups", indices, cfg.schedule.group_size, on_group)


async def evaluate_heldout(
    gen_actors: list, ecfg: EvalConfig, indices: list[int], call: Callable[[Awaitable, str], Awaitable]
) -> dict[str, float]:
    """``eval/*`` metrics of the current weights on the held-out prompts ``indices``, split over
    the generation workers (each runs its share as its next call); ``call`` is the controller's
    watchdog (``await call(awaitable, what)``)."""
    from splitrl.evaluation import summarize

    t0 = time.perf_counter()
    n = len(gen_actors)
    shares = [(a, indices[i::n]) for i, a in enumerate(gen_actors) if indices[i::n]]
    futures = [
        a.submit("evaluate", ecfg.task, share, ecfg.num_samples, ecfg.seed, ecfg.correct_threshold, ecfg.greedy)
        for a, share in shares
    ]
    parts = await call(asyncio.gather(*futures), "evaluate")
    out: dict[str, float] = {}
    for name, prefix, k in (("sampled", "eval/", ecfg.num_samples), ("greedy", "eval/greedy/", 1)):
        if name in parts[0]:
            samples = [s for p in parts for s in p[name][0]]
            drafted, accepted = sum(p[name][1] for p in parts), sum(p[name][2] for p in parts)
            out.update(summarize(samples, k, [1, *ecfg.ks, k], prefix, drafted, accepted))
    out["timing/eval_s"] = time.perf_counter() - t0
    return out
