"""The run's checkpoint lifecycle (DESIGN §4 "restorable"): save, complete, prune, restore.

A checkpoint is written into ``step_N.tmp/`` while training is blocked as briefly as possible
(the controller writes its own small state and the train ranks stage their shards in CPU memory),
completed in the background (``COMPLETE`` with the checksums of every file, then renamed into
place), and pruned to the two newest plus the newest Hugging Face export. A checkpoint holds
the trainer's shards, an optional Hugging Face ``policy/``, the controller's state (the replay
buffer with its samples' tensors, the prompt schedule's books, the policy version, the RNGs) and
the run config; a resume restores all of it. The directory layout and its integrity checks are
:mod:`splitrl.controller.run_checkpoint`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from splitrl.config import RunConfig
from splitrl.controller.buffer import group_from_dict, group_to_dict
from splitrl.controller.run_checkpoint import (
    CONTROLLER_STATE,
    KEPT_CHECKPOINTS,
    RUN_CONFIG,
    TMP_SUFFIX,
    CheckpointError,
    complete_checkpoints,
    format_bytes,
    intact_checkpoints,
    known_damaged,
    latest_intact_checkpoint,
    mark_damaged,
    set_aside_earlier_run,
    step_dir,
    write_complete,
)
from splitrl.models.hf_files import write_inference_files
from splitrl.train.checkpoint import SHARDS_DIR, os_error_in
from splitrl.types import Group
from splitrl.workers.train_actor import TOKEN_FIELDS

# the run's progress, checkpoints included, is told by the controller's logger (users and tests follow it)
log = logging.getLogger("splitrl.controller.controller")

LEGACY_TRAINER_FILE = "trainer.pt"  # the whole trainer state in one file (checkpoints before sharded ones)
# how often the controller asks whether a checkpoint's background writes are done
CHECKPOINT_POLL_S = 0.2

WriteFiles = Callable[..., Awaitable[float]]


@dataclass
class Restored:
    """What a restored checkpoint hands back to the controller."""

    step: int  # steps done
    version: int  # the trainer's policy version
    expected_tokens: int | None  # fp16 loss scaling's expected tokens (None: a checkpoint without)
    pending: list[Group]  # accepted groups that were in no buffer: the controller delivers them again


class RunCheckpointer:
    """Saves, completes, prunes and restores the checkpoints of one run in ``out``.

    Args:
        config: the run's config (``num_steps``, ``export_every``, ``rollout``, ``model``).
        out: the run's output directory.
        stop: set when the run stops early: the checkpoint then is its last one, waited for whole.
        write_files: ``await write_files(step, tmp, export=..., blocking=...)`` writes a
            checkpoint's files into ``tmp`` (all but ``COMPLETE``) and returns the seconds the
            train ranks blocked to stage their shards: the controller's hook, which calls
            :meth:`write` with its policy version.
    """

    def __init__(self, config: RunConfig, out: Path, stop: asyncio.Event, write_files: WriteFiles) -> None:
        self.config = config
        self.out = out
        self._stop = stop
        self._write_files = write_files
        # the run's parts whose state a checkpoint holds, attached once the workers are up
        self.policy: Any = None  # the train workers' PolicyClient
        self.buffer: Any = None
        self.schedule: Any = None
        self.data_plane: Any = None
        self.tokenizer: Any = None  # saved with the Hugging Face export
        self._pending: asyncio.Task | None = None  # finishes a checkpoint written in the background
        # what the train ranks last said of the pending checkpoint's files: None (still being
        # written, or not asked), True (on disk) or their write's error; asked by one caller at a time
        self._written: bool | Exception | None = None
        self._ask = asyncio.Lock()
        self.blocked_s = 0.0  # training blocked by checkpoints since the last step's metrics

    def attach(self, policy: Any, buffer: Any, schedule: Any, data_plane: Any, tokenizer: Any) -> None:
        """The run's parts, once its workers are up: the train workers' client, the replay buffer,
        the prompt schedule, the data plane (the buffered samples' tensors) and the tokenizer."""
        self.policy, self.buffer, self.schedule, self.data_plane, self.tokenizer = (
            policy, buffer, schedule, data_plane, tokenizer,
        )  # fmt: skip

    def set_aside_earlier_run(self) -> None:
        """A run that starts at step 1 (``checkpoint.resume=false``, or nothing to resume): move an earlier
        run's record in ``out`` to ``earlier_runs/`` (:func:`~splitrl.controller.run_checkpoint.set_aside_earlier_run`),
        saying where."""
        dest, moved = set_aside_earlier_run(self.out)
        if dest is not None:
            why = (
                "checkpoint.resume=false: starting over"
                if not self.config.checkpoint.resume
                else "no checkpoint to resume from: starting at step 1"
            )
            log.warning(
                "%s in %s; the earlier run's %s moved to %s (delete it to free the space)",
                why, self.out, ", ".join(moved), dest,
            )  # fmt: skip

    def take_blocked_s(self) -> float:
        """The seconds training was blocked by checkpoints since the last call."""
        out, self.blocked_s = self.blocked_s, 0.0
        return out

    async def save(self, step: int) -> Path:
        """Write the run's state at ``step`` (see :mod:`splitrl.controller.run_checkpoint`).

        Training is blocked only while the previous checkpoint is finished (when it is still
        being written), the train ranks copy their shards into CPU memory and the controller
        writes its own small state; the shard files are then written in the background, and a
        background task writes ``COMPLETE`` (with the checksums of the files on disk) and renames
        the directory into place once every rank's files are written. The last checkpoint of a
        run (the end, a stop) is waited for whole; a Hugging Face export (``checkpoint.export_every``, and
        the last checkpoint) blocks while it is gathered and written. The blocking time is logged
        and reported as ``timing/checkpoint_s`` with the next step's metrics.

        Raises:
            CheckpointError: this write (or the previous checkpoint's background write) failed
                (a full disk, permissions); the partial checkpoint is removed and the previous
                complete ones are untouched.
        """
        cfg = self.config
        t0 = time.perf_counter()
        await self.finish_pending()
        waited = time.perf_counter() - t0
        final = step >= cfg.schedule.num_steps or self._stop.is_set()
        export = final or bool(cfg.checkpoint.export_every and step % cfg.checkpoint.export_every == 0)
        path = step_dir(self.out, step)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        try:
            staged_s = await self._write_files(step, tmp, export=export, blocking=final)
        except Exception as e:  # noqa: BLE001 - every writer's failure: OSError, torch's and
            # safetensors' own errors for a full disk (RuntimeError "file write failed", ...)
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(self.failure(step, path, e)) from e
        blocked = time.perf_counter() - t0
        self.blocked_s += blocked
        log.info(
            "checkpoint step %d: training blocked %.2fs (waiting for the previous checkpoint %.2fs, trainer shards "
            "staged in %.2fs%s)%s",
            step,
            blocked,
            waited,
            staged_s,
            ", policy/ exported" if export else "",
            "" if final else "; its files are being written in the background",
        )
        self._written = None
        completion = asyncio.create_task(self._complete(step, tmp, path, t0))
        if final:
            await completion
        else:
            self._pending = completion
        return path

    async def _complete(self, step: int, tmp: Path, path: Path, t0: float) -> None:
        """Wait until every rank's shard files are on disk, then write ``COMPLETE`` (sizes and
        checksums of everything in ``tmp``, hashed off the event loop), rename ``tmp`` into
        place and prune old checkpoints.

        Raises:
            CheckpointError: a rank's background write failed, or the marker / rename did;
                ``tmp`` is removed.
        """
        try:
            while not await self._files_written():
                await asyncio.sleep(CHECKPOINT_POLL_S)
            await asyncio.to_thread(write_complete, tmp, step)  # last: sizes and checksums of everything above
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        except Exception as e:  # noqa: BLE001 - as in save
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(self.failure(step, path, e)) from e
        self.prune()
        log.info("checkpoint step %d complete in %s (%.1fs after it started)", step, path, time.perf_counter() - t0)

    async def _files_written(self) -> bool:
        """Whether every train rank's files of the pending checkpoint are on disk. The ranks are
        asked until they say so or fail; the answer is kept, so that the completion task and
        :meth:`check_background_write` both see it (a rank reports its write's end only once).

        Raises:
            Exception: a rank's background write failed (e.g. ``OSError`` ENOSPC).
        """
        async with self._ask:
            if self._written is None:
                try:
                    if await self.policy.checkpoint_written():
                        self._written = True
                except Exception as e:  # noqa: BLE001 - a rank's write error, whatever its kind
                    self._written = e
            if isinstance(self._written, Exception):
                raise self._written
            return self._written is True

    async def check_background_write(self) -> None:
        """At a step boundary: stop the run if the checkpoint being written in the background
        failed (a full disk, permissions) rather than at the next checkpoint, which may be many
        steps away. Asks the train ranks now (one call each) while the write is in progress;
        returns at once when it is still going or has succeeded.

        Raises:
            CheckpointError: that write failed (see :meth:`save`); its partial directory is
                removed, the complete checkpoints before it are kept.
        """
        task = self._pending
        if task is None:
            return
        if not task.done():
            try:
                await asyncio.wait_for(self._files_written(), timeout=self.config.faults.watchdog_timeout_s)
                return  # still being written, or written: the completion task finishes it
            except asyncio.TimeoutError:
                return  # a hung rank: the next train call's watchdog reports it
            except Exception:  # noqa: BLE001 - the completion task turns it into the run's error
                pass
        await self.finish_pending()

    async def finish_pending(self, timeout: float | None = None) -> None:
        """Wait for the checkpoint being written in the background, if any (raises its
        CheckpointError). With ``timeout``: give up after that many seconds and leave its
        ``.tmp`` directory, which never loads and is removed by the next run."""
        task, self._pending = self._pending, None
        if task is None:
            return
        if timeout is None:
            await task
            return
        done, _ = await asyncio.wait([task], timeout=timeout)
        if not done:
            task.cancel()
            log.error(
                "the checkpoint being written in the background did not finish within %.0fs; it is left incomplete",
                timeout,
            )
            return
        task.result()

    def prune(self) -> None:
        """Keep the two newest complete checkpoints (``KEPT_CHECKPOINTS``), and the newest one with a Hugging Face export
        (``policy/``), so that ``splitrl eval OUTPUT_DIR`` always finds one once it was written.
        One found damaged (on resume) is no keeper and is removed: counting it deleted the intact
        checkpoint the run resumed from and kept one that cannot load."""
        done = complete_checkpoints(self.out)
        good = [p for p in done if not known_damaged(p)]
        keep = set(good[-KEPT_CHECKPOINTS:])
        exported = [p for p in good if (p / "policy" / "config.json").is_file()]
        if exported:
            keep.add(exported[-1])
        for old in done:
            if old not in keep:
                if known_damaged(old):  # the others are routine rotation; this one the user was warned about
                    log.info("removed the damaged checkpoint %s (a newer intact one is kept)", old.name)
                shutil.rmtree(old, ignore_errors=True)

    def failure(self, step: int, path: Path, e: BaseException) -> str:
        """The message of a failed checkpoint write: the cause (the operating system's words and
        the file, when an ``OSError`` is anywhere in the chain: torch reports a full disk as
        ``[enforce fail at inline_container.cc:...] unexpected pos``, with the ``OSError`` as
        its context), the free space on the disk of ``out``, and what is left."""
        os_error = os_error_in(e)
        if os_error is not None:
            cause = f"{os_error.strerror or os_error}" + (f" ({os_error.filename})" if os_error.filename else "")
        else:
            cause = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        try:
            free = f" {format_bytes(shutil.disk_usage(self.out).free)} are free on that disk."
        except OSError:
            free = ""
        intact = latest_intact_checkpoint(self.out)
        return (
            f"could not write the checkpoint of step {step} to {path}: {cause}.{free} "
            + (f"The newest intact checkpoint is {intact.name}. " if intact else "No checkpoint is on disk yet. ")
            + "Free space (or fix the cause) and rerun the same command to resume."
        )

    async def write(
        self, step: int, tmp: Path, *, export: bool, blocking: bool, version: int, expected_tokens: int
    ) -> float:
        """Write a checkpoint's files into ``tmp`` (all but ``COMPLETE``): the trainer's shards
        (started here, finished in the background unless ``blocking``), ``policy/`` when
        ``export``, ``controller.pt`` and ``run_config.json``. Returns the seconds the trainer
        ranks blocked to stage their shards."""
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # a consistent snapshot of the controller side: no await between these reads. Every state
        # a prompt can be in here is either saved or regenerated on resume (see restore):
        #   trained ............... the schedule's done
        #   buffered .............. the buffer's state
        #   accepted, not buffered  pending_groups: generated and waiting for buffer room, or held
        #                           by the deterministic train pump for a later chunk
        #   being generated ....... not saved: not done, so regenerated (the cursor restarts at
        #                           the lowest prompt index that is not done)
        #   evicted / never claimed likewise not done: regenerated
        buffer_state = self.buffer.state_dict()
        done = sorted(self.schedule.done)
        accepted = [group_to_dict(g) for g in self.schedule.accepted_groups()]
        buffered_ids = [s["sample_id"] for g in [*buffer_state["groups"], *accepted] for s in g["samples"]]
        samples = self.data_plane.get(buffered_ids, TOKEN_FIELDS) if buffered_ids else {}
        staged_s = await self.policy.save_checkpoint(str(tmp), blocking)
        if export:
            await self.policy.save_pretrained(str(tmp / "policy"))
            write_inference_files(
                tmp / "policy", self.tokenizer, self.config.rollout, self.config.model.pretrained_path
            )
        torch.save(
            {
                "step": step,
                "version": version,
                "done_indices": done,
                "buffer": buffer_state,
                "pending_groups": accepted,
                "buffered_ids": buffered_ids,
                "buffered_samples": samples,
                "expected_tokens": expected_tokens,
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            },
            tmp / CONTROLLER_STATE,
        )
        # the model config a resume is checked against (preflight) comes from here, so a
        # checkpoint without policy/ is enough to resume
        (tmp / RUN_CONFIG).write_text(json.dumps(self.config.model_dump(mode="json"), indent=1))
        return staged_s

    async def restore(self) -> Restored | None:
        """Load the newest checkpoint that loads (:meth:`load_newest`) into the train workers,
        the buffer (with its samples' tensors), the schedule and the RNGs; None: none loads.

        Raises:
            RuntimeError: see :meth:`load_newest`.
        """
        loaded = await self.load_newest()
        if loaded is None:
            return None
        path, state = loaded
        self.buffer.load_state_dict(state["buffer"])
        if state["buffered_ids"]:
            self.data_plane.put(state["buffered_ids"], state["buffered_samples"])
        pending = [group_from_dict(g) for g in state.get("pending_groups", [])]
        self.schedule.restore(state["done_indices"], pending)
        expected = state.get("expected_tokens")
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        log.info("resumed from %s (step %d)", path, state["step"])
        return Restored(int(state["step"]), int(state["version"]), None if expected is None else int(expected), pending)

    async def load_newest(self) -> tuple[Path, dict] | None:
        """Load the newest checkpoint that loads into the train workers (a damaged one is marked,
        skipped with a warning, and an older one tried); returns its path and the controller's
        state saved with it, or None when none loads (a fresh run).

        A sharded trainer state (``trainer/``) loads into any number of train workers; the
        ``trainer.pt`` of a checkpoint written by splitrl before sharded checkpoints loads too.

        Raises:
            RuntimeError: a sharded state failed to load part-way and no older checkpoint loads
                (the workers' weights are then neither fresh nor restored).
        """
        touched = None  # a checkpoint whose sharded load failed after it may have written into the model
        for path in intact_checkpoints(self.out):
            try:
                state = torch.load(path / CONTROLLER_STATE, weights_only=False)
                if (path / SHARDS_DIR).is_dir():
                    touched = path
                    await self.policy.load_checkpoint(str(path))
                else:  # the whole trainer state in one file: a checkpoint of splitrl before sharded ones
                    await self.policy.load_state_dict(torch.load(path / LEGACY_TRAINER_FILE, weights_only=False))
                return path, state
            except Exception as e:  # noqa: BLE001 - e.g. a checkpoint of an older splitrl without checksums
                why = f"it does not load: {type(e).__name__}: {e}"
                mark_damaged(path, why)
                log.warning("checkpoint %s is damaged (%s); falling back to an older one", path.name, why)
        if touched is not None:
            raise RuntimeError(
                f"checkpoint {touched} failed to load part-way and no older checkpoint loads; the run cannot "
                "resume. Use checkpoint.resume=false to start over in this output_dir, or a new output_dir"
            )
        return None
