"""Launching a run's workers (DESIGN §4): the data plane, the placement group that reserves their
GPUs, the train ranks and the generation workers, started where the placement says
(:mod:`splitrl.controller.placement`). The controller gets their handles back and drives them;
what they run is :mod:`splitrl.workers`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from splitrl.config import RunConfig
from splitrl.controller.actors import spawn
from splitrl.controller.cluster import free_port, wait_for_free_cpus
from splitrl.controller.placement import (
    bundle_options,
    check_cluster_gpus,
    gpus_needed,
    make_placement_group,
    resolve_placement,
    spawn_colocated,
)  # fmt: skip
from splitrl.dataplane import DataPlaneConfig, make_data_plane
from splitrl.workers.generation import GenerationWorker
from splitrl.workers.train_actor import TrainActor

# the start-up is told by the controller's logger, as the rest of the run (users and tests follow it)
log = logging.getLogger("splitrl.controller.controller")

# Seconds to wait for the cluster's free CPUs to cover the run: the actors of a run that just
# ended (in this process, or another job's) free theirs lazily.
CPU_WAIT_S = 15.0


@dataclass
class Workers:
    """The handles of a run's workers (see :mod:`splitrl.controller.actors`)."""

    placement: str  # resolved: colocated or split
    placement_group: Any  # Ray's reservation of the workers' GPUs; None without GPUs or Ray
    data_plane: Any
    train_actors: list
    gen_actors: list


def launch_workers(cfg: RunConfig, backend: str, device: str) -> Workers:
    """Place and start the run's workers: check that the cluster can host them (before anything
    starts: a clear error instead of actors that wait forever for CPUs or GPUs), reserve their GPUs,
    start the data plane, then the train ranks and the generation workers (colocated in pairs, or
    each on its own). ``backend`` and ``device`` are resolved (``ray``/``local``, ``cuda``/``cpu``).

    Raises:
        ValueError: the cluster has too few free CPUs or GPUs for the run.
    """
    G, T = cfg.cluster.num_generation_workers, cfg.cluster.num_train_workers
    gpu = device == "cuda"
    placement = resolve_placement(cfg.cluster.placement, backend, device, G, T)
    placement_group = None
    if backend == "ray":
        import ray

        # before any worker (or the data plane) starts: a clear error instead of actors that
        # wait forever for CPUs or GPUs
        actors = T if placement == "colocated" else G + T
        need = actors
        if cfg.dataplane.kind == "transferqueue":  # its actors, unless one already runs (it attaches)
            from splitrl.dataplane.transferqueue import cpus_to_start

            need += cpus_to_start(cfg.dataplane.transferqueue)
        wait_for_free_cpus(need, CPU_WAIT_S)
        if gpu:
            check_cluster_gpus(placement, G, T, ray.cluster_resources())
            placement_group = make_placement_group(gpus_needed(placement, G, T))
            log.info("start-up: reserved %d GPU(s) for placement %s", gpus_needed(placement, G, T), placement)
    dp_cfg = cfg.dataplane if backend == "ray" else DataPlaneConfig(kind="inprocess")
    log.info("start-up: starting the %s data plane", dp_cfg.kind)
    data_plane = make_data_plane(dp_cfg)
    log.info(
        "start-up: starting %d train worker(s) and %d generation worker(s) on %s (placement %s); each imports "
        "torch and builds the model", T, G, device, placement,
    )
    train_cfg = cfg.train.model_copy(update={"device": device})
    port = free_port()

    def train_part(r: int) -> tuple[tuple, dict]:
        args = (cfg.model, train_cfg, cfg.trainer_loss_config(), data_plane)  # temperature, tis_cap resolved
        return args, dict(rank=r, world_size=T, master_port=port, torch_threads=cfg.cluster.torch_threads)

    gen_part = (
        (cfg.model, cfg.rollout, cfg.task, cfg.tokenizer, data_plane),
        dict(run_seed=cfg.seed, reward_timeout_s=cfg.reward.timeout_s, mask_truncated=cfg.reward.mask_truncated,
             device=device, dtype=cfg.cluster.rollout_dtype, torch_threads=cfg.cluster.torch_threads),
    )
    pg = placement_group
    if backend == "ray" and placement == "colocated":
        parts = [spawn_colocated(train_part(r), gen_part, ray_options=bundle_options(pg, r)) for r in range(T)]
        train_actors = [t for t, _ in parts]
        gen_actors = [g for _, g in parts]
    else:
        # split: train ranks in bundles 0..T-1, generation workers in T..T+G-1
        train_actors = [
            spawn(TrainActor, *args, **kwargs, backend=backend, ray_options=bundle_options(pg, r))
            for r, (args, kwargs) in ((r, train_part(r)) for r in range(T))
        ]
        # a weight sync is received in a concurrency group of its own, beside generation
        gen_actors = [
            spawn(GenerationWorker, *gen_part[0], **gen_part[1], backend=backend,
                  ray_options=bundle_options(pg, T + i), remote_options={"concurrency_groups": {"sync": 1}})
            for i in range(G)
        ]
    return Workers(placement, placement_group, data_plane, train_actors, gen_actors)
