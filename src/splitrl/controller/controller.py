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
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from splitrl.config import RunConfig
from splitrl.controller.actors import spawn
from splitrl.controller.advantages import advantage_metrics, compute_group_advantages
from splitrl.controller.buffer import ReplayBuffer, StepComposer, staleness_metrics
from splitrl.controller.generation import GenerationWorker, load_tokenizer
from splitrl.controller.policy_client import PolicyClient
from splitrl.controller.train_actor import TOKEN_FIELDS, TrainActor
from splitrl.dataplane import DataPlaneConfig, make_data_plane
from splitrl.eval_config import plan_eval
from splitrl.logging import MetricsLogger
from splitrl.models.hf_files import write_inference_files
from splitrl.types import Group

log = logging.getLogger(__name__)


RUN_CONFIG = "run_config.json"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoint directories of a run, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / "COMPLETE").exists())


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory of a run, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def preflight(config: RunConfig) -> int:
    """Checks that need more than the config's own fields, run before any worker starts.

    Builds the task (a data file that is missing or lacks its columns fails here), checks that
    a character tokenizer covers the task's prompts, and, when resuming, that the checkpoint was
    written by the same model. Returns the step to resume from (0: a fresh run).

    Raises:
        ValueError: naming what to fix.
    """
    from splitrl.controller.generation import load_tokenizer
    from splitrl.tasks import encode_prompt, make_task

    task = make_task(config.task)
    tok = load_tokenizer(config.tokenizer, config.model.pretrained_path)
    encode_prompt(task.get_prompt(0), tok, task.config.chat_template)  # task.chat_template=true needs a template
    if config.tokenizer.kind == "char":
        unk = tok.unk_token_id
        n = task.num_prompts or 64
        for i in range(min(64, n)):
            p = task.get_prompt(i)
            if unk in encode_prompt(p, tok, task.config.chat_template) or unk in tok(p.answer, add_special_tokens=False)["input_ids"]:
                missing = sorted(set(p.text + p.answer) - set(tok.convert_ids_to_tokens(range(len(tok)))))
                raise ValueError(
                    f"the character tokenizer cannot spell prompt {i} of the task ({p.text!r}): characters "
                    f"{missing} are not in tokenizer.charset; widen tokenizer.charset (null = all printable "
                    "ASCII, then model.backbone.vocab_size >= 100) or use tokenizer.kind=pretrained"
                )
    ckpt = latest_checkpoint(config.output_dir) if config.resume else None
    if ckpt is None:
        return 0
    saved_path = ckpt / RUN_CONFIG
    if saved_path.exists():
        saved = json.loads(saved_path.read_text())
        now = config.model_dump(mode="json")
        if saved.get("model") != now["model"]:
            raise ValueError(
                f"{ckpt} was written by a different model config than this run's; resume needs the same "
                "model. Use a new output_dir, or resume=false to start over in this one"
            )
    return int(json.loads((ckpt / "COMPLETE").read_text())["step"])


class StallError(RuntimeError):
    """Nothing progressed for ``watchdog_timeout_s``; the message says what was waited on."""


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve_backend(config: RunConfig) -> str:
    if config.backend != "auto":
        return config.backend
    try:
        import ray  # noqa: F401

        return "ray"
    except ImportError:
        return "local"


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total = 0.0
    for s1, e1 in a:
        for s2, e2 in b:
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


class SingleController:
    """Runs one GRPO training run described by a :class:`RunConfig`."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.out = Path(config.output_dir)
        self.backend = _resolve_backend(config)
        self.device = config.device
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._stop = asyncio.Event()
        self._interrupted = False

    # ============================================================================== set-up
    def _start_cluster(self) -> None:
        if self.backend != "ray":
            return
        import ray

        if not ray.is_initialized():
            src = str(Path(__file__).resolve().parents[2])
            # transferqueue's controller and storage units ask for a CPU each: give Ray logical
            # CPUs beyond the physical ones (FINDINGS.md), or it waits forever
            need = self.config.num_generation_workers + self.config.num_train_workers + 4
            log.info("start-up: starting a local Ray cluster")
            ray.init(
                num_cpus=max(8, need),
                include_dashboard=False,
                log_to_driver=True,
                runtime_env={
                    "env_vars": {
                        "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
                        # TransferQueue caps its (de)serialization threads at this and warns on
                        # every call when it exceeds the physical cores
                        "TQ_NUM_THREADS": str(min(8, os.cpu_count() or 1)),
                    }
                },
            )

    def _build(self) -> None:
        cfg = self.config
        dp_cfg = cfg.dataplane if self.backend == "ray" else DataPlaneConfig(kind="inprocess")
        log.info("start-up: starting the %s data plane", dp_cfg.kind)
        self.data_plane = make_data_plane(dp_cfg)
        log.info(
            "start-up: starting %d train worker(s) and %d generation worker(s) on %s; each imports torch and "
            "builds the model", cfg.num_train_workers, cfg.num_generation_workers, self.device,
        )
        train_cfg = cfg.train.model_copy(update={"device": self.device})
        world = cfg.num_train_workers
        port = _free_port()
        gpu = self.device == "cuda"
        self.train_actors = [
            spawn(
                TrainActor,
                cfg.model,
                train_cfg,
                cfg.loss,
                self.data_plane,
                rank=r,
                world_size=world,
                master_port=port,
                torch_threads=cfg.torch_threads,
                backend=self.backend,
                ray_options={"num_cpus": 1, "num_gpus": 1 if gpu else 0},
            )
            for r in range(world)
        ]
        self.policy = PolicyClient(self.train_actors)
        self.gen_actors = [
            spawn(
                GenerationWorker,
                cfg.model,
                cfg.rollout,
                cfg.task,
                cfg.tokenizer,
                self.data_plane,
                run_seed=cfg.seed,
                reward_timeout_s=cfg.reward_timeout_s,
                mask_truncated=cfg.mask_truncated,
                device=self.device,
                dtype=cfg.rollout_dtype,
                torch_threads=cfg.torch_threads,
                backend=self.backend,
                ray_options={"num_cpus": 1, "num_gpus": 0},
            )
            for _ in range(cfg.num_generation_workers)
        ]
        self.buffer = ReplayBuffer(cfg.buffer, on_evict=self._on_evict)
        self.tokenizer = load_tokenizer(cfg.tokenizer, cfg.model.pretrained_path)  # saved with checkpoints

    # ============================================================================ checkpoints
    async def _save_checkpoint(self, step: int) -> Path:
        t0 = time.perf_counter()
        path = self.out / "checkpoints" / f"step_{step:06d}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # a consistent snapshot of the controller side: no await between these reads
        buffer_state = self.buffer.state_dict()
        done = sorted(self.done_indices)
        buffered_ids = [s["sample_id"] for g in buffer_state["groups"] for s in g["samples"]]
        samples = self.data_plane.get(buffered_ids, TOKEN_FIELDS) if buffered_ids else {}
        trainer = await self.policy.state_dict()
        torch.save(trainer, tmp / "trainer.pt")
        await self.policy.save_pretrained(str(tmp / "policy"))
        write_inference_files(tmp / "policy", self.tokenizer, self.config.rollout, self.config.model.pretrained_path)
        torch.save(
            {
                "step": step,
                "version": self.version,
                "done_indices": done,
                "buffer": buffer_state,
                "buffered_ids": buffered_ids,
                "buffered_samples": samples,
                "expected_tokens": self.expected_tokens,
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            },
            tmp / "controller.pt",
        )
        (tmp / RUN_CONFIG).write_text(json.dumps(self.config.model_dump(mode="json"), indent=1))
        (tmp / "COMPLETE").write_text(json.dumps({"step": step}))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        for old in complete_checkpoints(self.out)[:-2]:  # keep the two newest
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint step %d written to %s in %.1fs", step, path, time.perf_counter() - t0)
        return path

    async def _restore(self) -> int:
        dirs = complete_checkpoints(self.out) if self.config.resume else []
        if not dirs:
            return 0
        path = dirs[-1]
        state = torch.load(path / "controller.pt", weights_only=False)
        await self.policy.load_state_dict(torch.load(path / "trainer.pt", weights_only=False))
        self.buffer.load_state_dict(state["buffer"])
        if state["buffered_ids"]:
            self.data_plane.put(state["buffered_ids"], state["buffered_samples"])
        self.done_indices = set(state["done_indices"])
        self.version = int(state["version"])
        self.expected_tokens = int(state.get("expected_tokens", self.expected_tokens))
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        log.info("resumed from %s (step %d)", path, state["step"])
        return int(state["step"])

    # ============================================================================ pumps
    def _claim(self, n: int) -> list[int]:
        """The next ``n`` prompt indices not yet done or in flight, all of one step."""
        G = self.config.groups_per_step
        out: list[int] = []
        i = self.cursor
        while len(out) < n:
            if i in self.done_indices or i in self.in_flight:
                if not out:
                    self.cursor = i + 1
                i += 1
                continue
            if out and i // G != out[0] // G:
                break
            if i // G >= self.config.num_steps:
                break
            out.append(i)
            i += 1
        for j in out:
            self.in_flight.add(j)
        return out

    def _wake_pumps(self) -> None:
        """Wake every rollout pump waiting for work (new weights, a requeued prompt, stop)."""
        self._wake.set()
        self._wake = asyncio.Event()

    def _on_evict(self, group: Group) -> None:
        """A stale group left the buffer: free its tensors and generate its prompt again, so that
        no prompt of the schedule is lost and the last step does not wait for it forever."""
        self.data_plane.delete(group.sample_ids)
        self.done_indices.discard(group.prompt_index)
        self.cursor = min(self.cursor, group.prompt_index)
        self._wake_pumps()

    async def _rollout_pump(self, actor) -> None:
        cfg = self.config
        G = cfg.groups_per_step
        while True:
            nxt = self.cursor
            while nxt in self.done_indices or nxt in self.in_flight:
                nxt += 1
            if self._stop.is_set() and nxt // G > self.step:
                return  # stopping: only the open step's prompts are still needed
            # generate for step s only with weights the sampler will accept (no wasted work);
            # past the last step, wait: an eviction may hand a prompt back
            need = nxt // G - cfg.buffer.max_staleness
            if nxt // G >= cfg.num_steps or self.synced_version < need:
                await self._wake.wait()
                continue
            indices = self._claim(cfg.generation_groups_per_call)
            if not indices:
                await asyncio.sleep(0.01)
                continue
            t0 = time.perf_counter()
            try:
                groups, metrics = await actor.call("generate_groups", indices, cfg.group_size)
            except BaseException:
                for j in indices:
                    self.in_flight.discard(j)
                raise
            t1 = time.perf_counter()
            self.gen_intervals.append((t0, t1))
            self.rollout_acc.append(metrics)
            for g in groups:
                await self.buffer.put(g)  # may wait for room: the index stays in flight meanwhile
                self.done_indices.add(g.prompt_index)
                self.in_flight.discard(g.prompt_index)

    async def _wait_groups(self, n: int) -> list[Group]:
        cfg = self.config
        t0 = time.perf_counter()
        if cfg.buffer.max_staleness == 0:
            # deterministic: the step's own prompts, in prompt order
            want = list(range(self.next_index, self.next_index + n))
            while not all(i in self.held for i in want):
                ok = await self.buffer.wait_ready(1, timeout=cfg.watchdog_timeout_s, current_version=self.version)
                if not ok:
                    raise StallError(self._stall_report("rollouts for prompts " + str([i for i in want if i not in self.held])))
                for g in self.buffer.select(self.version, max_groups=max(1, self.buffer.size), min_groups=1):
                    self.held[g.prompt_index] = g
            groups = [self.held.pop(i) for i in want]
            self.next_index += n
        else:
            ok = await self.buffer.wait_ready(min(n, cfg.min_groups_per_chunk), timeout=cfg.watchdog_timeout_s, current_version=self.version)
            if not ok:
                raise StallError(self._stall_report(f"{n} groups"))
            groups = self.buffer.select(self.version, max_groups=n, min_groups=min(n, cfg.min_groups_per_chunk))
        self.wait_s += time.perf_counter() - t0
        return groups

    def _stall_report(self, what: str) -> str:
        return (
            f"watchdog: waited {self.config.watchdog_timeout_s:.0f}s for {what} at step {self.step} "
            f"(policy version {self.version}, synced {self.synced_version}); buffer holds {self.buffer.size} groups, "
            f"{len(self.in_flight)} prompts in flight. A generation worker may be hung or dead."
        )

    async def _policy_call(self, coro, what: str):
        try:
            return await asyncio.wait_for(coro, timeout=self.config.watchdog_timeout_s)
        except asyncio.TimeoutError:
            raise StallError(
                f"watchdog: {what} did not return within {self.config.watchdog_timeout_s:.0f}s at step {self.step}; "
                "a train worker is hung (e.g. inside a collective). Restart the run: it resumes from the last checkpoint."
            ) from None

    async def _run_step(self, step: int) -> tuple[dict[str, float], list[Group]]:
        """One optimizer step, streamed in chunks; retried per ``on_chunk_failure``."""
        cfg = self.config
        composer = StepComposer(cfg.groups_per_step, cfg.min_groups_per_chunk)
        received: list[Group] = []
        attempt = 0
        while True:
            composer.start_step()
            train_intervals = []
            try:
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
                        n = min(req.max_groups, cfg.min_groups_per_chunk) if cfg.buffer.max_staleness == 0 else req.max_groups
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
                    raise StepFailed(f"step {step + 1} failed ({type(e).__name__}: {e}) and abort failed too") from abort_error
                attempt += 1
                if cfg.on_chunk_failure == "stop" or attempt > cfg.max_step_retries:
                    raise StepFailed(f"step {step + 1} failed after {attempt} attempt(s): {type(e).__name__}: {e}") from e
                log.warning("step %d failed (%s: %s); retrying (%d/%d)", step + 1, type(e).__name__, e, attempt, cfg.max_step_retries)

    async def _sync_weights(self) -> float:
        t0 = time.perf_counter()
        # local backend: generation shares the process (and the GPU), so skip the trip through CPU
        sd = await self._policy_call(self.policy.policy_state_dict(to_cpu=self.backend == "ray"), "policy_state_dict")
        await asyncio.gather(*(a.call("load_weights", sd, self.version) for a in self.gen_actors))
        self.synced_version = self.version
        self._wake_pumps()
        return time.perf_counter() - t0

    def _step_metrics(self, train: dict[str, float], groups: list[Group], step_s: float, sync_s: float) -> dict[str, float]:
        out = {f"train/{k}" if not k.startswith("timing/") else k: v for k, v in train.items()}
        samples = [s for g in groups for s in g.samples]
        lengths = [s.response_len for s in samples]
        out.update({f"rollout/{k}": v for k, v in advantage_metrics(groups).items()})
        out["rollout/reward_mean"] = sum(s.reward for s in samples) / max(1, len(samples))
        out["train/reward"] = out["rollout/reward_mean"]
        out["rollout/response_length_mean"] = sum(lengths) / max(1, len(lengths))
        out["rollout/response_length_max"] = float(max(lengths, default=0))
        out["rollout/truncation_rate"] = sum(s.truncated for s in samples) / max(1, len(samples))
        out["rollout/reward_timeout_rate"] = sum(s.reward_timed_out for s in samples) / max(1, len(samples))
        acc = self.rollout_acc
        self.rollout_acc = []
        gen_tokens = sum(m["generated_tokens"] for m in acc)
        gen_s = sum(m["generation_s"] for m in acc)
        if gen_s > 0:
            out["rollout/tokens_per_s"] = gen_tokens / gen_s
        drafted = sum(m["drafted_tokens"] for m in acc)
        if drafted:
            out["rollout/acceptance_rate"] = 100.0 * sum(m["accepted_tokens"] for m in acc) / drafted
            out["rollout/speculative_active"] = float(acc[-1]["speculative_active"])
        out.update(staleness_metrics(groups, self.version - 1))  # keys carry their buffer/ prefix
        out["buffer/size"] = float(self.buffer.size)
        out["buffer/evicted_groups_total"] = float(self.buffer.num_evicted_groups)
        out["buffer/evicted_samples_total"] = float(self.buffer.num_evicted_samples)
        gen_intervals = self.gen_intervals
        self.gen_intervals = []
        out["timing/step_s"] = step_s
        out["timing/generation_s"] = sum(e - s for s, e in gen_intervals)
        out["timing/train_s"] = sum(e - s for s, e in self.train_intervals)
        out["timing/weight_sync_s"] = sync_s
        out["timing/exposed_wait_s"] = self.wait_s
        out["timing/generation_during_train_s"] = _overlap(gen_intervals, self.train_intervals)
        out["timing/policy_version"] = float(self.version)
        self.wait_s = 0.0
        return out

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
                out.update(summarize(samples, k, [*ecfg.ks, k], prefix, drafted, accepted))
        out["timing/eval_s"] = time.perf_counter() - t0
        return out

    async def _train_pump(self, start_step: int) -> None:
        cfg = self.config
        for step in range(start_step, cfg.num_steps):
            self.step = step
            t0 = time.perf_counter()
            train_metrics, groups = await self._run_step(step)
            self.version += 1
            sync_s = await self._sync_weights()
            # held-out evaluation with the weights just synced, queued on the generation workers
            # before the rollout pumps resume: training waits for the evaluation only
            eval_metrics = await self._evaluate() if cfg.eval.due(step + 1, cfg.num_steps) else {}
            self.data_plane.delete([s.sample_id for g in groups for s in g.samples])
            if train_metrics.get("num_valid_tokens", 0) > 0:
                self.expected_tokens = int(train_metrics["num_valid_tokens"])
            metrics = self._step_metrics(train_metrics, groups, time.perf_counter() - t0, sync_s)
            metrics.update(eval_metrics)
            self.logger.log(step + 1, metrics)
            self.history.append(metrics)
            done = step + 1
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.num_steps:
                await self._save_checkpoint(done)
            if self._stop.is_set():
                if done % max(1, cfg.checkpoint_every) != 0 and done != cfg.num_steps:
                    await self._save_checkpoint(done)
                self.stopped_early = done < cfg.num_steps
                return

    # ============================================================================ run
    async def run(self) -> RunResult:
        cfg = self.config
        done_before = preflight(cfg)
        self.eval_indices = plan_eval(cfg) if cfg.eval.enabled else []  # raises before anything starts
        if done_before >= cfg.num_steps:
            log.info("%s already holds a finished run (%d steps); nothing to do", self.out, done_before)
            return RunResult(str(self.out), done_before)
        self.out.mkdir(parents=True, exist_ok=True)
        self._start_cluster()
        self._build()
        self._wake = asyncio.Event()
        self.version = 0
        self.synced_version = -1
        self.done_indices: set[int] = set()
        self.in_flight: set[int] = set()
        self.held: dict[int, Group] = {}
        self.gen_intervals: list[tuple[float, float]] = []
        self.train_intervals: list[tuple[float, float]] = []
        self.rollout_acc: list[dict] = []
        self.wait_s = 0.0
        self.expected_tokens = max(1, cfg.groups_per_step * cfg.group_size * cfg.rollout.max_new_tokens // 2)
        self.history: list[dict[str, float]] = []
        self.stopped_early = False
        self.step = 0
        random.seed(cfg.seed)
        t_ready = time.perf_counter()
        log.info("start-up: waiting for the workers to load the model")
        start = await self._restore()
        self.cursor = start * cfg.groups_per_step
        self.next_index = start * cfg.groups_per_step
        await self._sync_weights()
        log.info(
            "start-up: workers ready and weights synced in %.1fs; generating the first rollouts (step %d: %d prompts "
            "x %d samples), then training",
            time.perf_counter() - t_ready, start + 1, cfg.groups_per_step, cfg.group_size,
        )
        self.logger = MetricsLogger(self.out, cfg.num_steps, start_step=start + 1, config=cfg.logging)
        self.logger.save_config(cfg)
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, self._on_interrupt)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
        pumps = [asyncio.create_task(self._rollout_pump(a)) for a in self.gen_actors]
        trainer = asyncio.create_task(self._train_pump(start))
        try:
            while True:
                done, _ = await asyncio.wait([trainer, *pumps], return_when=asyncio.FIRST_COMPLETED)
                if trainer in done:
                    trainer.result()
                    break
                for p in done:
                    if p.exception() is not None:
                        raise p.exception()
                pumps = [p for p in pumps if not p.done()]
                if not pumps:
                    await trainer
                    break
        finally:
            self._stop.set()
            self._wake_pumps()
            for t in [trainer, *pumps]:
                t.cancel()
            await asyncio.gather(trainer, *pumps, return_exceptions=True)
            try:
                loop.remove_signal_handler(signal.SIGINT)
            except (NotImplementedError, RuntimeError):
                pass
            self.logger.close()
            self._shutdown()
        return RunResult(
            str(self.out), start + len(self.history), self.history, self.stopped_early or self._interrupted, self._interrupted
        )

    def _on_interrupt(self) -> None:
        log.warning("Ctrl-C: finishing the current step, saving a checkpoint and stopping")
        self._interrupted = True
        self._stop.set()
        self._wake_pumps()

    def _shutdown(self) -> None:
        for a in [*getattr(self, "gen_actors", []), *getattr(self, "train_actors", [])]:
            try:
                a.kill()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        try:
            self.data_plane.close()
        except Exception:  # noqa: BLE001
            pass


def train(config: RunConfig) -> RunResult:
    """Run GRPO as the config says; blocks until done. The CLI's ``splitrl train`` calls this."""
    return asyncio.run(SingleController(config).run())
