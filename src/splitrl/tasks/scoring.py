"""Rewards with a time limit on every answer check (DESIGN.md §5).

Symbolic checkers can hang (math-verify on an adversarial expression) or crash. Each check runs
in a worker process that is killed when it passes its time limit; the check then scores 0 and
is reported as timed out, and a fresh worker takes its place. A check that raises scores 0 and
reports the exception. Nothing a scorer does can stop the caller or poison later checks.

Why processes and not math-verify's own timeout: that one is ``signal.alarm`` — main thread only
(generation workers may score from other threads), whole seconds, unable to interrupt C code, and
it reports a timeout as a wrong answer, so timeouts could not be counted.

Workers are started with ``spawn`` (safe next to threads, CUDA and Ray) and the task travels as
its config (``Task.__reduce__``), so starting one costs an interpreter start plus the task's
imports (about 1-2 s on the CPU machine). Keep a :class:`RewardScorer` for the life of a
generation worker; :func:`compute_rewards` starts and stops one per call.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import pickle
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from splitrl.tasks.base import Task, TaskPrompt


@dataclass(frozen=True)
class RewardResult:
    """Outcome of one answer check.

    Attributes:
        reward: the task's score in [0, 1]; 0.0 when the check timed out or failed.
        timed_out: True when the check ran past its time limit and was killed.
        error: why the check failed (exception type and message, an out-of-range score, a
            crashed worker, the time limit), or None when it succeeded.
    """

    reward: float
    timed_out: bool = False
    error: str | None = None


class RewardScorer:
    """Scores responses of one task in ``num_workers`` processes, each check limited in time.

    Not thread-safe: call :meth:`score` from one thread at a time. Close it (or use it as a
    context manager) to stop the worker processes; they are daemons and also end with the
    calling process.

    Args:
        task: the task whose ``score`` is called; it must pickle (tasks built by
            :func:`splitrl.tasks.make_task` do).
        timeout_s: time limit of one check in seconds, measured from handing the response to a
            worker that is ready (worker start-up does not count).
        num_workers: processes checking in parallel.
        startup_timeout_s: how long a worker may take to start and rebuild the task.

    Raises:
        ValueError: if ``timeout_s <= 0``, ``num_workers < 1`` or the task cannot be pickled.
    """

    def __init__(
        self,
        task: Task,
        timeout_s: float,
        num_workers: int = 1,
        startup_timeout_s: float = 120.0,
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        try:
            self._task_bytes = pickle.dumps(task)
        except Exception as exc:
            raise ValueError(
                f"the task cannot be pickled for the scoring processes: {exc}. Define the task "
                "class at module level and keep unpicklable state out of it"
            ) from exc
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self.startup_timeout_s = startup_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []

    def start(self) -> None:
        """Start the worker processes and block until each has built the task.

        Raises:
            RuntimeError: if a worker fails to build the task or to start in time.
        """
        self._top_up()
        while not all(w.ready for w in self._workers):
            self._wait_and_collect([])

    def score(self, prompts: Sequence[TaskPrompt], responses: Sequence[str]) -> list[RewardResult]:
        """Score ``responses[i]`` against ``prompts[i]`` for every i, in parallel.

        Returns:
            One :class:`RewardResult` per response, in input order.

        Raises:
            ValueError: if the two sequences differ in length.
            RuntimeError: if a worker cannot build the task (the cause is in the message).
        """
        if len(prompts) != len(responses):
            raise ValueError(
                f"got {len(prompts)} prompts and {len(responses)} responses; pass one prompt "
                "per response (repeat a group's prompt for each of its samples)"
            )
        results: list[RewardResult | None] = [None] * len(prompts)
        pending = deque(range(len(prompts)))
        if pending:
            self._top_up()
        try:
            while pending or any(w.item is not None for w in self._workers):
                for worker in self._workers:
                    if worker.ready and worker.item is None and pending:
                        worker.assign(pending.popleft(), prompts, responses, self.timeout_s)
                self._wait_and_collect(results)
        except BaseException:
            # An interrupted call leaves checks in flight whose answers would be read as answers
            # to the next call's checks: drop those workers.
            self.close()
            raise
        return results  # type: ignore[return-value]  # every slot is filled by now

    def close(self) -> None:
        """Stop the worker processes (idempotent); a later :meth:`score` starts new ones."""
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _top_up(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._context, self._task_bytes))

    def _wait_and_collect(self, results: list) -> None:
        """Wait for the next message or deadline; record results and replace lost workers."""
        waiting = [w for w in self._workers if not w.ready or w.item is not None]
        deadlines = [w.deadline(self.startup_timeout_s) for w in waiting]
        timeout = max(0.0, min(deadlines) - time.monotonic())
        answered = wait([w.conn for w in waiting], timeout=timeout)
        for worker, deadline in zip(waiting, deadlines):
            if worker.conn in answered:
                self._receive(worker, results)
            elif time.monotonic() >= deadline:
                if not worker.ready:
                    self.close()
                    raise RuntimeError(
                        f"a scoring process did not start within {self.startup_timeout_s} s"
                    )
                results[worker.item] = RewardResult(
                    0.0, timed_out=True, error=f"check exceeded the {self.timeout_s} s limit"
                )
                self._replace(worker)

    def _receive(self, worker: _Worker, results: list) -> None:
        try:
            kind, value = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=5.0)
            code = worker.process.exitcode
            if not worker.ready:
                self.close()
                raise RuntimeError(f"a scoring process exited while starting (exit code {code})")
            results[worker.item] = RewardResult(
                0.0, error=f"scoring process died during the check (exit code {code})"
            )
            self._replace(worker)
            return
        if kind == "ready":
            worker.ready = True
        elif kind == "init_error":
            self.close()
            raise RuntimeError(f"a scoring process could not build the task: {value}")
        else:
            results[worker.item] = _result_of(kind, value)
            worker.item = None

    def _replace(self, worker: _Worker) -> None:
        worker.stop(graceful=False)
        self._workers[self._workers.index(worker)] = _Worker(self._context, self._task_bytes)


def compute_rewards(
    task: Task,
    prompts: Sequence[TaskPrompt],
    responses: Sequence[str],
    timeout_s: float,
    num_workers: int = 1,
) -> list[RewardResult]:
    """Score each response with a time limit per check; starts and stops its own workers.

    See :class:`RewardScorer` for the arguments and errors; keep a scorer instead when scoring
    repeatedly, since starting workers costs about a second or two.
    """
    with RewardScorer(task, timeout_s, num_workers=num_workers) as scorer:
        return scorer.score(prompts, responses)


def _result_of(kind: str, value: object) -> RewardResult:
    if kind == "error":
        return RewardResult(0.0, error=str(value))
    reward = float(value)  # type: ignore[arg-type]  # the worker sent a float
    if not (math.isfinite(reward) and 0.0 <= reward <= 1.0):
        return RewardResult(0.0, error=f"the task's score returned {reward!r}, outside [0, 1]")
    return RewardResult(reward)


class _Worker:
    """One scoring process and its end of the pipe; ``item`` is the response it is checking."""

    def __init__(self, context, task_bytes: bytes):
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=_worker_main, args=(child_conn, task_bytes), daemon=True
        )
        self.process.start()
        child_conn.close()
        self.ready = False
        self.started_at = time.monotonic()
        self.item: int | None = None
        self.item_deadline = 0.0

    def assign(self, item: int, prompts, responses, timeout_s: float) -> None:
        self.conn.send((prompts[item], responses[item]))
        self.item = item
        self.item_deadline = time.monotonic() + timeout_s

    def deadline(self, startup_timeout_s: float) -> float:
        return self.item_deadline if self.ready else self.started_at + startup_timeout_s

    def stop(self, graceful: bool = True) -> None:
        if graceful and self.item is None:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def _worker_main(conn: Connection, task_bytes: bytes) -> None:
    # A terminal's Ctrl-C reaches this process too (the whole foreground process group gets it);
    # dying here would score the checks in flight 0 while the run finishes its step. The parent
    # owns the shutdown: it closes the pipe or kills this process. (SIGTERM stays: multiprocessing
    # ends daemonic children with it at exit.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # This process enforces no limit itself (the parent kills it), so math-verify's warning
    # that its own signal-based timeout is off is noise here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        task = pickle.loads(task_bytes)
    except Exception as exc:
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        prompt, response = message
        try:
            conn.send(("ok", float(task.score(prompt, response))))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
