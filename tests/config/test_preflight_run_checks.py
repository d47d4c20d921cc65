"""Preflight checks of the run as a whole (issue 25): room for its checkpoints on output_dir's
disk, prompts drawn more than once, an absurdly short watchdog. Each is found before any worker
starts; refusals are one ValueError line, the rest warnings that give the numbers."""

import logging
import shutil
from types import SimpleNamespace

import pytest
import torch

from _configs import demo_config
from splitrl.controller import controller as C
from splitrl.controller.preflight import model_hf_config, preflight

LOCAL = ["cluster.backend=local", "dataplane.kind=inprocess", "logging.tensorboard=false"]


def _cfg(tmp_path, *extra):
    return demo_config(LOCAL + [f"output_dir={tmp_path / 'run'}", *extra])


def _dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize(
    "extra",
    [
        [],  # the demo: tied embedding, one trained MTP depth
        ["model.mtp.mtp_loss_scaling_factor=0"],  # heads for metrics only: no AdamW moments for them
        ["model.mtp.mtp_num_layers=0", "model.backbone.tie_word_embeddings=false"],
    ],
)
def test_the_checkpoint_size_estimate_is_what_a_checkpoint_writes(tmp_path, extra):
    """The estimate (from shapes on the meta device) against the files a train worker writes:
    its DCP shards after one AdamW step, and a policy/ export. The estimate counts tensor bytes
    only, so the files are larger by their headers (about 6 % for this 0.5 M-parameter model)."""
    from splitrl.controller.preflight import checkpoint_size
    from splitrl.models import PolicyModel
    from splitrl.train.checkpoint import ShardedCheckpointer

    cfg = _cfg(tmp_path, *extra)
    params, shards, export = checkpoint_size(cfg, model_hf_config(cfg))
    model = PolicyModel.from_config(cfg.model)
    assert params == sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    sum((p**2).sum() for p in model.parameters() if p.requires_grad).backward()
    opt.step()  # the moments exist from the first step on
    ShardedCheckpointer(model, opt).save(tmp_path / "ckpt", {}, blocking=True)
    model.save_pretrained(tmp_path / "ckpt" / "policy")
    assert shards <= _dir_bytes(tmp_path / "ckpt" / "trainer") <= 1.1 * shards
    assert export <= _dir_bytes(tmp_path / "ckpt" / "policy") <= 1.1 * export


def test_checkpoints_to_write_counts_every_nth_step_and_the_end():
    from splitrl.controller.preflight import checkpoints_to_write

    def n(start, steps, every):
        cfg = SimpleNamespace(schedule=SimpleNamespace(num_steps=steps), checkpoint=SimpleNamespace(every=every))
        return checkpoints_to_write(cfg, start)

    assert [n(0, 6, 2), n(0, 7, 2), n(3, 6, 2), n(0, 5, 0), n(5, 5, 1)] == [3, 4, 2, 1, 0]


def _free(monkeypatch, free_bytes):
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: SimpleNamespace(total=2 * free_bytes, used=0, free=free_bytes)
    )


def test_a_disk_without_room_for_one_checkpoint_is_refused_before_any_worker_starts(tmp_path, monkeypatch, caplog):
    """Kind: a failure found late. A run on a disk too small for its checkpoints trained up to
    the first checkpoint (minutes or hours) and then stopped on a full disk. Now: no room for one
    checkpoint with its export (the last one) is a ValueError before the cluster starts, naming
    the free space and the size; room for one but not for the three the run holds at once (two
    kept + the one being written) is a warning; enough room says nothing."""
    from splitrl.controller.preflight import checkpoint_size

    cfg = _cfg(tmp_path, "schedule.num_steps=6", "checkpoint.every=2")
    params, shards, export = checkpoint_size(cfg, model_hf_config(cfg))
    started = []
    monkeypatch.setattr(C.SingleController, "_start_cluster", lambda self: started.append(1) or pytest.fail("started"))
    _free(monkeypatch, shards + export - 1)
    with pytest.raises(
        ValueError, match=r"are free on its disk, but one checkpoint of this run takes about .*MiB"
    ) as e:
        C.train(cfg)
    assert f"{params / 1e6:,.1f} M parameters" in str(e.value) and "\n" not in str(e.value)
    assert not started and not (tmp_path / "run").exists()  # nothing written, nothing started
    _free(monkeypatch, 2 * shards + export)  # one fits, three do not
    with caplog.at_level(logging.WARNING):
        assert preflight(_cfg(tmp_path, "schedule.num_steps=6", "checkpoint.every=2")) == 0
    assert "this run holds up to 3 new checkpoints at once (it keeps the 2 newest" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # checkpoint_every=0: only the last one is written
        preflight(_cfg(tmp_path, "schedule.num_steps=6", "checkpoint.every=0"))
        _free(monkeypatch, 2 * shards + export + 1)  # two fit: a run that writes two
        preflight(_cfg(tmp_path, "schedule.num_steps=4", "checkpoint.every=2"))
        _free(monkeypatch, 100 * (shards + export))
        preflight(_cfg(tmp_path, "schedule.num_steps=6", "checkpoint.every=2"))
    assert "checkpoint" not in caplog.text, caplog.text


def _reuse_warnings(tmp_path, caplog, *extra) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="splitrl.controller.preflight"):
        preflight(_cfg(tmp_path, *extra))
    return [r.getMessage() for r in caplog.records if "the task has" in r.getMessage()]


def test_prompts_drawn_more_than_once_are_warned_about_with_the_numbers(tmp_path, caplog):
    """Kind: a silent surprise. task.size=3 with groups_per_step=16 trained the same 3 prompts
    16 times a step (prompt index mod 3) without a word. Now a warning says so, with the
    numbers; a run that only draws the task more than once over its steps (several epochs) gets
    the softer one; an unbounded task or a single epoch, none."""
    task = ["task.size=3", "schedule.groups_per_step=16", "schedule.min_groups_per_chunk=4", "schedule.num_steps=10"]
    (within,) = _reuse_warnings(tmp_path, caplog, *task)
    assert "the task has 3 prompts and schedule.groups_per_step=16: every step draws each prompt 5 or 6 times" in within
    assert "over schedule.num_steps=10 each prompt is drawn 53 or 54 times" in within and "task.size" in within
    (epochs,) = _reuse_warnings(tmp_path, caplog, "task.size=40", "schedule.groups_per_step=4", "schedule.num_steps=25")
    assert (
        "schedule.num_steps=25 x groups_per_step=4 = 100 groups: each prompt is trained 2 or 3 times (2.5 epochs)"
        in epochs
    )
    assert "fine if meant" in epochs and "num_steps to 10 for one epoch" in epochs
    assert (
        _reuse_warnings(tmp_path, caplog, "task.size=40", "schedule.groups_per_step=4", "schedule.num_steps=10") == []
    )
    assert (
        _reuse_warnings(tmp_path, caplog, "schedule.groups_per_step=16", "schedule.num_steps=1000") == []
    )  # size None: unbounded


def test_a_data_file_counts_its_rows_left_out(tmp_path, caplog):
    """The rows preflight leaves out (too long for the context) are not drawn: the warning counts
    the rows that are."""
    import json

    path = tmp_path / "data.jsonl"
    rows = [{"problem": "1,2", "answer": "2,1"}] * 5 + [{"problem": "1," * 200, "answer": "1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (w,) = _reuse_warnings(
        tmp_path,
        caplog,
        f"task={{kind: math_file, path: {path}}}",
        "schedule.groups_per_step=6",
        "schedule.min_groups_per_chunk=2",
    )
    assert w.startswith("the task has 5 prompts and schedule.groups_per_step=6: every step draws each prompt 1 or 2 times"), w


def test_an_absurdly_short_watchdog_is_warned_about_and_its_report_names_the_setting(tmp_path, caplog, capsys):
    """Kind: a misleading message. watchdog_timeout_s=0.01 was accepted, and the run then said
    "waited 0s ... a generation worker may be hung or dead" without naming the setting. Now the
    preflight warns, and the watchdog's report names watchdog_timeout_s with its value and says to
    raise it."""
    from splitrl import cli

    tiny = [
        "schedule.groups_per_step=4",
        "schedule.group_size=4",
        "schedule.min_groups_per_chunk=2",
        "rollout.max_new_tokens=6",
    ]
    with caplog.at_level(logging.WARNING):
        preflight(_cfg(tmp_path, *tiny, "faults.watchdog_timeout_s=0.01"))
    assert "faults.watchdog_timeout_s=0.01 s: the run stops with a watchdog report" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        preflight(_cfg(tmp_path, *tiny, "faults.watchdog_timeout_s=30"))
    assert "watchdog_timeout_s" not in caplog.text
    import os
    import signal
    import threading

    from splitrl.workers import generation

    release = threading.Event()
    real_generate = generation.GenerationWorker.generate_groups

    def hung(self, *a, **k):  # a generation that outlasts any watchdog of the test
        release.wait(300)
        return real_generate(self, *a, **k)

    def no_exit(code):  # the CLI leaves a stalled run with os._exit (a hung thread cannot be joined)
        exits.append(code)
        raise SystemExit(code)

    exits = []
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(os, "_exit", no_exit)
            m.setattr(generation.GenerationWorker, "generate_groups", hung)
            with pytest.raises(SystemExit):
                cli.main(
                    ["train", *LOCAL, *tiny, f"output_dir={tmp_path / 'wd'}", "schedule.num_steps=2", "faults.watchdog_timeout_s=0.01",
                     "logging.progress_bar=false"]
                )  # fmt: skip
    finally:
        release.set()
        signal.signal(signal.SIGTERM, old_term)
    stopped = [line for line in capsys.readouterr().err.splitlines() if line.startswith("splitrl: stopped")]
    assert exits == [1] and len(stopped) == 1, stopped
    assert "faults.watchdog_timeout_s=0.01 s" in stopped[0] and "raise faults.watchdog_timeout_s" in stopped[0], stopped[0]
