"""The controller's own sections of the run config: what a step is made of and how it flows
(``schedule``), where the workers run (``cluster``), checkpoints (``checkpoint``), what a failure
does (``faults``) and how generation workers turn a finished sample into a reward (``reward``).

The components' configs live next to their components (``model``, ``rollout``, ``train``,
``buffer`` ...); these five configure the controller, which hands parts of them to the workers it
starts. Combinations with other sections are checked in :mod:`splitrl.config_checks`.

Light on import (pydantic only): :mod:`splitrl.config` is read before torch is imported.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ScheduleConfig(BaseModel):
    """The run's ``schedule`` section: how many steps, what a step is made of, and how its
    samples flow from generation into training (DESIGN §5 "Step composition").

    Attributes:
        mode: ``async`` (default): generation and training overlap — rollouts of a step are
            streamed into training in chunks as they finish, and with ``buffer.max_staleness > 0``
            generation runs ahead on older weights. ``sync``: a plain GRPO loop — generate the
            whole step with the current weights, then train it, then sync the weights; nothing is
            generated while training. ``buffer.max_staleness`` then defaults to 0, and another
            value is refused. It trains on the same samples with the same math as ``async`` at
            ``max_staleness: 0`` (the baseline that ``bench/bench_e2e.py`` measures the
            asynchronous speed-up against).
        num_steps: optimizer steps of the run.
        groups_per_step / group_size: a step is ``groups_per_step`` prompts × ``group_size``
            samples (DESIGN §5).
        min_groups_per_chunk: the train pump streams chunks of at least this many complete groups.
        generation_groups_per_call: prompts per generation request.
        chunk_order: at ``buffer.max_staleness: 0``, the order a step's chunks take its groups in:
            ``prompt`` (default; bitwise reproducible) or ``arrival`` (as they finish; more
            overlap, equal to ``prompt`` up to float rounding). With ``prompt`` a chunk waits for
            the group of its lowest untrained prompt index, and a resumed run reproduces the
            uninterrupted one. With ``arrival`` training starts as soon as any
            ``min_groups_per_chunk`` of the step's own groups are done (more overlap with
            generation when response lengths vary): the same groups, samples and math (the split
            step equals the synchronous step for any chunking, DESIGN §1) summed in another
            order, so not bitwise reproducible run to run. No effect with ``max_staleness > 0``
            (chunks then are by arrival anyway) or ``mode: sync`` (the whole step is there
            before it trains).
    """

    model_config = ConfigDict(extra="forbid")

    mode: Literal["async", "sync"] = "async"
    num_steps: int = Field(300, ge=1)
    groups_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    min_groups_per_chunk: int = Field(4, ge=1)
    generation_groups_per_call: int = Field(4, ge=1)
    chunk_order: Literal["prompt", "arrival"] = "prompt"


class ClusterConfig(BaseModel):
    """The run's ``cluster`` section: which workers, where, on what.

    Attributes:
        backend: ``ray`` (actors on a Ray cluster, local one by default), ``local`` (objects in
            this process, threads), or ``auto`` (ray when importable).
        placement: where the workers run (:mod:`splitrl.controller.placement`). ``colocated``:
            each GPU hosts one train rank and one generation engine in one process
            (``num_generation_workers == num_train_workers``); weights are handed over on the
            device (a staging copy the engine takes at its next call). ``split``: every train
            rank and every generation worker has a GPU of its own (G + T GPUs); weights go from
            train rank 0 to the engines over NCCL in buckets, received beside generation into a
            staging copy (one more copy of the weights per engine) and switched in between two
            generation calls. ``auto`` (default): ``colocated`` with ``backend=ray`` on CUDA when
            the two counts are equal, otherwise ``split``; ``backend=local`` runs everything in
            this process (colocated). With ``backend=ray`` the GPUs Ray sees are checked before
            any worker starts. On CPU the placement only decides which workers share a process
            (the CPU ``split`` sync uses gloo).
        num_generation_workers / num_train_workers: actors (train workers are data-parallel ranks).
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda``.
        ray_address: join this existing Ray cluster (``auto``, ``host:port``, ``ray://...``;
            ``RAY_ADDRESS`` works too). None starts a local cluster that listens on 127.0.0.1 only.
        torch_threads: intra-op threads per actor (None: torch's default); on a 2-core machine 1
            lets generation and training use a core each.
        rollout_dtype: dtype of the generation copy of the model.
    """

    model_config = ConfigDict(extra="forbid")

    backend: Literal["auto", "ray", "local"] = "auto"
    placement: Literal["auto", "colocated", "split"] = "auto"
    num_generation_workers: int = Field(1, ge=1)
    num_train_workers: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    ray_address: str | None = None
    torch_threads: int | None = Field(None, ge=1)
    rollout_dtype: Literal["fp32", "bf16"] = "fp32"


class CheckpointConfig(BaseModel):
    """The run's ``checkpoint`` section (the format: :mod:`splitrl.controller.run_checkpoint`).

    Attributes:
        every: steps between checkpoints (0: only at the end).
        export_every: steps between Hugging Face exports (``policy/`` in the checkpoint, usable
            by ``splitrl eval`` / ``generate`` and plain transformers); 0 (default): only in the
            last checkpoint of the run (the end, or a stop). A multiple of ``every``: exports ride
            on checkpoints. A checkpoint without one holds the sharded trainer state only, which
            keeps it fast (the export gathers the full model on one rank and blocks).
        resume: continue from the latest checkpoint in ``output_dir`` when there is one.
    """

    model_config = ConfigDict(extra="forbid")

    every: int = Field(50, ge=0)
    export_every: int = Field(0, ge=0)
    resume: bool = True


class FaultsConfig(BaseModel):
    """The run's ``faults`` section: what a failed step or a stall does (DESIGN §4 "Failures").

    Attributes:
        on_chunk_failure: ``retry`` the step (up to ``max_step_retries`` times) or ``stop``.
        max_step_retries: retries of a failed step with ``on_chunk_failure: retry``.
        watchdog_timeout_s: report a stall (and stop) when no step finishes for this long.
    """

    model_config = ConfigDict(extra="forbid")

    on_chunk_failure: Literal["retry", "stop"] = "stop"
    max_step_retries: int = Field(1, ge=0)
    watchdog_timeout_s: float = Field(600.0, gt=0)


class RewardConfig(BaseModel):
    """The run's ``reward`` section: how a generation worker scores a finished sample (DESIGN §5
    "Rewards"); the task's own scoring rule is ``task.scoring``.

    Attributes:
        timeout_s: time limit of one answer check (a check past it scores 0 and is counted).
        mask_truncated: samples cut at ``rollout.max_new_tokens`` get ``sample_mask = 0`` (their
            reward judges an unfinished answer), so the loss leaves them out.
    """

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(5.0, gt=0)
    mask_truncated: bool = False
