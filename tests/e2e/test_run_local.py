"""The whole run through the single controller with the local backend and the in-process data
plane (fast): metric keys, overlap evidence, on-policy steps, deterministic resume, bad configs."""

import logging
import math
import os

import pytest
from _tiny import TINY_STEP

from _configs import demo_config
from splitrl.config import load_config
from splitrl.controller.controller import StepFailed, train
from splitrl.logging import read_metrics

TINY = TINY_STEP + ["cluster.backend=local", "dataplane.kind=inprocess", "logging.tensorboard=false"]


def _cfg(tmp_path, *extra):
    return demo_config(TINY + [f"output_dir={tmp_path}", *extra])


def test_run_logs_every_metric_and_artifacts(tmp_path):
    res = train(_cfg(tmp_path, "schedule.num_steps=3", "buffer.max_staleness=1", "checkpoint.every=2"))
    assert res.steps_done == 3
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/mtp/mtp_1_loss",
        "train/mtp/mtp_1_acceptance_rate",
        "train/mtp/grad_norm",
        "train/reward",
        "train/mtp/mtp_1_num_tokens",
        "rollout/response_length_mean",
        "rollout/truncation_rate",
        "buffer/staleness_mean",
        "buffer/evicted_groups_total",
        "timing/generation_s",
        "timing/train_s",
        "timing/weight_sync_s",
        "timing/exposed_wait_s",
        "train/entropy",
    ):
        assert key in rows[-1], key
    # the logged numbers are the workers' numbers
    for r, m in zip(rows, res.metrics):
        assert r["train/mtp/mtp_1_loss"] == pytest.approx(m["train/mtp/mtp_1_loss"], rel=1e-12)
        assert 0 < r["train/mtp/mtp_1_loss"] < 10 and 0 <= r["train/mtp/mtp_1_acceptance_rate"] <= 100
    # a step is groups_per_step × group_size samples
    assert all(r["train/num_valid_samples"] == 16 for r in rows)
    assert (tmp_path / "metrics.png").stat().st_size > 0
    assert (tmp_path / "config.yaml").exists()
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000003"]
    assert (tmp_path / "checkpoints" / "step_000003" / "policy" / "model.safetensors").exists()


def test_max_staleness_zero_is_on_policy(tmp_path):
    res = train(_cfg(tmp_path, "schedule.num_steps=3", "buffer.max_staleness=0"))
    for m in res.metrics:
        assert m["buffer/staleness_max"] == 0.0
        assert m["buffer/evicted_groups_total"] == 0.0


@pytest.mark.parametrize(
    "rollout",
    [[], ["rollout.speculative=true", "rollout.deterministic=true"]],
    ids=["plain", "speculative-deterministic"],
)
def test_resume_reproduces_the_uninterrupted_run(tmp_path, rollout):
    """max_staleness 0: a run stopped after a checkpoint and resumed logs the same per-step metrics
    as an uninterrupted run. Tolerance: exact equality (same data, same chunking, same kernels).
    With speculative rollouts ``rollout.deterministic`` keeps the speculation decision off the
    clock, so the logprobs, and every metric that reads them, are equal too."""
    train(_cfg(tmp_path / "full", "schedule.num_steps=4", "buffer.max_staleness=0", "checkpoint.every=2", *rollout))
    part = _cfg(tmp_path / "part", "schedule.num_steps=4", "buffer.max_staleness=0", "checkpoint.every=2", *rollout)
    first = train(part.model_copy(update={"schedule": part.schedule.model_copy(update={"num_steps": 2})}))
    assert first.steps_done == 2
    second = train(part)  # resumes from step 2
    assert second.steps_done == 4 and len(second.metrics) == 2
    rows_full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    rows_part = read_metrics(tmp_path / "part" / "metrics.jsonl")
    assert [r["step"] for r in rows_part] == [1, 2, 3, 4]
    for a, b in zip(rows_full, rows_part):
        for k, v in a.items():
            if k.startswith("timing/") or k.startswith("rollout/tokens_per_s"):
                continue
            w = b[k]
            assert (v == w) or (isinstance(v, float) and math.isnan(v) and math.isnan(w)), (a["step"], k, v, w)


def _same_metrics(a: dict, b: dict, where) -> None:
    for k, v in a.items():
        if k.startswith("timing/") or k.startswith("rollout/tokens_per_s") or k == "step":
            continue
        w = b[k]
        assert (v == w) or (isinstance(v, float) and math.isnan(v) and math.isnan(w)), (where, k, v, w)


def test_resume_from_a_checkpoint_written_in_the_background_reproduces_the_run(tmp_path, monkeypatch):
    """The checkpoint of step 2 (sharded trainer state, no policy/ export, files written while
    step 3 trains) is what a crash after it leaves: resuming from it reproduces steps 3-4 of the
    uninterrupted run exactly (max_staleness 0). Its COMPLETE is written only once every rank
    reports its files on disk; the blocking time is logged as timing/checkpoint_s."""
    import shutil

    from splitrl.workers import train_actor

    real = train_actor.TrainActor.checkpoint_written
    polls: list[tuple[bool, bool]] = []  # (files written, step_000002 visible as a checkpoint)
    unanswered = {"polls": 0}  # polls of the checkpoint being written that reported "not yet"

    def slow(self):
        # the first two polls of every checkpoint report "not written yet" whatever the files
        # (the controller must wait); later ones the truth, however long the write takes on a
        # busy machine (it used to have to finish within two poll intervals, 0.4 s)
        written = unanswered["polls"] >= 2 and real(self)
        unanswered["polls"] = 0 if written else unanswered["polls"] + 1
        polls.append((written, (tmp_path / "checkpoints" / "step_000002" / "COMPLETE").exists()))
        return written

    monkeypatch.setattr(train_actor.TrainActor, "checkpoint_written", slow)
    cfg = _cfg(tmp_path, "schedule.num_steps=4", "buffer.max_staleness=0", "checkpoint.every=2")
    full = train(cfg)
    # step 2's checkpoint: the controller polled until its files were reported written (the
    # third poll at the earliest), and until it heard so, no COMPLETE marked the checkpoint
    first = next(i for i, (written, _) in enumerate(polls) if written)
    assert first >= 2 and polls[:2] == [(False, False), (False, False)], polls
    assert not any(complete for _, complete in polls[: first + 1]), polls
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["timing/checkpoint_s"] for r in rows[:2]] == [0.0, 0.0] and rows[2]["timing/checkpoint_s"] > 0
    step2, step4 = (tmp_path / "checkpoints" / f"step_00000{k}" for k in (2, 4))
    assert (step2 / "trainer" / ".metadata").is_file() and not (step2 / "trainer.pt").exists()
    assert not (step2 / "policy").exists() and (step4 / "policy" / "model.safetensors").is_file()

    shutil.rmtree(step4)  # a crash after step 2's checkpoint
    monkeypatch.setattr(train_actor.TrainActor, "checkpoint_written", real)
    resumed = train(cfg)
    assert resumed.steps_done == 4 and len(resumed.metrics) == 2
    for k, (a, b) in enumerate(zip(full.metrics[2:], resumed.metrics), start=3):
        _same_metrics(a, b, k)


def test_a_checkpoint_of_an_earlier_splitrl_with_trainer_pt_still_resumes(tmp_path, monkeypatch):
    """Checkpoints written before sharded ones hold the whole trainer state in trainer.pt (rank
    0's full state dict). Resuming from one reproduces the uninterrupted run's steps 3-4 exactly."""
    from pathlib import Path

    import torch

    from splitrl.controller.policy_client import PolicyClient

    full = train(_cfg(tmp_path / "full", "schedule.num_steps=4", "buffer.max_staleness=0", "checkpoint.every=2"))

    async def legacy_save(self, path, blocking=False):  # what splitrl wrote before sharded checkpoints
        torch.save(await self.state_dict(), Path(path) / "trainer.pt")
        return 0.0

    async def written(self):
        return True

    old = _cfg(tmp_path / "old", "schedule.num_steps=4", "buffer.max_staleness=0", "checkpoint.every=2")
    with monkeypatch.context() as m:
        m.setattr(PolicyClient, "save_checkpoint", legacy_save)
        m.setattr(PolicyClient, "checkpoint_written", written)
        train(old.model_copy(update={"schedule": old.schedule.model_copy(update={"num_steps": 2})}))
    step2 = tmp_path / "old" / "checkpoints" / "step_000002"
    assert (step2 / "trainer.pt").is_file() and not (step2 / "trainer").exists()
    resumed = train(old)
    assert resumed.steps_done == 4 and len(resumed.metrics) == 2
    for k, (a, b) in enumerate(zip(full.metrics[2:], resumed.metrics), start=3):
        _same_metrics(a, b, k)


def test_export_every_exports_at_its_steps_and_at_the_end(tmp_path, monkeypatch):
    """checkpoint.export_every=2 with checkpoint_every=1 and 5 steps: policy/ is written at steps 2, 4 and 5
    (the end) only; every checkpoint holds the sharded trainer state."""
    from splitrl.controller.controller import SingleController

    real = SingleController._write_checkpoint
    seen: list[tuple[int, bool, bool]] = []

    async def recording(self, step, tmp, export, blocking):
        out = await real(self, step, tmp, export, blocking)
        seen.append((step, export, (tmp / "policy" / "config.json").is_file()))
        return out

    monkeypatch.setattr(SingleController, "_write_checkpoint", recording)
    train(
        _cfg(
            tmp_path,
            "schedule.num_steps=5",
            "buffer.max_staleness=1",
            "checkpoint.every=1",
            "checkpoint.export_every=2",
        )
    )
    assert seen == [(1, False, False), (2, True, True), (3, False, False), (4, True, True), (5, True, True)]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004", "step_000005"]
    with pytest.raises(ValueError, match="checkpoint.export_every=3 is not a multiple of checkpoint.every=2"):
        _cfg(tmp_path, "checkpoint.every=2", "checkpoint.export_every=3")


def test_pruning_keeps_the_two_newest_and_the_newest_export(tmp_path):
    from splitrl.controller.controller import SingleController

    root = tmp_path / "checkpoints"
    for k in range(1, 7):
        (root / f"step_00000{k}").mkdir(parents=True)
        (root / f"step_00000{k}" / "COMPLETE").write_text("{}")
    for k in (2, 4):
        (root / f"step_00000{k}" / "policy").mkdir()
        (root / f"step_00000{k}" / "policy" / "config.json").write_text("{}")
    SingleController(_cfg(tmp_path))._prune_checkpoints()
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000005", "step_000006"]


def test_bad_configs_fail_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="nonexistent_key"):
        demo_config(TINY + ["nonexistent_key=1"])
    # formerly rejected; trained exactly now (splitrl.train.side_grads)
    demo_config(TINY + ["loss.loss_type=sequence_level", "model.mtp.mtp_detach_heads=false"])
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="path"):
        demo_config(TINY + ["task={kind: math_file, path: /nonexistent.jsonl}"])
    assert not (tmp_path / "metrics.jsonl").exists()


def test_failed_chunk_aborts_and_stops_with_the_cause(tmp_path, monkeypatch):
    from splitrl.workers import train_actor

    def boom(self, *a, **k):
        raise ValueError("injected chunk failure")

    monkeypatch.setattr(train_actor.TrainActor, "train_chunk", boom)
    with pytest.raises(StepFailed, match="injected chunk failure"):
        train(_cfg(tmp_path, "schedule.num_steps=2", "faults.on_chunk_failure=retry", "faults.max_step_retries=1"))


def test_kl_to_reference_and_speculative_rollouts(tmp_path):
    """KL to the frozen initial policy is 0 at the first step and grows after; speculative
    rollouts with the MTP heads report their acceptance (percent)."""
    res = train(
        _cfg(
            tmp_path,
            "schedule.num_steps=3",
            "loss.kl_coef=0.1",
            "rollout.speculative=true",
            "model.mtp.mtp_num_layers=2",
            "train.optim.lr=0.01",
        )
    )
    kl = [m["train/kl"] for m in res.metrics]
    assert abs(kl[0]) < 1e-6
    assert kl[-1] > 1e-6
    # logged every step; NaN for a step in which nothing was drafted
    acc = [m["rollout/acceptance_rate"] for m in res.metrics]
    assert all(0.0 <= a <= 100.0 for a in acc if not math.isnan(a))
    assert any(not math.isnan(a) for a in acc)


def test_preflight_catches_data_tokenizer_and_resume_mismatches(tmp_path):
    from splitrl.controller.controller import preflight

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": "1+1", "bar": "2"}\n')
    with pytest.raises(ValueError, match="column"):
        preflight(_cfg(tmp_path / "a", "task={kind: math_file, path: " + str(bad) + "}"))
    good = tmp_path / "good.jsonl"
    good.write_text('{"problem": "What is 1+1?", "answer": "2"}\n')
    # the demo's 18-character tokenizer cannot spell this task's prompts
    with pytest.raises(ValueError, match="tokenizer.charset"):
        preflight(_cfg(tmp_path / "b", "task.kind=math_file", f"task.path={good}"))
    out = tmp_path / "run"
    train(_cfg(out, "schedule.num_steps=1"))
    # the message names what differs (a new user's trial: it did not)
    with pytest.raises(
        ValueError, match=r"different model config .*model\.backbone\.hidden_size: checkpoint \d+, this run 64"
    ):
        preflight(_cfg(out, "schedule.num_steps=2", "model.backbone.hidden_size=64"))
    assert preflight(_cfg(out, "schedule.num_steps=2")) == 1
    assert train(_cfg(out, "schedule.num_steps=1")).steps_done == 1  # finished: nothing to do, no workers


def test_fewer_steps_than_a_run_made_is_said_not_passed_for_a_finished_run(tmp_path, monkeypatch, caplog):
    """A new user's trial: num_steps=40 on a directory whose run made 50 steps logged 'a finished
    run; nothing to do' at INFO, which reads as if the 40 asked for were done."""
    from splitrl.controller import controller as controller_mod

    monkeypatch.setattr(controller_mod, "preflight", lambda cfg: 3)  # a 3-step run is on disk
    with caplog.at_level(logging.INFO, logger="splitrl.controller.controller"):
        assert train(_cfg(tmp_path / "run", "schedule.num_steps=2")).steps_done == 3
    [record] = [r for r in caplog.records if "nothing to do" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "more than schedule.num_steps=2" in record.getMessage() and "checkpoint.resume=false" in record.getMessage()
    # a finished run (as many steps as asked): how to go on is said too (a new user's trial)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="splitrl.controller.controller"):
        assert train(_cfg(tmp_path / "run", "schedule.num_steps=3")).steps_done == 3
    [record] = [r for r in caplog.records if "nothing to do" in r.getMessage()]
    assert "a finished run (3 steps)" in record.getMessage() and "raise schedule.num_steps" in record.getMessage()


def test_a_failed_chunk_is_retried_and_the_run_goes_on(tmp_path, monkeypatch):
    from splitrl.workers import train_actor

    real = train_actor.TrainActor.train_chunk
    calls = {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("transient failure")
        return real(self, *a, **k)

    monkeypatch.setattr(train_actor.TrainActor, "train_chunk", flaky)
    res = train(
        _cfg(
            tmp_path,
            "schedule.num_steps=2",
            "buffer.max_staleness=0",
            "faults.on_chunk_failure=retry",
            "faults.max_step_retries=1",
        )
    )
    assert res.steps_done == 2
    assert all(m["train/num_valid_samples"] == 16 for m in res.metrics)  # the retried step is whole


def test_watchdog_reports_a_stall_instead_of_hanging(tmp_path, monkeypatch):
    import threading

    from splitrl.controller.controller import StallError
    from splitrl.workers import generation

    release = threading.Event()
    returned = []

    def hung(self, *a, **k):
        release.wait(600)
        returned.append(True)
        raise AssertionError("unreachable")

    monkeypatch.setattr(generation.GenerationWorker, "generate_groups", hung)
    try:
        with pytest.raises(StallError, match="watchdog"):
            train(_cfg(tmp_path, "schedule.num_steps=1", "faults.watchdog_timeout_s=2"))
        # reported while the generation call still hung (no wall-clock bound: a loaded machine
        # may take long to start the run; what counts is that the run did not wait for the call)
        assert not returned
    finally:
        release.set()


def test_two_generation_workers_with_a_small_buffer_generate_each_prompt_once(tmp_path, monkeypatch):
    """Back-pressure keeps a finished request's groups waiting for room in the buffer; another
    pump must not claim (and generate) those prompts again meanwhile."""
    from splitrl.workers import generation

    seen: list[int] = []
    real = generation.GenerationWorker.generate_groups

    def recording(self, indices, group_size, on_group=None):
        seen.extend(indices)
        return real(self, indices, group_size, on_group)

    monkeypatch.setattr(generation.GenerationWorker, "generate_groups", recording)
    res = train(
        _cfg(
            tmp_path,
            "schedule.num_steps=3",
            "cluster.num_generation_workers=2",
            "buffer.capacity_groups=2",
            "buffer.max_staleness=2",
            "schedule.min_groups_per_chunk=1",
        )
    )
    assert res.steps_done == 3
    assert sorted(seen) == list(range(12))  # 3 steps × 4 prompts, each generated once


def test_cpu_demo_runs_with_a_tiny_moe_backbone(tmp_path):
    """`splitrl train model.family=qwen3_moe`: the demo on transformers' Qwen3-MoE (4 experts, 2 per
    token, router aux loss on), with the MoE metrics logged."""
    res = train(_cfg(tmp_path, "schedule.num_steps=2", "model.family=qwen3_moe", "loss.loss_type=sequence_level"))
    assert res.steps_done == 2
    rows = read_metrics(tmp_path / "metrics.jsonl")
    for r in rows:
        assert 0 < r["train/moe/aux_loss"] < 4  # L_aux is k = 2 when balanced
        assert 0.25 <= r["train/moe/expert_load_max"] <= 1.0
        assert math.isfinite(r["train/grad_norm"])


def test_cpu_demo_runs_with_a_qwen2_backbone(tmp_path):
    """`splitrl train model.family=qwen2`: the demo on transformers' Qwen2 (q/k/v biases, no q/k
    norms), through the rollout engine's fused biased projections and the weight sync."""
    res = train(_cfg(tmp_path, "schedule.num_steps=2", "model.family=qwen2"))
    assert res.steps_done == 2
    rows = read_metrics(tmp_path / "metrics.jsonl")
    for r in rows:
        assert math.isfinite(r["train/grad_norm"]) and "train/mtp/mtp_1_loss" in r


def test_groups_reach_training_before_their_generation_call_returns(tmp_path, monkeypatch):
    """Continuous batching hands each group over when its last sample finishes (issue: rollouts
    at GPU speed, item 2): with one generation call for the whole step, the first chunk trains
    while that call is still generating. Without streaming the worker below waits in vain."""
    import threading

    from splitrl.controller.policy_client import PolicyClient
    from splitrl.workers import generation

    training_started = threading.Event()
    waited: list[bool] = []
    real_generate, real_train = generation.GenerationWorker.generate_groups, PolicyClient.train_chunk

    def generate(self, indices, group_size, on_group=None):
        def hand_over(group):
            on_group(group)
            if not waited:  # after the first group: hold generation until training has begun
                waited.append(training_started.wait(120))  # generous: a loaded machine trains late

        assert on_group is not None, "the local backend passes a per-group callback"
        return real_generate(self, indices, group_size, hand_over)

    async def train_chunk(self, groups):
        training_started.set()
        return await real_train(self, groups)

    monkeypatch.setattr(generation.GenerationWorker, "generate_groups", generate)
    monkeypatch.setattr(PolicyClient, "train_chunk", train_chunk)
    res = train(
        _cfg(
            tmp_path,
            "schedule.num_steps=1",
            "schedule.groups_per_step=4",
            "schedule.generation_groups_per_call=4",
            "schedule.min_groups_per_chunk=1",
            "buffer.max_staleness=0",
        )
    )
    assert res.steps_done == 1 and waited == [True]


def test_a_second_run_in_a_directory_in_use_is_refused_before_it_writes(tmp_path):
    """A new user's trial: two `splitrl train` in one output_dir both ran; each dropped the other's
    metrics lines and the last to finish left its record over the other's. Now the second stops
    with the owner's pid before writing anything; after the first ends, the directory is free."""
    from splitrl.controller.run_checkpoint import RUN_LOCK, RunDirInUse, RunDirLock

    out = tmp_path / "run"
    out.mkdir()
    held = RunDirLock(out)  # as a running run holds it
    try:
        with pytest.raises(RunDirInUse, match=rf"{out} is in use by another splitrl run \(pid {os.getpid()}\)"):
            train(_cfg(out, "schedule.num_steps=1"))
        assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK]  # nothing written
        with pytest.raises(RunDirInUse):
            RunDirLock(out)  # the same process, another open file: still refused
    finally:
        held.release()
    assert (out / RUN_LOCK).read_text() == ""  # released: the README's "the empty file staying behind"
    assert train(_cfg(out, "schedule.num_steps=1")).steps_done == 1
    assert (out / RUN_LOCK).read_text() == ""
    RunDirLock(out).release()  # the finished run let it go


def test_a_failed_run_releases_its_directory(tmp_path, monkeypatch):
    from splitrl.controller import controller as controller_mod
    from splitrl.controller.run_checkpoint import RunDirLock

    def broken(self):
        raise RuntimeError("worker start failed")

    monkeypatch.setattr(controller_mod.SingleController, "_build", broken)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="worker start failed"):
        train(_cfg(out, "schedule.num_steps=1"))
    RunDirLock(out).release()  # not held any more


def test_a_file_system_without_flock_runs_unguarded_with_a_warning(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    from splitrl.controller.run_checkpoint import RunDirLock

    def unsupported(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", unsupported)
    with caplog.at_level(logging.WARNING, logger="splitrl.controller.run_checkpoint"):
        RunDirLock(tmp_path).release()
    assert "not guarding it against a second run" in caplog.text


def test_a_resume_with_changed_settings_says_what_changed(tmp_path, caplog):
    """A new user's trial: resuming a group_size=8 run with group_size=4 and another temperature
    said nothing (a changed model or groups_per_step is refused; these may change, but not
    silently). Settings a resume is expected to change (num_steps, logging ...) are not listed."""
    from splitrl.controller.controller import preflight

    out = tmp_path / "run"
    train(_cfg(out, "schedule.num_steps=1"))
    with caplog.at_level(logging.WARNING, logger="splitrl.controller.controller"):
        assert preflight(_cfg(out, "schedule.num_steps=3", "logging.tensorboard=false")) == 1
        assert not [r for r in caplog.records if "differ from the run" in r.getMessage()]
        assert preflight(_cfg(out, "schedule.num_steps=3", "schedule.group_size=2", "rollout.temperature=0.5")) == 1
    [record] = [r for r in caplog.records if "differ from the run" in r.getMessage()]
    message = record.getMessage()
    assert "group_size: 4 -> 2" in message and "rollout.temperature: 1.0 -> 0.5" in message, message
    assert "num_steps" not in message and "apply from step 2 on" in message


def test_a_foreign_metrics_file_is_refused_by_the_preflight(tmp_path):
    """A new user's trial: an output_dir holding another tool's metrics.jsonl was refused only
    once the workers were up (~20 s), with no way forward in the message."""
    from splitrl.controller.controller import preflight

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"loss": 1.0}\n{"loss": 0.5}\n')
    with pytest.raises(
        ValueError,
        match=r"metrics.jsonl:1 has no integer 'step' field.*move it out of .* or give this run another output_dir",
    ):
        preflight(_cfg(out, "schedule.num_steps=1"))
    assert (out / "metrics.jsonl").read_text() == '{"loss": 1.0}\n{"loss": 0.5}\n'
    assert preflight(_cfg(out, "schedule.num_steps=1", "checkpoint.resume=false")) == 0  # a start-over sets it aside


def test_a_run_refused_by_the_preflight_leaves_no_empty_output_dir(tmp_path):
    """A new user's trial: a refused run (rollout.max_new_tokens beyond the context) left an empty
    output_dir behind; one that existed before stays."""
    from splitrl.controller.controller import preflight

    out = tmp_path / "big"
    with pytest.raises(ValueError, match="max_position_embeddings"):
        preflight(_cfg(out, "rollout.max_new_tokens=100000000"))
    assert not out.exists()
    # nor the parents it created (a second new user's trial: output_dir=.../p/q/r left p/q/)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        preflight(_cfg(tmp_path / "p" / "q" / "r", "rollout.max_new_tokens=100000000"))
    assert not (tmp_path / "p").exists()
    out.mkdir()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        preflight(_cfg(out, "rollout.max_new_tokens=100000000"))
    assert out.is_dir()


def test_a_resume_with_a_new_learning_rate_trains_with_it(tmp_path):
    """A new user's trial: resuming with train.optim.lr changed was announced by the resume warning,
    then trained on with the checkpoint's LR (the optimizer state carried it). The resumed step's LR
    is now the new one times the schedule's factor."""
    out = tmp_path / "run"
    train(_cfg(out, "schedule.num_steps=2"))
    train(_cfg(out, "schedule.num_steps=4", "train.optim.lr=1e-4"))
    lrs = [m["train/lr"] for m in read_metrics(out / "metrics.jsonl")]
    optim = demo_config([f"output_dir={out}", "schedule.num_steps=4", "train.optim.lr=1e-4", *TINY_STEP]).train.optim
    old = demo_config([f"output_dir={out}", "schedule.num_steps=2", *TINY_STEP]).train.optim
    assert lrs[1] == pytest.approx(old.lr * old.lr_factor(1), rel=1e-12)
    assert lrs[2] == pytest.approx(1e-4 * optim.lr_factor(2), rel=1e-12) and lrs[3] == pytest.approx(
        1e-4 * optim.lr_factor(3), rel=1e-12
    )


def test_a_fresh_start_over_an_earlier_record_sets_it_aside(tmp_path):
    """A new user's trial: a fresh run in a directory holding step records but no checkpoint (a run
    that stopped before its first checkpoint, or another tool's) dropped those lines; now they are
    moved to earlier_runs/, as resume=false does."""
    out = tmp_path / "run"
    out.mkdir()
    record = '{"step": 1, "my_acc": 0.9}\n{"step": 2, "my_acc": 0.95}\n'
    (out / "metrics.jsonl").write_text(record)
    train(_cfg(out, "schedule.num_steps=1"))
    [kept] = list((out / "earlier_runs").glob("*/metrics.jsonl"))
    assert kept.read_text() == record
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [1]
