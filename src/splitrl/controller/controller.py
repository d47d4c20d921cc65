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

What this module keeps is the loop (``_train_pump`` → ``_run_step`` → ``_train_step``, and
``_rollout_pump``); its parts live beside it: set-up, restore, supervision, the watchdog and
shutdown (:mod:`.run_control`, the controller's base class), where each prompt is
(:mod:`.prompt_schedule`), the calls to the generation workers (:mod:`.generation_calls`), the
checkpoint lifecycle (:mod:`.checkpointer`), the weight-sync path (:mod:`.weight_sync_path`), a
step's metrics (:mod:`.step_metrics`), Ray start-up, signals and shutdown (:mod:`.cluster`),
starting the workers (:mod:`.launch`), the checks before anything starts (:mod:`.preflight`); the
workers themselves are :mod:`splitrl.workers`.
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
from splitrl.controller.buffer import ReplayBuffer, StepComposer  # noqa: F401 - ReplayBuffer re-exported
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
from splitrl.controller.generation_calls import evaluate_heldout, generate
from splitrl.controller.health import RunHealth
from splitrl.controller.preflight import (  # noqa: F401 - re-exported
    latest_checkpoint,
    nothing_to_do,
    preflight,
    settings_without_effect,
)
from splitrl.controller.prompt_schedule import PromptSchedule, arrived_first, strategy_of  # noqa: F401 - re-exported
from splitrl.controller.run_checkpoint import CheckpointError, RunDirLock, remove_leftovers  # noqa: F401 - re-exported
from splitrl.controller.run_control import RunControl, StallError  # noqa: F401 - StallError re-exported
from splitrl.controller.step_metrics import StepRecorder
from splitrl.controller.weight_sync_path import push_weights
from splitrl.eval_config import plan_eval
from splitrl.loss.advantages import compute_group_advantages
from splitrl.types import Group

log = logging.getLogger(__name__)


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


class SingleController(RunControl):
    """Runs one GRPO training run described by a :class:`RunConfig`.

    ``run`` checks the config (preflight), starts the cluster and the workers, then runs one train
    pump (``_train_pump``: step, weight sync, log, checkpoint) and one rollout pump per generation
    worker (``_rollout_pump``) until the last step or a stop. Set-up, restore, supervision, the
    watchdog and shutdown are its base class's (:class:`~splitrl.controller.run_control.RunControl`).
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
        self.record = StepRecorder()  # what the pumps record between two steps' metrics
        # fp16 loss scaling: the step's expected valid tokens, then the last step's
        self.expected_tokens = max(
            1, config.schedule.groups_per_step * config.schedule.group_size * config.rollout.max_new_tokens // 2
        )
        self.history: list[dict[str, float]] = []
        self.stopped_early = False
        # what a checkpoint holds is written by _write_checkpoint (looked up at each call)
        self.checkpointer = RunCheckpointer(
            config, self.out, self._stop,
            lambda step, tmp, export, blocking: self._write_checkpoint(step, tmp, export=export, blocking=blocking),
        )  # fmt: skip
        buf = config.buffer
        strategy = strategy_of(buf.max_staleness, config.schedule.chunk_order, config.schedule.mode)
        self.schedule = PromptSchedule(
            config.schedule.groups_per_step, config.schedule.num_steps, buf.max_staleness, strategy
        )

    # ============================================= run: start up, run the pumps, wind down
    async def run(self) -> RunResult:
        cfg = self.config
        done_before = preflight(cfg)
        self.eval_indices = plan_eval(cfg) if cfg.eval.enabled else []  # raises before anything starts
        log.log(*cfg.off_policy_summary())
        self.health = RunHealth(cfg.reward.timeout_s, loss_scaling=cfg.train.precision == "fp16")
        if nothing_to_do(cfg, done_before):
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
            await self._wind_down([trainer, *pumps], loop)
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
            # a checkpoint whose files failed in the background (a full disk) stops the run here,
            # one step after the failure at most, not at the next checkpoint
            await self.checkpointer.check_background_write()
            self.step = step
            t0 = time.perf_counter()
            train_metrics, groups = await self._run_step(step)
            self.version += 1
            sync_s = await self._sync_weights()
            # held-out evaluation with the weights just synced, queued on the generation workers
            # before the rollout pumps resume: training waits for the evaluation only
            eval_metrics = {}
            if cfg.eval.due(step + 1, cfg.schedule.num_steps):
                eval_metrics = await evaluate_heldout(self.gen_actors, cfg.eval, self.eval_indices, self._policy_call)
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
        received: list[Group] = []  # the step's groups so far: a retry trains them again first
        attempt = 0
        while True:
            composer.start_step()
            try:
                return await self._train_step(step, composer, received)
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
                    "step %d failed (%s: %s); retrying (%d/%d)", step + 1, type(e).__name__, e, attempt, cfg.faults.max_step_retries
                )  # fmt: skip

    async def _train_step(
        self, step: int, composer: StepComposer, received: list[Group]
    ) -> tuple[dict[str, float], list[Group]]:
        """One attempt at a step: begin, then chunk by chunk the next groups, their advantages and
        ``train_microbatch``, then finish. The groups taken are added to ``received``."""
        cfg = self.config
        train_intervals = []
        if cfg.schedule.mode == "sync":
            # the plain loop: the whole step is generated before any of it trains (the
            # chunks below are then those of async at max_staleness 0, already held)
            t = time.perf_counter()
            await self._hold(self.schedule.step_prompts(step))
            self.record.wait_s += time.perf_counter() - t
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
                t = time.perf_counter()
                groups = await self._wait_groups(n)
                self.record.wait_s += time.perf_counter() - t
                received.extend(groups)
            compute_group_advantages(groups, cfg.advantage)
            t = time.perf_counter()
            await self._policy_call(self.policy.train_chunk(groups), "train_microbatch")
            train_intervals.append((t, time.perf_counter()))
            composer.add_chunk(groups)
        t = time.perf_counter()
        metrics = await self._policy_call(self.policy.finish(), "finish_train_step")
        train_intervals.append((t, time.perf_counter()))
        self.record.train_intervals = train_intervals
        return metrics, composer.finish_step()

    async def _wait_groups(self, n: int) -> list[Group]:
        """The next chunk's groups (at most ``n``), as the schedule's strategy takes them."""
        cfg = self.config
        if self.schedule.strategy == "staleness":
            ok = await self.buffer.wait_ready(
                min(n, cfg.schedule.min_groups_per_chunk),
                timeout=cfg.faults.watchdog_timeout_s,
                current_version=self.version,
            )
            if not ok:
                raise StallError(self._stall_report(f"{n} groups"))
            groups = self.buffer.select(
                self.version, max_groups=n, min_groups=min(n, cfg.schedule.min_groups_per_chunk)
            )
        else:
            # max_staleness 0: the step's own prompts, in prompt order (deterministic) or in the
            # order their groups arrive (schedule.chunk_order=arrival)
            await self._hold(*self.schedule.wanted(n, self.step))
            groups = self.schedule.take(n, self.step)
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

    def _step_metrics(
        self, train: dict[str, float], groups: list[Group], step_s: float, sync_s: float
    ) -> dict[str, float]:
        """The step's record (:mod:`.step_metrics`); what the pumps recorded since the last step starts afresh."""
        return self.record.take_metrics(
            train, groups, speculative=self.config.rollout.speculative, buffer=self.buffer, version=self.version,
            draft_vocab=self.config.rollout.draft_vocab_size is not None,
            # written after the previous step's metrics were logged: reported with this step's
            checkpoint_s=self.checkpointer.take_blocked_s(), step_s=step_s, sync_s=sync_s,
        )  # fmt: skip

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
                groups, metrics = await generate(actor, indices, cfg, self._deliver, streamed)
            except BaseException:
                sched.release(indices)
                raise
            finally:
                sched.finished(indices)
            self.record.generation_call(t0, time.perf_counter(), metrics)
            await self._deliver([g for g in groups if g.prompt_index not in streamed])
            if streamed:
                await asyncio.gather(*(asyncio.wrap_future(f) for f in streamed.values()))

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

    # ================================================================= stop signals
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


def train(config: RunConfig) -> RunResult:
    """Run GRPO as the config says; blocks until done. The CLI's ``splitrl train`` calls this."""
    return asyncio.run(SingleController(config).run())
