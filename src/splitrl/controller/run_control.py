"""What :class:`~splitrl.controller.controller.SingleController` does around its loop: start the
cluster and the workers, restore a checkpoint and start up, supervise the pumps, write the
controller's side of a checkpoint, the watchdog and its stall reports, shutdown.

:class:`RunControl` is the controller's base class: its methods work on the controller's state
(set in ``SingleController.__init__`` and ``_build``) and call the loop's weight sync; the loop
itself is :mod:`.controller`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from splitrl.controller.buffer import ReplayBuffer
from splitrl.controller.cluster import (
    remove_stop_signals,
    shutdown,
    start_cluster,
    start_compile_workers_outside_our_group,
)
from splitrl.controller.launch import launch_workers
from splitrl.controller.policy_client import PolicyClient
from splitrl.controller.run_checkpoint import CheckpointError
from splitrl.controller.weight_sync_path import open_weight_sync
from splitrl.logging import MetricsLogger
from splitrl.workers.generation import load_tokenizer

# the run's progress is told by the controller's logger (users and tests follow it)
log = logging.getLogger("splitrl.controller.controller")


class StallError(RuntimeError):
    """Nothing progressed for ``faults.watchdog_timeout_s``; the message says what was waited on."""


class RunControl:
    """The parts of a run around its loop (module docstring); ``SingleController`` is the one
    subclass."""

    # ============================================== set-up, restore and checkpoint content
    def _start_cluster(self) -> None:
        """Start a local Ray cluster or join the configured one (:func:`~splitrl.controller.cluster.start_cluster`);
        a local run on a GPU starts inductor's compile workers outside this process's group
        (:func:`~splitrl.controller.cluster.start_compile_workers_outside_our_group`)."""
        start_cluster(self.config, self.backend)
        if self.backend == "local" and self.device == "cuda":
            start_compile_workers_outside_our_group()

    def _build(self) -> None:
        """Start the workers (:func:`~splitrl.controller.launch.launch_workers`) and the parts
        of the controller that drive them."""
        cfg = self.config
        w = launch_workers(cfg, self.backend, self.device)
        self.placement, self.placement_group, self.data_plane = w.placement, w.placement_group, w.data_plane
        self.train_actors, self.gen_actors = w.train_actors, w.gen_actors
        self.policy = PolicyClient(self.train_actors)
        self.sync_path: str | None = None  # chosen at the first weight sync (_open_weight_sync)
        self.buffer = ReplayBuffer(cfg.buffer, on_evict=self._on_evict)
        self.tokenizer = load_tokenizer(cfg.tokenizer, cfg.model.pretrained_path)  # saved with checkpoints
        self.checkpointer.attach(self.policy, self.buffer, self.schedule, self.data_plane, self.tokenizer)

    async def _start_up(self) -> int:
        """Restore the newest checkpoint (if resuming), sync the weights, set an earlier run
        aside (when starting over) and open the metrics logger; returns the step to start at."""
        cfg = self.config
        t_ready = time.perf_counter()
        log.info("start-up: waiting for the workers to load the model")
        start = await self._restore()
        # generation may run ahead of (and, with evictions, behind) the step boundary: restart at the
        # lowest prompt index that is not done, so a prompt in flight at the checkpoint is regenerated
        self.schedule.start_at(start)
        await self._sync_weights()
        log.info(
            "start-up: workers ready and weights synced in %.1fs; generating the first rollouts (step %d: %d prompts "
            "x %d samples), then training", time.perf_counter() - t_ready, start + 1, cfg.schedule.groups_per_step, cfg.schedule.group_size,
        )  # fmt: skip
        if not cfg.checkpoint.resume or start == 0:
            # once the workers are up (a failed start leaves the earlier run in place), before the
            # logger, which would start a fresh metrics.jsonl over the earlier one. With no checkpoint
            # to resume from, an earlier record (a run that stopped before its first checkpoint, or
            # another tool's steps) is set aside too: the logger dropped its lines (a new user's trial)
            self.checkpointer.set_aside_earlier_run()
        self.logger = MetricsLogger(self.out, cfg.schedule.num_steps, start_step=start + 1, config=cfg.logging)
        self.logger.save_config(cfg)
        return start

    async def _restore(self) -> int:
        """Load the newest checkpoint that loads (a damaged one is skipped with a warning) into
        the train workers and the controller; returns its step (0: none, a fresh run).

        Raises:
            RuntimeError: see :meth:`RunCheckpointer.load_newest`.
        """
        if not self.config.checkpoint.resume:
            return 0
        restored = await self.checkpointer.restore()
        if restored is None:
            return 0
        # accepted groups that were waiting for buffer room (or held): delivered again by run()
        self._restored_pending = restored.pending
        self.version = restored.version
        if restored.expected_tokens is not None:  # a checkpoint written before it was saved has none
            self.expected_tokens = restored.expected_tokens
        return restored.step

    async def _write_checkpoint(self, step: int, tmp: Path, export: bool, blocking: bool) -> float:
        """Write the checkpoint's files into ``tmp`` (see :meth:`RunCheckpointer.write`); returns
        the seconds the trainer ranks blocked to stage their shards."""
        return await self.checkpointer.write(
            step, tmp, export=export, blocking=blocking, version=self.version, expected_tokens=self.expected_tokens
        )

    def _prune_checkpoints(self) -> None:
        self.checkpointer.prune()

    async def _open_weight_sync(self) -> str:
        """Choose how weights reach the generation engines, and say which (see
        :func:`~splitrl.controller.weight_sync_path.open_weight_sync`)."""
        return await open_weight_sync(
            self.config, self.backend, self.placement, self.device, self.train_actors, self.gen_actors
        )

    # ================================================ supervision, watchdog, shutdown
    async def _supervise(self, trainer: asyncio.Task, pumps: list[asyncio.Task]) -> None:
        """Wait until the train pump is done; a rollout pump's failure is the run's."""
        while True:
            done, _ = await asyncio.wait([trainer, *pumps], return_when=asyncio.FIRST_COMPLETED)
            if trainer in done:
                trainer.result()
                return
            for p in done:
                if p.exception() is not None:
                    raise p.exception()
            pumps = [p for p in pumps if not p.done()]
            if not pumps:
                await trainer
                return

    async def _wind_down(self, tasks: list[asyncio.Task], loop: asyncio.AbstractEventLoop) -> None:
        """The run's end, whichever way it ended: stop and cancel the pumps, finish a checkpoint
        that was being written, remove the stop-signal handlers, close the logger, shut down."""
        self._stop.set()
        self._wake_pumps()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # a run that failed after a checkpoint started in the background: its staged state
        # is consistent, so finish it (a hung trainer gets a bounded wait)
        try:
            await self.checkpointer.finish_pending(timeout=min(120.0, self.config.faults.watchdog_timeout_s))
        except CheckpointError as e:
            log.error("%s", e)
        remove_stop_signals(loop)
        self.logger.close()
        self._shutdown()

    async def _policy_call(self, coro, what: str):
        try:
            return await asyncio.wait_for(coro, timeout=self.config.faults.watchdog_timeout_s)
        except asyncio.TimeoutError:
            limit = self.config.faults.watchdog_timeout_s
            raise StallError(
                f"watchdog: {what} did not return within faults.watchdog_timeout_s={limit:g} s at step {self.step + 1}: a "
                "worker is hung (e.g. inside a collective), or the call takes longer than that. If "
                f"{limit:g} s is too short for this model, raise faults.watchdog_timeout_s; else restart the run (it resumes "
                "from the last checkpoint)."
            ) from None

    def _stall_report(self, what: str) -> str:
        """Why the train pump waited in vain, from where every prompt of the schedule is."""
        cfg = self.config
        sched = self.schedule
        limit = cfg.faults.watchdog_timeout_s
        head = (
            f"watchdog: waited faults.watchdog_timeout_s={limit:g} s for {what} at step {self.step + 1} "
            f"(policy version {self.version}, synced {self.synced_version}); buffer holds {self.buffer.size} groups, "
            f"{len(sched.pending)} generated groups wait for buffer room, {len(sched.generating)} prompts are being generated."
        )
        report = head + sched.diagnosis(time.perf_counter(), self.synced_version)
        if sched.generating:  # a slow generation call looks like a hung one from here
            report += f" If generation just takes longer than {limit:g} s here, raise faults.watchdog_timeout_s."
        return report

    def _shutdown(self) -> None:
        workers = [*getattr(self, "gen_actors", []), *getattr(self, "train_actors", [])]
        shutdown(workers, getattr(self, "data_plane", None), getattr(self, "placement_group", None))
