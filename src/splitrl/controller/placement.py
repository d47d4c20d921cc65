"""Where the workers run (config ``cluster.placement``) — DESIGN §4, issue 9.

- ``colocated``: train rank r and generation engine r share one process (one Ray actor, a
  :class:`ColocatedWorker`) and its GPU. The controller drives the two halves through two
  handles with the actor interface; each half runs its calls on a thread of its own (a Ray
  concurrency group of size 1), so generation overlaps training as with the local backend, and
  the weight hand-over is a copy on the device inside the process (into a staging buffer, taken
  by the engine at its next call: the trainer does not wait for a generation call to end).
- ``split``: every train rank and every generation worker is an actor with a GPU of its own
  (``num_gpus: 1``); train ranks take bundles 0..T-1 of one placement group and generation
  workers bundles T..T+G-1, so that ranks land where intended. Weights go from train rank 0 to
  the engines over a torch.distributed group (:mod:`splitrl.distributed.weight_sync`).

On CPU the placement only decides which workers share a process: no GPUs and no placement group.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

Placement = Literal["colocated", "split"]

# how long to wait for Ray to reserve the GPUs of a placement group
PLACEMENT_GROUP_TIMEOUT_S = 120.0


def resolve_placement(
    placement: str, backend: str, device: str, num_generation_workers: int, num_train_workers: int
) -> Placement:
    """The placement a run uses (``auto`` resolved; see ``ClusterConfig.placement``).

    Args:
        placement: the config's value (``auto``, ``colocated``, ``split``).
        backend / device: resolved (``ray``/``local``, ``cuda``/``cpu``).
    """
    if placement != "auto":
        return placement  # type: ignore[return-value]
    if backend == "local":
        return "colocated"
    if device == "cuda" and num_generation_workers == num_train_workers:
        return "colocated"
    return "split"


def gpus_needed(placement: Placement, num_generation_workers: int, num_train_workers: int) -> int:
    """GPUs a CUDA run needs: one per train rank (colocated), or one per worker (split)."""
    return num_train_workers if placement == "colocated" else num_generation_workers + num_train_workers


def check_cluster_gpus(
    placement: Placement, num_generation_workers: int, num_train_workers: int, resources: Mapping[str, float]
) -> None:
    """Check a CUDA run's placement against the GPUs the Ray cluster has, before any worker starts.

    Args:
        resources: ``ray.cluster_resources()`` (``{"GPU": 2.0, "CPU": 16.0, ...}``).

    Raises:
        ValueError: fewer GPUs than the placement needs, naming both numbers and the ways out.
    """
    need = gpus_needed(placement, num_generation_workers, num_train_workers)
    have = int(resources.get("GPU", 0))
    if have >= need:
        return
    if placement == "colocated":
        what = f"{num_train_workers} GPUs (one per train rank, each shared with a generation engine)"
        fix = f"lower cluster.num_train_workers and cluster.num_generation_workers to {max(1, have)} or fewer"
    else:
        what = (
            f"{need} GPUs ({num_generation_workers} generation worker(s) + {num_train_workers} train worker(s), "
            "one GPU each)"
        )
        fix = "lower cluster.num_generation_workers / cluster.num_train_workers"
        if num_train_workers <= have:
            same = (
                ""
                if num_generation_workers == num_train_workers
                else f" with cluster.num_generation_workers={num_train_workers}"
            )
            fix = f"use cluster.placement=colocated{same} (needs {num_train_workers}), or " + fix
    raise ValueError(
        f"cluster.placement={placement} needs {what}, but the Ray cluster has {have}; {fix}, or join a cluster "
        "with more GPUs (cluster.ray_address=...)"
    )


def make_placement_group(num_bundles: int, timeout_s: float = PLACEMENT_GROUP_TIMEOUT_S):
    """Reserve ``num_bundles`` bundles of one GPU and one CPU (packed onto as few nodes as fit).

    Raises:
        RuntimeError: Ray did not reserve them within ``timeout_s`` (GPUs held by another job).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"GPU": 1, "CPU": 1}] * num_bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - GetTimeoutError, or the cluster went away
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray did not reserve {num_bundles} GPU(s) within {timeout_s:.0f}s ({type(e).__name__}); another job "
            "may hold them (`ray status` shows what is in use)"
        ) from None
    return pg


def bundle_options(pg, index: int | None) -> dict[str, Any]:
    """``ray_options`` of an actor with one GPU in bundle ``index`` of ``pg`` (no GPU: ``pg`` None)."""
    if pg is None:
        return {"num_cpus": 1, "num_gpus": 0}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
    return {"num_cpus": 1, "num_gpus": 1, "scheduling_strategy": strategy}


class ColocatedWorker:
    """A train rank and a generation worker in one process (``cluster.placement: colocated``).

    Args:
        train: ``(args, kwargs)`` of :class:`~splitrl.workers.train_actor.TrainActor`.
        gen: ``(args, kwargs)`` of :class:`~splitrl.workers.generation.GenerationWorker`.
    """

    PARTS = ("train", "gen")

    def __init__(self, train: tuple[tuple, dict], gen: tuple[tuple, dict]) -> None:
        from splitrl.workers.generation import GenerationWorker
        from splitrl.workers.train_actor import TrainActor

        # the train rank first: with several ranks it pins this process's CUDA device
        self.train = TrainActor(*train[0], **train[1])
        self.gen = GenerationWorker(*gen[0], **gen[1])

    def call(self, part: str, method: str, args: tuple, kwargs: dict) -> Any:
        """Run ``method`` of one half (``train`` or ``gen``)."""
        return getattr(getattr(self, part), method)(*args, **kwargs)

    def call_stream(self, part: str, method: str, args: tuple, kwargs: dict) -> Iterator[Any]:
        """Run the generator ``method`` of one half and yield its items (a Ray streaming call)."""
        yield from getattr(getattr(self, part), method)(*args, **kwargs)

    def sync_weights(self, version: int, bucket_bytes: int) -> int:
        """Stage the trainer's weights for the engine on the device (MTP included) as
        ``version``; the engine switches to them at the start of its next call. Runs in the
        ``train`` group, beside a generation call that may be running; with several train ranks
        every rank's actor calls this at once (the FSDP2 shards are gathered tensor by tensor).
        Returns the bytes staged.

        Raises:
            ValueError: the trainer's tensors do not match the engine's (nothing is staged).
        """
        return self.gen.stage_weights(self.train.worker.model, version, bucket_bytes)

    def close(self) -> None:
        self.gen.close()


def spawn_colocated(train: tuple[tuple, dict], gen: tuple[tuple, dict], ray_options: dict | None = None):
    """Start a :class:`ColocatedWorker` Ray actor; returns ``(train half, generation half)``,
    handles with the actor interface of :mod:`splitrl.controller.actors`."""
    from splitrl.controller.actors import ActorPart, RayActor

    actor = RayActor(
        ColocatedWorker,
        train,
        gen,
        ray_options=ray_options,
        remote_options={"concurrency_groups": {p: 1 for p in ColocatedWorker.PARTS}},
    )
    return ActorPart(actor, "train"), ActorPart(actor, "gen")
