"""The single controller (DESIGN §4): an asyncio loop with a rollout pump and a train pump.

    rollout pump (one per generation worker)            train pump
    claim prompt indices ──► generate_groups ──► buffer ──► select ──► advantages ──► policy.train_chunk
          ▲                                                                       │ (streamed chunks)
          └──────────────────────── weight sync ◄── finish_train_step ◄───────────┘

The controller holds ids, rewards and metadata only; token tensors go from generation workers to
train workers through the data plane.

Schedule. Prompt index i belongs to step ⌊i / groups_per_step⌋ and its samples are drawn with
seeds derived from (run seed, i, sample index). A generation request for step s starts only when
the synced policy version is ≥ s − max_staleness, so no work is generated that the sampler would
evict. With ``max_staleness: 0`` every step trains on exactly its own prompts, generated with the
weights of the step's start, in prompt order and fixed chunk sizes: the run is deterministic and a
resumed run reproduces the uninterrupted one. With ``max_staleness > 0`` generation runs ahead and
timing decides which groups land in which step.

``schedule.mode: sync`` is the plain GRPO loop, kept as the baseline the asynchronous schedule is
measured against (``bench/bench_e2e.py``): it runs at ``max_staleness: 0`` (the config enforces
it), so generation of step s waits for the weights of version s, and the train pump additionally
waits until every group of the step is generated before it trains the first chunk. Generation and
training then never overlap, and the chunks, samples and math are those of ``async`` at
``max_staleness: 0``: the two runs log the same numbers, at different speeds.

What this module keeps is the loop (``_train_pump``, ``_run_step``, ``_rollout_pump``); its parts
live beside it: where each prompt is (:mod:`.prompt_schedule`), the checkpoint lifecycle
(:mod:`.checkpointer`), the weight-sync path (:mod:`.weight_sync_path`), a step's metrics
(:mod:`.step_metrics`), Ray start-up, signals and shutdown (:mod:`.cluster`), starting the
workers (:mod:`.launch`), the checks before anything starts (:mod:`.preflight`); the workers
themselves are :mod:`splitrl.workers`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from splitrl.config import RunConfig
from splitrl.controller.buffer import ReplayBuffer, StepComposer
from splitrl.controller.checkpointer import RunCheckpointer
from splitrl.controller.cluster import (  # noqa: F401 - re-exported
    SIGNAL_ECHO_S,
    STOP_SIGNALS,
    flush_console,
    install_stop_signals,
    remove_stop_signals,
    resolve_backend,
    shutdown,
    start_cluster,
)
from splitrl.controller.health import RunHealth
from splitrl.controller.launch import launch_workers
from splitrl.controller.policy_client import PolicyClient
from splitrl.controller.preflight import latest_checkpoint, preflight, settings_without_effect  # noqa: F401 - re-exported
from splitrl.controller.prompt_schedule import PromptSchedule, arrived_first, strategy_of  # noqa: F401 - re-exported
from splitrl.controller.run_checkpoint import CheckpointError, RunDirLock, remove_leftovers, set_aside_earlier_run
from splitrl.controller.step_metrics import step_metrics
from splitrl.controller.weight_sync_path import open_weight_sync, push_weights
from splitrl.eval_config import plan_eval
from splitrl.logging import MetricsLogger
from splitrl.loss.advantages import compute_group_advantages
from splitrl.types import Group
from splitrl.workers.generation import load_tokenizer

log = logging.getLogger(__name__)


class StallError(RuntimeError):
    """Nothing progressed for ``faults.watchdog_timeout_s``; the message says what was waited on."""


class StepFailed(RuntimeError):
    """A step failed and was not retried (or ran out of retries); ``__cause__`` holds why."""


@dataclass
class RunResult:
    """What ``train`` returns: the per-step metrics and where the artifacts are."""

    output_dir: str
    steps_done: int
    metrics: list[dict[str, float]] = field(default_factory=list)
    stopped_early: bool = False
    interrupted: bool = False
    # the signal that stopped the run (SIGINT or SIGTERM), None when none did; the CLI exits with
    # 128 + its number (130, 143)
    interrupt_signal: int | None = None


class SingleController:
    """Runs one GRPO training run described by a :class:`RunConfig`.

    ``run`` checks the config (preflight), starts the cluster and the workers, then runs one train
    pump (``_train_pump``: step, weight sync, log, checkpoint) and one rollout pump per generation
    worker (``_rollout_pump``) until the last step or a stop.
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.out = Path(config.output_dir)
        self.backend = resolve_backend(config)
        self.device = config.cluster.device
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._stop = asyncio.Event()
        self._interrupted = False
        self._interrupt_signal: int | None = None
        self._interrupted_at = 0.0  # time.monotonic() of the first stop signal
        self._wake = asyncio.Event()  # replaced at each wake-up (_wake_pumps)
        self.version = 0  # the trainer's policy version: steps trained
        self.synced_version = -1  # the version the generation engines hold
        self.step = 0  # the open step
        self._restored_pending: list[Group] = []  # accepted groups of the checkpoint, delivered again
        # recorded between two steps' metrics (step_metrics)
        self.gen_intervals: list[tuple[float, float]] = []
        self.train_intervals: list[tuple[float, float]] = []
        self.rollout_acc: list[dict] = []
        self.wait_s = 0.0
        # fp16 loss scaling: the step's expected valid tokens, then the last step's
        sc = config.schedule
        self.expected_tokens = max(1, sc.groups_per_step * sc.group_size * config.rollout.max_new_tokens // 2)
        self.history: list[dict[str, float]] = []
        self.stopped_early = False
        # what a checkpoint holds is written by _write_checkpoint (looked up at each call)
        self.checkpointer = RunCheckpointer(
            config, self.out, self._stop,
            lambda step, tmp, export, blocking: self._write_checkpoint(step, tmp, export=export, blocking=blocking),
        )  # fmt: skip
        buf = config.buffer
        strategy = strategy_of(buf.max_staleness, sc.chunk_order, sc.mode)
        self.schedule = PromptSchedule(sc.groups_per_step, sc.num_steps, buf.max_staleness, strategy)

    # ============================================= run: start up, run the pumps, wind down
    async def run(self) -> RunResult:
        cfg = self.config
        done_before = preflight(cfg)
        self.eval_indices = plan_eval(cfg) if cfg.eval.enabled else []  # raises before anything starts
        log.log(*cfg.off_policy_summary())
        self.health = RunHealth(cfg.reward.timeout_s, loss_scaling=cfg.train.precision == "fp16")
        if done_before > cfg.schedule.num_steps:
            # the user asked for fewer steps than were made: say so, or it reads as a success
            log.warning(
                "%s already holds a run of %d steps, more than schedule.num_steps=%d; nothing to do (raise "
                "schedule.num_steps to continue it, or set checkpoint.resume=false to start over: the earlier run "
                "is set aside, not deleted)",
                self.out, done_before, cfg.schedule.num_steps,
            )  # fmt: skip
            return RunResult(str(self.out), done_before)
        if done_before == cfg.schedule.num_steps:
            log.info("%s already holds a finished run (%d steps); nothing to do", self.out, done_before)
            return RunResult(str(self.out), done_before)
        self.out.mkdir(parents=True, exist_ok=True)
        lock = RunDirLock(self.out)  # a second run in this directory stops here, before any write
        try:
            return await self._run_locked()
        finally:
            lock.release()

    async def _run_locked(self) -> RunResult:
        cfg = self.config
        remove_leftovers(self.out)  # half-written checkpoints and temp files of a killed run
        self._start_cluster()
        self._build()
        random.seed(cfg.seed)
        start = await self._start_up()
        loop = asyncio.get_running_loop()
        install_stop_signals(loop, self._on_interrupt)
        pumps = [asyncio.create_task(self._rollout_pump(a)) for a in self.gen_actors]
        if self._restored_pending:
            pumps.append(asyncio.create_task(self._deliver(self._restored_pending)))
        trainer = asyncio.create_task(self._train_pump(start))
        try:
            await self._supervise(trainer, pumps)
        finally:
            self._stop.set()
            self._wake_pumps()
            for t in [trainer, *pumps]:
                t.cancel()
            await asyncio.gather(trainer, *pumps, return_exceptions=True)
            # a run that failed after a checkpoint started in the background: its staged state
            # is consistent, so finish it (a hung trainer gets a bounded wait)
            try:
                await self.checkpointer.finish_pending(timeout=min(120.0, cfg.faults.watchdog_timeout_s))
            except CheckpointError as e:
                log.error("%s", e)
            remove_stop_signals(loop)
            self.logger.close()
            self._shutdown()
        return RunResult(
            str(self.out),
            start + len(self.history),
            self.history,
            self.stopped_early or self._interrupted,
            self._interrupted,
            self._interrupt_signal,
        )

    # =========================== the loop: train a step, sync the weights, log, checkpoint
    async def _train_pump(self, start_step: int) -> None:
        """The RL loop: train step k on the groups the schedule gives it, sync the weights to the
        generation engines (the rollout pumps wake up), evaluate when due, log, checkpoint."""
        cfg = self.config
        for step in range(start_step, cfg.schedule.num_steps):
            self.step = step
            t0 = time.perf_counter()
            train_metrics, groups = await self._run_step(step)
            self.version += 1
            sync_s = await self._sync_weights()
            # held-out evaluation with the weights just synced, queued on the generation workers
            # before the rollout pumps resume: training waits for the evaluation only
            eval_metrics = await self._evaluate() if cfg.eval.due(step + 1, cfg.schedule.num_steps) else {}
            self.data_plane.delete([s.sample_id for g in groups for s in g.samples])
            if train_metrics.get("num_valid_tokens", 0) > 0:
                self.expected_tokens = int(train_metrics["num_valid_tokens"])
            metrics = self._step_metrics(train_metrics, groups, time.perf_counter() - t0, sync_s)
            metrics.update(eval_metrics)
            self.logger.log(step + 1, metrics)
            self.health.check(step + 1, metrics)
            self.history.append(metrics)
            done = step + 1
            due = (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.schedule.num_steps
            # a stop (Ctrl-C, SIGTERM) always leaves a checkpoint of the last finished step,
            # checkpoint.every=0 (only at the end) included
            if due or self._stop.is_set():
                await self.checkpointer.save(done)
            if self._stop.is_set():
                self.stopped_early = done < cfg.schedule.num_steps
                return

    async def _run_step(self, step: int) -> tuple[dict[str, float], list[Group]]:
        """One optimizer step, streamed in chunks; retried per ``faults.on_chunk_failure``."""
        cfg = self.config
        composer = StepComposer(cfg.schedule.groups_per_step, cfg.schedule.min_groups_per_chunk)
        received: list[Group] = []
        attempt = 0
        while True:
            composer.start_step()
            train_intervals = []
            try:
                if cfg.schedule.mode == "sync":
                    # the plain loop: the whole step is generated before any of it trains (the
                    # chunks below are then those of async at max_staleness 0, already held)
                    t = time.perf_counter()
                    await self._hold(self.schedule.step_prompts(step))
                    self.wait_s += time.perf_counter() - t
                # fp16: per-chunk losses are scaled by 1 / (the expected tokens of the step) so that
                # activation gradients stay in range; finish divides it out (DESIGN §2)
                expected = self.expected_tokens if cfg.train.precision == "fp16" else None
                await self._policy_call(self.policy.begin(expected), "begin_train_step")
                replay = list(received)
                while not composer.is_full:
                    req = composer.next_chunk()
                    if replay:
                        groups, replay = replay[: req.max_groups], replay[req.max_groups :]
                    else:
                        n = (
                            min(req.max_groups, cfg.schedule.min_groups_per_chunk)
                            if cfg.buffer.max_staleness == 0
                            else req.max_groups
                        )
                        groups = await self._wait_groups(n)
                        received.extend(groups)
                    compute_group_advantages(groups, cfg.advantage)
                    t = time.perf_counter()
                    await self._policy_call(self.policy.train_chunk(groups), "train_microbatch")
                    train_intervals.append((t, time.perf_counter()))
                    composer.add_chunk(groups)
                t = time.perf_counter()
                metrics = await self._policy_call(self.policy.finish(), "finish_train_step")
                train_intervals.append((t, time.perf_counter()))
                self.train_intervals = train_intervals
                return metrics, composer.finish_step()
            except StallError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure of a chunk aborts the step
                composer.abort_step()
                try:
                    await self._policy_call(self.policy.abort(), "abort_train_step")
                except Exception as abort_error:  # noqa: BLE001
                    raise StepFailed(
                        f"step {step + 1} failed ({type(e).__name__}: {e}) and abort failed too"
                    ) from abort_error
                attempt += 1
                if cfg.faults.on_chunk_failure == "stop" or attempt > cfg.faults.max_step_retries:
                    raise StepFailed(
                        f"step {step + 1} failed after {attempt} attempt(s): {type(e).__name__}: {e}"
                    ) from e
                log.warning(
                    "step %d failed (%s: %s); retrying (%d/%d)",
                    step + 1,
                    type(e).__name__,
                    e,
                    attempt,
                    cfg.faults.max_step_retries,
                )

    async def _wait_groups(self, n: int) -> list[Group]:
        """The next chunk's groups (at most ``n``), as the schedule's strategy takes them."""
        cfg = self.config
        t0 = time.perf_counter()
        if self.schedule.strategy == "staleness":
            ok = await self.buffer.wait_ready(
                min(n, cfg.schedule.min_groups_per_chunk),
                timeout=cfg.faults.watchdog_timeout_s,
                current_version=self.version,
            )
            if not ok:
                raise StallError(self._stall_report(f"{n} groups"))
            min_groups = min(n, cfg.schedule.min_groups_per_chunk)
            groups = self.buffer.select(self.version, max_groups=n, min_groups=min_groups)
        else:
            # max_staleness 0: the step's own prompts, in prompt order (deterministic) or in the
            # order their groups arrive (schedule.chunk_order=arrival)
            await self._hold(*self.schedule.wanted(n, self.step))
            groups = self.schedule.take(n, self.step)
        self.wait_s += time.perf_counter() - t0
        return groups

    async def _hold(self, want: list[int], at_least: int | None = None) -> None:
        """Wait until the group of every prompt index in ``want`` (or of ``at_least`` of them) is
        held (``max_staleness: 0``: the train pump takes a step's own prompts; groups that arrive
        before their turn are moved from the buffer to the schedule's ``held``, in arrival order).

        Raises:
            StallError: no group arrived for ``faults.watchdog_timeout_s``; says where the prompts are.
        """
        cfg = self.config
        sched = self.schedule
        need = len(want) if at_least is None else at_least
        while sched.num_held(want) < need:
            ok = await self.buffer.wait_ready(1, timeout=cfg.faults.watchdog_timeout_s, current_version=self.version)
            if not ok:
                raise StallError(
                    self._stall_report("rollouts for prompts " + str([i for i in want if i not in sched.held]))
                )
            sched.hold(self.buffer.select(self.version, max_groups=max(1, self.buffer.size), min_groups=1))

    async def _sync_weights(self) -> float:
        """Bring the generation engines to the trainer's weights (``self.version``); returns
        the seconds it took (logged as ``timing/weight_sync_s``)."""
        t0 = time.perf_counter()
        if self.sync_path is None:
            self.sync_path = await self._open_weight_sync()
            t0 = time.perf_counter()  # the group's set-up is start-up time, not a sync
        await push_weights(
            self.sync_path, self.version, self.policy, self.train_actors, self.gen_actors, self._policy_call
        )
        self.synced_version = self.version
        self._wake_pumps()
        return time.perf_counter() - t0

    async def _open_weight_sync(self) -> str:
        """Choose how weights reach the generation engines, and say which (see
        :func:`~splitrl.controller.weight_sync_path.open_weight_sync`)."""
        return await open_weight_sync(
            self.config, self.backend, self.placement, self.device, self.train_actors, self.gen_actors
        )

    def _step_metrics(
        self, train: dict[str, float], groups: list[Group], step_s: float, sync_s: float
    ) -> dict[str, float]:
        """The step's record; what the pumps recorded since the last step starts afresh."""
        calls, self.rollout_acc = self.rollout_acc, []
        gen_intervals, self.gen_intervals = self.gen_intervals, []
        wait_s, self.wait_s = self.wait_s, 0.0
        return step_metrics(
            train, groups, calls=calls, speculative=self.config.rollout.speculative, buffer=self.buffer,
            version=self.version, gen_intervals=gen_intervals, train_intervals=self.train_intervals, wait_s=wait_s,
            # written after the previous step's metrics were logged: reported with this step's
            checkpoint_s=self.checkpointer.take_blocked_s(), step_s=step_s, sync_s=sync_s,
        )  # fmt: skip

    async def _evaluate(self) -> dict[str, float]:
        """``eval/*`` metrics of the current weights on the held-out prompts, split over the
        generation workers (each runs its share as its next call)."""
        from splitrl.evaluation import summarize

        ecfg = self.config.eval
        t0 = time.perf_counter()
        n = len(self.gen_actors)
        shares = [(a, self.eval_indices[i::n]) for i, a in enumerate(self.gen_actors) if self.eval_indices[i::n]]
        futures = [
            a.submit("evaluate", ecfg.task, share, ecfg.num_samples, ecfg.seed, ecfg.correct_threshold, ecfg.greedy)
            for a, share in shares
        ]
        parts = await self._policy_call(asyncio.gather(*futures), "evaluate")
        out: dict[str, float] = {}
        for name, prefix, k in (("sampled", "eval/", ecfg.num_samples), ("greedy", "eval/greedy/", 1)):
            if name in parts[0]:
                samples = [s for p in parts for s in p[name][0]]
                drafted, accepted = sum(p[name][1] for p in parts), sum(p[name][2] for p in parts)
                out.update(summarize(samples, k, [1, *ecfg.ks, k], prefix, drafted, accepted))
        out["timing/eval_s"] = time.perf_counter() - t0
        return out

    # =============== rollouts: generate what the schedule allows, deliver it to the buffer
    async def _rollout_pump(self, actor) -> None:
        cfg = self.config
        sched = self.schedule
        while True:
            nxt = sched.next_unclaimed()
            if self._stop.is_set() and sched.step_of(nxt) > self.step:
                return  # stopping: only the open step's prompts are still needed
            # generate for step s only with weights the sampler will accept (no wasted work);
            # past the last step, wait: an eviction may hand a prompt back. schedule.mode=sync runs at
            # max_staleness 0: step s + 1 waits for the weights its step s trained
            if not sched.may_generate(nxt, self.synced_version):
                await self._wake.wait()
                continue
            indices = sched.claim(cfg.schedule.generation_groups_per_call)
            if not indices:
                await asyncio.sleep(0.01)
                continue
            t0 = time.perf_counter()
            sched.started(indices, t0)
            streamed: dict[int, concurrent.futures.Future] = {}  # groups delivered while the call ran
            try:
                groups, metrics = await self._generate(actor, indices, streamed)
            except BaseException:
                sched.release(indices)
                raise
            finally:
                sched.finished(indices)
            t1 = time.perf_counter()
            self.gen_intervals.append((t0, t1))
            self.rollout_acc.append(metrics)
            await self._deliver([g for g in groups if g.prompt_index not in streamed])
            if streamed:
                await asyncio.gather(*(asyncio.wrap_future(f) for f in streamed.values()))

    async def _generate(self, actor, indices: list[int], streamed: dict) -> tuple[list[Group], dict]:
        """One generation call for ``indices``: its groups not yet delivered and its metrics.

        Under ``schedule.mode: async`` each group is handed over as soon as its last sample finishes
        (the train pump's chunks stream from them): an in-process worker calls ``on_group`` on its
        thread (the delivery's future lands in ``streamed``), a Ray worker yields the group from a
        streaming call. ``schedule.mode: sync`` takes them with the call: the step trains only once
        every generation call of it returned.
        """
        cfg = self.config
        on_group = None
        if getattr(actor, "in_process", False) and cfg.schedule.mode == "async":
            loop = asyncio.get_running_loop()

            def on_group(group: Group) -> None:  # on the worker's thread
                streamed[group.prompt_index] = asyncio.run_coroutine_threadsafe(self._deliver([group]), loop)

        if cfg.schedule.mode == "async" and hasattr(actor, "stream"):
            groups, metrics = [], {}
            async for item in actor.stream("generate_groups_stream", indices, cfg.schedule.group_size):
                if isinstance(item, Group):
                    await self._deliver([item])  # back-pressure holds this loop, not the worker
                else:
                    metrics = item
            return groups, metrics
        return await actor.call("generate_groups", indices, cfg.schedule.group_size, on_group)

    async def _deliver(self, groups: list[Group]) -> None:
        """Put generated groups into the buffer, waiting for room (back-pressure). Until a group
        is in the buffer it is *pending*: its index stays in flight (no pump claims it again) and
        checkpoints save it with its tensors."""
        self.schedule.generated(groups)
        for g in groups:
            await self.buffer.put(g)
            # no await between the put and this bookkeeping: a checkpoint sees the group in
            # exactly one place
            self.schedule.buffered(g)

    def _on_evict(self, group: Group) -> None:
        """A stale group left the buffer: free its tensors and generate its prompt again, so that
        no prompt of the schedule is lost and the last step does not wait for it forever."""
        self.data_plane.delete(group.sample_ids)
        self.schedule.evicted(group.prompt_index)
        self._wake_pumps()

    def _wake_pumps(self) -> None:
        """Wake every rollout pump waiting for work (new weights, a requeued prompt, stop)."""
        self._wake.set()
        self._wake = asyncio.Event()

    # ============================================== set-up, restore and checkpoint content
    def _start_cluster(self) -> None:
        """Start a local Ray cluster or join the configured one (:func:`~splitrl.controller.cluster.start_cluster`)."""
        start_cluster(self.config, self.backend)

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
            "x %d samples), then training",
            time.perf_counter() - t_ready,
            start + 1,
            cfg.schedule.groups_per_step,
            cfg.schedule.group_size,
        )
        if not cfg.checkpoint.resume or start == 0:
            # once the workers are up (a failed start leaves the earlier run in place), before the
            # logger, which would start a fresh metrics.jsonl over the earlier one. With no checkpoint
            # to resume from, an earlier record (a run that stopped before its first checkpoint, or
            # another tool's steps) is set aside too: the logger dropped its lines (a new user's trial)
            dest, moved = set_aside_earlier_run(self.out)
            if dest is not None:
                why = (
                    "checkpoint.resume=false: starting over"
                    if not cfg.checkpoint.resume
                    else "no checkpoint to resume from: starting at step 1"
                )
                log.warning(
                    "%s in %s; the earlier run's %s moved to %s (delete it to free the space)",
                    why,
                    self.out,
                    ", ".join(moved),
                    dest,
                )
        self.logger = MetricsLogger(self.out, cfg.schedule.num_steps, start_step=start + 1, config=cfg.logging)
        self.logger.save_config(cfg)
        return start

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

    # ==================================================== watchdog, stop signals, shutdown
    async def _policy_call(self, coro, what: str):
        try:
            return await asyncio.wait_for(coro, timeout=self.config.faults.watchdog_timeout_s)
        except asyncio.TimeoutError:
            raise StallError(
                f"watchdog: {what} did not return within {self.config.faults.watchdog_timeout_s:.0f}s at step "
                f"{self.step}; "
                "a train worker is hung (e.g. inside a collective). Restart the run: it resumes from the last checkpoint."
            ) from None

    def _stall_report(self, what: str) -> str:
        """Why the train pump waited in vain, from where every prompt of the schedule is."""
        cfg = self.config
        sched = self.schedule
        head = (
            f"watchdog: waited {cfg.faults.watchdog_timeout_s:.0f}s for {what} at step {self.step + 1} "
            f"(policy version {self.version}, synced {self.synced_version}); buffer holds {self.buffer.size} groups, "
            f"{len(sched.pending)} generated groups wait for buffer room, {len(sched.generating)} prompts are being generated."
        )
        return head + sched.diagnosis(time.perf_counter(), self.synced_version)

    def _on_interrupt(self, sig: int = signal.SIGINT) -> None:
        """SIGINT (Ctrl-C) and SIGTERM (schedulers, containers): the first finishes the open step,
        writes a checkpoint and stops; a second one exits at once (exit code 128 + signal) without
        a checkpoint — the previous checkpoint stays intact (they are written atomically)."""
        name = signal.Signals(sig).name
        if self._interrupted and time.monotonic() - self._interrupted_at < SIGNAL_ECHO_S:
            # one signal delivered twice (`timeout` signals the process and its group; a terminal
            # Ctrl-C reaches every process of the group): not the user asking again
            log.debug("%s again within %.1f s of the first: taken as the same signal", name, SIGNAL_ECHO_S)
            return
        if self._interrupted:
            log.error("%s again: exiting now without a checkpoint (rerun to resume from the last one)", name)
            flush_console()
            os._exit(128 + int(sig))
        log.warning(
            "%s: finishing the current step, saving a checkpoint and stopping (send it again to exit at once)", name
        )
        self._interrupted = True
        self._interrupted_at = time.monotonic()
        self._interrupt_signal = int(sig)
        self._stop.set()
        self._wake_pumps()

    def _shutdown(self) -> None:
        workers = [*getattr(self, "gen_actors", []), *getattr(self, "train_actors", [])]
        shutdown(workers, getattr(self, "data_plane", None), getattr(self, "placement_group", None))


def train(config: RunConfig) -> RunResult:
    """Run GRPO as the config says; blocks until done. The CLI's ``splitrl train`` calls this."""
    return asyncio.run(SingleController(config).run())
