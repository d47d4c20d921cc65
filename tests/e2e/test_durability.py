"""Nothing lost across stops (issue 6, items 7-9): accepted rollouts survive a checkpoint, an
interrupt still checkpoints, a damaged or unwritable checkpoint is handled. Local backend."""

import asyncio
import contextlib
import logging
import signal
import threading
from pathlib import Path

import pytest
from _tiny import TINY_STEP

from _configs import demo_config
from _wait import async_wait_until
from splitrl.controller import controller as C
from splitrl.controller.policy_client import PolicyClient
from splitrl.workers import generation

TINY = TINY_STEP + ["cluster.backend=local", "dataplane.kind=inprocess", "logging.tensorboard=false"]

# the settings of issue 6 item 7: generation runs two steps ahead into a buffer of two groups
AHEAD = [
    "cluster.num_generation_workers=2",
    "schedule.generation_groups_per_call=1",
    "schedule.groups_per_step=2",
    "schedule.group_size=2",
    "schedule.min_groups_per_chunk=1",
    "buffer.capacity_groups=2",
    "buffer.max_staleness=2",
    "checkpoint.every=1",
    "schedule.num_steps=3",
    "faults.watchdog_timeout_s=120",  # generous: only a lost prompt should ever reach it
]


def test_a_group_waiting_for_buffer_room_at_a_checkpoint_is_trained_exactly_once(tmp_path, monkeypatch):
    """Kind: accepted work outside every saved structure. Prompt 1 is held back until prompt 4 is
    generated, so at the first checkpoint it waits for buffer room (buffer full with 3 and 4, prompt
    5 waiting too); an interrupt stops the run there. The resumed run must train every prompt index
    of the 3 steps exactly once (before the fix: prompt 1 was in neither the done set nor the
    buffer, never trained, and the last step waited for the watchdog)."""
    generated: list[int] = []
    trained: list[int] = []
    four_done, one_done = threading.Event(), threading.Event()
    first_run = {"on": True, "finishes": 0}
    real_generate = generation.GenerationWorker.generate_groups
    real_train, real_finish = PolicyClient.train_chunk, PolicyClient.finish
    controllers = []
    real_deliver = C.SingleController._deliver

    async def deliver(self, groups):
        controllers.append(self)
        return await real_deliver(self, groups)

    def generate(self, indices, group_size, on_group=None):
        if first_run["on"] and 1 in indices:
            assert four_done.wait(300), "prompt 4 was never generated"
        out = real_generate(self, indices, group_size, on_group)
        generated.extend(indices)
        if 4 in indices:
            four_done.set()
        if 1 in indices:
            one_done.set()
        return out

    async def train_chunk(self, groups):
        trained.extend(g.prompt_index for g in groups)
        return await real_train(self, groups)

    async def finish(self):
        first_run["finishes"] += 1
        if first_run["on"] and first_run["finishes"] == 1:
            # step 1 ends only once prompt 1 is generated and waits for room; then Ctrl-C
            await async_wait_until(
                lambda: one_done.is_set() and controllers and 1 in controllers[-1].schedule.pending,
                timeout_s=300,
                what="prompt 1's group waiting for buffer room",
            )
            signal.raise_signal(signal.SIGINT)
            await asyncio.sleep(0.1)
        return await real_finish(self)

    monkeypatch.setattr(generation.GenerationWorker, "generate_groups", generate)
    monkeypatch.setattr(C.SingleController, "_deliver", deliver)
    monkeypatch.setattr(PolicyClient, "train_chunk", train_chunk)
    monkeypatch.setattr(PolicyClient, "finish", finish)
    cfg = demo_config(TINY + [f"output_dir={tmp_path}", *AHEAD])
    first = C.train(cfg)
    assert first.interrupted and first.steps_done == 1
    assert sorted(trained) == [0, 2]
    first_run["on"] = False
    second = C.train(cfg)
    assert second.steps_done == 3
    assert sorted(trained) == list(range(6)), trained  # every prompt index trained exactly once
    assert sorted(generated) == list(range(6)), generated  # the waiting groups were not generated again


def test_a_stop_after_every_step_trains_every_prompt_exactly_once(tmp_path, monkeypatch):
    """Kind: work lost or repeated across stops. Ctrl-C during every run's first step: four runs
    of one step each (the last one also ends the schedule); the union of what they trained is
    every prompt index of the 3 steps, each once."""
    trained: list[int] = []
    real_train, real_finish = PolicyClient.train_chunk, PolicyClient.finish
    finishes = {"n": 0}

    async def train_chunk(self, groups):
        trained.extend(g.prompt_index for g in groups)
        return await real_train(self, groups)

    async def finish(self):
        finishes["n"] += 1
        if finishes["n"] == 1:
            signal.raise_signal(signal.SIGINT)
            await asyncio.sleep(0.1)
        return await real_finish(self)

    monkeypatch.setattr(PolicyClient, "train_chunk", train_chunk)
    monkeypatch.setattr(PolicyClient, "finish", finish)
    cfg = demo_config(TINY + [f"output_dir={tmp_path}", *AHEAD])
    done = []
    for _ in range(4):
        finishes["n"] = 0
        res = C.train(cfg)
        done.append(res.steps_done)
        if res.steps_done == 3:
            break
    assert done == [1, 2, 3]
    assert sorted(trained) == list(range(6)), trained


def _stalled_controller(tmp_path, **state):
    cfg = demo_config(TINY + [f"output_dir={tmp_path}", *AHEAD])
    c = C.SingleController(cfg)
    c.buffer = C.ReplayBuffer(cfg.buffer)
    defaults = dict(
        step=2,
        version=2,
        synced_version=2,
        cursor=5,
        done_indices={0, 2, 3, 4},
        in_flight=set(),
        generating={},
        pending={},
        held={},
    )
    for k, v in {**defaults, **state}.items():
        k = "done" if k == "done_indices" else k  # where each prompt is: the controller's PromptSchedule
        setattr(c.schedule if hasattr(c.schedule, k) else c, k, v)
    return c


def test_the_watchdog_names_a_lost_prompt_instead_of_blaming_a_worker(tmp_path):
    """Kind: a stall report that guesses. With no generation running and prompt 1 accounted for
    nowhere, the report names prompt 1 as lost and does not say a worker hung; with a request
    running it names the prompts being generated and the worker."""
    lost = _stalled_controller(tmp_path)._stall_report("2 groups")
    assert "[1]" in lost and "lost track" in lost
    assert "hung" not in lost
    import time

    hung = _stalled_controller(
        tmp_path, generating={5: time.perf_counter() - 30}, in_flight={5}, done_indices={0, 1, 2, 3, 4}
    )
    report = hung._stall_report("2 groups")
    assert "[5]" in report and "hung or dead" in report and "lost" not in report


# ---- item 9: checkpoints --------------------------------------------------------------------


def _cfg(tmp_path, *extra):
    return demo_config(TINY + [f"output_dir={tmp_path}", "buffer.max_staleness=0", *extra])


def test_damage_is_found_by_size_and_by_checksum(tmp_path):
    """Kind: a checkpoint trusted because its marker exists. COMPLETE lists every file's size and
    SHA-256; a truncated file, a changed byte and a missing file are each reported."""
    from splitrl.controller.run_checkpoint import damage, write_complete

    d = tmp_path / "step_000001"
    (d / "policy").mkdir(parents=True)
    (d / "trainer.pt").write_bytes(b"x" * 1000)
    (d / "policy" / "model.safetensors").write_bytes(b"y" * 10)
    write_complete(d, 1)
    assert damage(d) is None
    (d / "trainer.pt").write_bytes(b"x" * 500)
    assert "trainer.pt has 500 bytes, 1000 were written" in damage(d)
    (d / "trainer.pt").write_bytes(b"x" * 999 + b"z")
    assert "trainer.pt does not match its SHA-256" in damage(d)
    (d / "trainer.pt").write_bytes(b"x" * 1000)
    (d / "policy" / "model.safetensors").unlink()
    assert damage(d) == "policy/model.safetensors is missing"


def test_a_checkpoint_whose_saved_config_has_the_old_flat_layout_resumes(tmp_path, caplog):
    """Kind: a release that cannot resume the runs of the one before. The checkpoint's
    run_config.json is rewritten in the flat layout of earlier releases (num_steps, group_size ...
    at the top); the resume check reads it in the new layout, reports no changed setting, and the
    run continues from step 2."""
    import json

    from splitrl.config import MOVED_KEYS
    from splitrl.controller.run_checkpoint import RUN_CONFIG, write_complete

    assert C.train(_cfg(tmp_path, "schedule.num_steps=1", "checkpoint.every=1")).steps_done == 1
    ckpt = tmp_path / "checkpoints" / "step_000001"
    saved = json.loads((ckpt / RUN_CONFIG).read_text())
    for old, new in MOVED_KEYS.items():
        section, key = new.split(".")
        saved[f"_{old}"] = saved[section].pop(key)
    old_layout = {k.removeprefix("_"): v for k, v in saved.items() if not (isinstance(v, dict) and not v)}
    assert old_layout["num_steps"] == 1 and old_layout["schedule"] == "async" and "cluster" not in old_layout
    (ckpt / RUN_CONFIG).write_text(json.dumps(old_layout))
    write_complete(ckpt, 1)  # as the earlier release wrote it: the manifest matches the file
    with caplog.at_level("WARNING"):
        second = C.train(_cfg(tmp_path, "schedule.num_steps=2", "checkpoint.every=1"))
    assert second.steps_done == 2 and len(second.metrics) == 1  # step 2 only
    assert "differ from the run that wrote it" not in caplog.text, caplog.text
    # what this run saves is in the new layout: the checkpoint's run_config.json and config.yaml
    import yaml

    for saved in (
        json.loads((tmp_path / "checkpoints" / "step_000002" / RUN_CONFIG).read_text()),
        yaml.safe_load((tmp_path / "config.yaml").read_text()),
    ):
        assert saved["schedule"]["num_steps"] == 2 and not set(saved) & (set(MOVED_KEYS) - {"schedule"})


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    """Kind: resume trusts a damaged checkpoint (before: a raw zip error from torch.load). The
    newest checkpoint's trainer shard is cut in half; resume warns, uses step 1 and runs steps 2-3."""
    from splitrl.logging import read_metrics

    first = C.train(_cfg(tmp_path, "schedule.num_steps=2", "checkpoint.every=1"))
    assert first.steps_done == 2
    step2 = tmp_path / "checkpoints" / "step_000002"
    trainer = step2 / "trainer" / "__0_0.distcp"
    trainer.write_bytes(trainer.read_bytes()[: trainer.stat().st_size // 2])
    with caplog.at_level("WARNING"):
        assert C.preflight(_cfg(tmp_path, "schedule.num_steps=3")) == 1
    assert (
        "step_000002 is damaged (trainer/__0_0.distcp has" in caplog.text and "resuming from step_000001" in caplog.text
    )
    # the same damage in a checkpoint of an older splitrl (COMPLETE without checksums): it is
    # trusted until it fails to load, then skipped the same way
    (step2 / "COMPLETE").write_text('{"step": 2}')
    caplog.clear()
    with caplog.at_level("WARNING"):
        second = C.train(_cfg(tmp_path, "schedule.num_steps=3", "checkpoint.every=1"))
    assert "step_000002 is damaged (it does not load" in caplog.text
    assert second.steps_done == 3 and len(second.metrics) == 2  # steps 2 and 3 run again
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_no_usable_checkpoint_refuses_to_start_over_on_top_of_the_run(tmp_path, caplog):
    """Kind: output lost. Every checkpoint of a run damaged (a truncated file; a directory whose
    COMPLETE marker is gone): resume silently started at step 1 and replaced the run's metrics
    and checkpoints (a new user's trial). Now preflight refuses, names each checkpoint and why,
    and the run's files are untouched; resume=false starts over explicitly."""
    from splitrl.logging import read_metrics

    C.train(_cfg(tmp_path, "schedule.num_steps=2", "checkpoint.every=1"))
    step1, step2 = (tmp_path / "checkpoints" / f"step_00000{i}" for i in (1, 2))
    ctl = step1 / "controller.pt"
    ctl.write_bytes(ctl.read_bytes()[:100])
    (step2 / "COMPLETE").unlink()
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    from splitrl.controller import run_checkpoint

    run_checkpoint._verified.clear()  # a new process: checksums not yet verified (the cache keys on COMPLETE)
    with pytest.raises(
        ValueError,
        match=r"none can be resumed from: step_000001 \(damaged: controller.pt has 100 bytes.*"
        r"step_000002 \(incomplete.*resume=false starts over",
    ):
        C.preflight(_cfg(tmp_path, "schedule.num_steps=3"))
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    # a usable older checkpoint: resumed from, with a warning naming the newer unusable one
    C.train(_cfg(tmp_path / "b", "schedule.num_steps=2", "checkpoint.every=1"))
    (tmp_path / "b" / "checkpoints" / "step_000002" / "COMPLETE").unlink()
    with caplog.at_level("WARNING"):
        assert C.preflight(_cfg(tmp_path / "b", "schedule.num_steps=3")) == 1
    assert "newer checkpoint(s) step_000002 cannot be used (incomplete" in caplog.text
    res = C.train(_cfg(tmp_path, "schedule.num_steps=2", "checkpoint.resume=false"))
    assert res.steps_done == 2 and [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("writer_error", ["oserror", "torch"])
def test_a_full_disk_gives_one_clear_error_and_leaves_nothing_half_written(tmp_path, monkeypatch, capsys, writer_error):
    """Kind: a failed write leaves partial files that look like data. The disk fills up after the
    first checkpoint: every later checkpoint file and atomic write fails after writing a few bytes,
    with OSError ENOSPC, or as torch.save reports it (RuntimeError "file write failed").
    Expected: exit 1 with one line naming the cause and the intact checkpoint; no ``*.tmp`` left,
    no step-2 directory, the step-1 checkpoint intact, no 0-byte metrics.png."""
    import errno
    import os

    import torch

    from splitrl.controller.run_checkpoint import damage

    full = {"on": False}
    real_save, real_fsync = torch.save, os.fsync

    def enospc(name):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(name))

    def save(obj, f, *a, **k):
        if "step_000002" in str(f):  # the disk is full from the first file of the second checkpoint on
            full["on"] = True
        if full["on"] and isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as fh:
                fh.write(b"PK\x03\x04partial")
            if writer_error == "torch":
                raise RuntimeError(
                    "[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0\n"
                    "PytorchStreamWriter failed writing file data/0: file write failed"
                )
            raise enospc(f)
        return real_save(obj, f, *a, **k)

    def fsync(fd):
        if full["on"]:
            raise enospc(f"fd {fd}")
        return real_fsync(fd)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(os, "fsync", fsync)
    stopped, err = _train_until_it_stops(tmp_path, capsys)
    assert "could not write the checkpoint of step 2" in stopped[0]
    assert ("No space left on device" if writer_error == "oserror" else "file write failed") in stopped[0]
    assert "newest intact checkpoint is step_000001" in stopped[0]
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001"]
    assert damage(ckpts / "step_000001") is None
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    png = tmp_path / "metrics.png"
    assert not png.exists() or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_background_write_is_reported_and_never_marked_complete(tmp_path, monkeypatch, capsys):
    """Kind: a checkpoint marked COMPLETE although its shard files never reached the disk. The
    trainer's background write of step 1 fails (ENOSPC); the run stops at the next checkpoint
    with one line naming step 1 and the cause, and no checkpoint or ``*.tmp`` is left."""
    import errno
    import os

    from splitrl.train.checkpoint import ShardedCheckpointer

    real_wait = ShardedCheckpointer.wait

    def failing_wait(self):
        real_wait(self)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "trainer/__0_0.distcp")

    monkeypatch.setattr(ShardedCheckpointer, "wait", failing_wait)
    stopped, err = _train_until_it_stops(tmp_path, capsys)
    assert "could not write the checkpoint of step 1" in stopped[0] and "No space left on device" in stopped[0]
    assert "No checkpoint is on disk yet" in stopped[0]
    assert not list((tmp_path / "checkpoints").iterdir())


def test_a_failed_background_write_stops_the_run_at_the_next_step_boundary(tmp_path, monkeypatch, capsys):
    """Kind: a failure found late, and in torch's words. The disk fills up while the trainer's
    shards of step 4 are written in the background (the file raises ENOSPC at the first tensor
    torch.save writes into it; torch reports that as "[enforce fail at inline_container.cc:...]
    unexpected pos"). Before the fix the run trained on to step 6 and only the next checkpoint
    said so, with torch's message. Now the run stops at the next step boundary (after step 4 or 5:
    the test holds step 5's finish until the write has failed) with one line naming the step, the
    file, "No space left on device" and the free space; step 2's checkpoint is kept."""
    import errno
    import os

    import torch
    from torch.distributed.checkpoint import filesystem

    from splitrl.controller.run_checkpoint import damage
    from splitrl.logging import read_metrics
    from splitrl.train.checkpoint import ShardedCheckpointer

    real_stream, real_torch_save = filesystem.FileSystem.create_stream, torch.save
    real_save, real_finish = ShardedCheckpointer.save, PolicyClient.finish
    writers: list[ShardedCheckpointer] = []
    failed, in_torch_save = threading.Event(), threading.local()

    class FullDisk:
        """A shard file whose disk fills up inside the first tensor torch.save writes into it
        (past its first records: torch then reports "unexpected pos", not the OSError)."""

        def __init__(self, f):
            self._f = f

        def write(self, b):
            if getattr(in_torch_save, "writes", None) is not None:
                in_torch_save.writes += 1
                if in_torch_save.writes > 2:
                    failed.set()
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._f.write(b)

        def __getattr__(self, name):
            return getattr(self._f, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real_stream(self, path, mode) as f:
            yield FullDisk(f) if "step_000004.tmp" in str(path) and "w" in mode else f

    def torch_save(*a, **k):
        in_torch_save.writes = 0
        try:
            return real_torch_save(*a, **k)
        finally:
            in_torch_save.writes = None

    def save(self, *a, **k):
        writers.append(self)
        return real_save(self, *a, **k)

    def write_failed():  # the background write raised, and its future holds the error (or was read)
        return failed.is_set() and all(w._future is None or w._future.done() for w in writers)

    async def finish(self):
        if len(read_metrics(tmp_path / "metrics.jsonl")) == 4:  # step 5: the write of step 4 is under way
            await async_wait_until(write_failed, what="the background write of step 4 to fail")
        return await real_finish(self)

    monkeypatch.setattr(torch, "save", torch_save)
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    monkeypatch.setattr(ShardedCheckpointer, "save", save)
    monkeypatch.setattr(PolicyClient, "finish", finish)
    stopped, err = _train_until_it_stops(tmp_path, capsys, "schedule.num_steps=6", "checkpoint.every=2")
    line = stopped[0]
    assert "could not write the checkpoint of step 4" in line and "No space left on device" in line, line
    assert "step_000004.tmp/trainer/__0_0.distcp" in line and "are free on that disk" in line, line
    assert "enforce fail" not in line and "newest intact checkpoint is step_000002" in line, line
    # the boundary after step 4 (the write failed before step 5 began) or after step 5 (the test
    # holds step 5's finish until the write has failed): one step at most, never step 6
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps in ([1, 2, 3, 4], [1, 2, 3, 4, 5]), steps
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002"]
    assert damage(ckpts / "step_000002") is None


def test_leftovers_of_a_killed_run_are_removed_on_start(tmp_path):
    """Kind: half-written ``*.tmp`` folders and files left behind by a kill -9 stay forever."""
    from splitrl.controller.run_checkpoint import remove_leftovers

    (tmp_path / "checkpoints" / "step_000004.tmp" / "policy").mkdir(parents=True)
    (tmp_path / ".metrics.png.123.tmp").write_bytes(b"")
    (tmp_path / "metrics.jsonl.tmp").write_text("")
    (tmp_path / "checkpoints" / "step_000003").mkdir()
    gone = remove_leftovers(tmp_path)
    assert len(gone) == 3
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000003"]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def _train_until_it_stops(tmp_path, capsys, *extra: str) -> tuple[list[str], str]:
    """Run a 3-step CLI training that checkpoints every step (``extra`` overrides) and is expected
    to stop with exit code 1 and one ``splitrl:`` line (no traceback); returns (those lines, stderr)."""
    from splitrl import cli

    old_term = signal.getsignal(signal.SIGTERM)
    try:
        rc = cli.main(
            ["train", *TINY, f"output_dir={tmp_path}", "buffer.max_staleness=0", "schedule.num_steps=3",
             "checkpoint.every=1", *extra]
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, old_term)
    err = capsys.readouterr().err
    stopped = [line for line in err.splitlines() if line.startswith("splitrl:")]
    assert rc == 1 and len(stopped) == 1 and "Traceback" not in err, err[-3000:]
    return stopped, err


def test_resume_false_sets_the_earlier_run_aside_and_starts_over(tmp_path, caplog):
    """Kind: output lost. `resume=false` in an output_dir holding an earlier run's checkpoints
    (steps 5, 6) kept those and pruned the fresh run's own (steps 1, 2 sort below them), so the
    fresh run ended with no checkpoint of its own and the next start resumed the earlier run (a new
    user's trial); and the fresh run's logger overwrote the earlier metrics.jsonl. Now the earlier
    run's checkpoints and metrics are moved, not deleted, to earlier_runs/<time>/ (nothing a run
    produced is lost), and another tool's folder in checkpoints/ stays where it is."""
    from splitrl.controller.run_checkpoint import complete_checkpoints
    from splitrl.logging import read_metrics

    for step in (5, 6):  # an earlier run's checkpoints (contents do not matter: they are not loaded)
        d = tmp_path / "checkpoints" / f"step_00000{step}"
        d.mkdir(parents=True)
        (d / "COMPLETE").write_text(f'{{"step": {step}, "files": {{}}}}')
    (tmp_path / "metrics.jsonl").write_text('{"step": 6, "train/reward": 0.5}\n')
    foreign = tmp_path / "checkpoints" / "step_100"  # another tool's folder: not ours to move
    foreign.mkdir()
    (foreign / "model.bin").write_text("x")
    with caplog.at_level("WARNING"):
        res = C.train(_cfg(tmp_path, "schedule.num_steps=2", "checkpoint.every=1", "checkpoint.resume=false"))
    assert res.steps_done == 2
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000001", "step_000002"]
    assert (foreign / "model.bin").is_file()
    (earlier,) = (tmp_path / "earlier_runs").iterdir()
    assert sorted(p.name for p in (earlier / "checkpoints").iterdir()) == ["step_000005", "step_000006"]
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 6, "train/reward": 0.5}\n'
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert f"step_000005, step_000006, metrics.jsonl moved to {earlier}" in caplog.text
    assert C.preflight(_cfg(tmp_path, "schedule.num_steps=3")) == 2  # the next start resumes this run


def test_a_damaged_checkpoint_is_no_keeper_when_old_ones_are_pruned(tmp_path, caplog):
    """Kind: output lost. Resuming past a damaged newest checkpoint (a truncated shard) from the
    intact one before it, the end-of-run prune kept "the two newest": the damaged one and the new
    one, and deleted the intact checkpoint the run had resumed from (a new user's trial)."""
    from splitrl.controller import run_checkpoint

    C.train(_cfg(tmp_path, "schedule.num_steps=3", "checkpoint.every=1"))
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000003"]
    shard = next((ckpts / "step_000003" / "trainer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    run_checkpoint._verified.clear()  # a new process
    with caplog.at_level(logging.INFO, logger="splitrl"):
        res = C.train(_cfg(tmp_path, "schedule.num_steps=4", "checkpoint.every=0"))
    assert res.steps_done == 4
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000004"]
    assert "removed the damaged checkpoint step_000003" in caplog.text  # not without a word
    assert run_checkpoint.damage(ckpts / "step_000002") is None


def test_resume_with_another_groups_per_step_or_tokenizer_is_refused_before_anything_starts(tmp_path):
    """Kind: a hang instead of an error. Resuming a 1-step run with groups_per_step 4 -> 2 mapped
    step 2 onto prompt indices the checkpoint records as done: nothing was generated and the run
    waited for the watchdog (600 s), then called it a bug (a new user's trial)."""
    C.train(_cfg(tmp_path, "schedule.num_steps=1"))
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(
        ValueError,
        match=r"schedule.groups_per_step=4, this run has schedule.groups_per_step=2.*set schedule.groups_per_step=4",
    ):
        C.preflight(_cfg(tmp_path, "schedule.num_steps=2", "schedule.groups_per_step=2"))
    assert C.preflight(_cfg(tmp_path, "schedule.num_steps=2")) == 1
    assert (
        C.preflight(_cfg(tmp_path, "schedule.num_steps=2", "schedule.groups_per_step=2", "checkpoint.resume=false"))
        == 0
    )
    # Kind: silent corruption. The same characters in another order (the model's vocab_size
    # still fits) resumed with every id meaning another character (a new user's trial)
    with pytest.raises(
        ValueError, match=r"another tokenizer config.*tokenizer.charset: checkpoint ' ,0123456789=acdes'"
    ):
        C.preflight(_cfg(tmp_path, "schedule.num_steps=2", "tokenizer.charset='0123456789 ,=acdes'"))
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics


def test_leftover_cleanup_leaves_the_users_own_tmp_files_alone(tmp_path, monkeypatch):
    """Kind: output lost (user files). With `output_dir=.` in a project directory, the start-up
    cleanup deleted every `*.tmp` file there (the user's `notes.tmp`, `.cache.tmp`), not only the
    temporary files of splitrl's own atomic writes (a new user's trial)."""
    import os

    from splitrl.controller.run_checkpoint import remove_leftovers
    from splitrl.logging import logger

    (tmp_path / "notes.tmp").write_text("mine")
    (tmp_path / ".cache.tmp").write_text("mine")
    # what write_atomically really names its temporary files, caught at the rename
    ours = []
    monkeypatch.setattr(logger.os, "replace", lambda src, dst: ours.append(Path(src)))
    for name in ("metrics.png", "config.yaml", "metrics.jsonl"):
        logger.write_atomically(tmp_path / name, b"x")
    monkeypatch.setattr(logger.os, "replace", os.replace)
    assert len(ours) == 3 and all(p.is_file() for p in ours)
    gone = remove_leftovers(tmp_path)
    assert sorted(gone) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cache.tmp", "notes.tmp"]
