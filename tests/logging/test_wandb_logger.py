"""Weights & Biases as an optional sink, and the resolved config in TensorBoard (issue 10, item 4).

The adapter is tested call by call against a stand-in module (exact values, steps, config, resume
id), and once end to end with the real wandb in offline mode, reading its run file back.
"""

import json
import struct
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from _wait import wait_until
from splitrl.logging import LoggingConfig, MetricsLogger
from splitrl.logging.wandb_logger import RUN_ID_FILE, WandbConfig

QUIET = dict(progress_bar=False, plot=False)


class _FakeRun:
    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.id = kwargs.get("id") or "run123"
        self.logged = []
        self.config = types.SimpleNamespace(data={}, update=self._update)
        self.finished = False

    def _update(self, d, allow_val_change=False):
        assert allow_val_change
        self.config.data.update(d)

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        run = _FakeRun(kwargs)
        module.runs.append(run)
        return run

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_adapter_logs_each_step_the_config_and_resumes_the_same_run(tmp_path, fake_wandb):
    cfg = LoggingConfig(
        tensorboard=False, wandb=WandbConfig(project="p", name="demo", mode="offline", tags=["a"]), **QUIET
    )
    log = MetricsLogger(tmp_path, 4, start_step=1, config=cfg)
    log.log(1, {"train/loss": 0.5, "rollout/reward_mean": 0.25, "train/skipped_step": True})
    log.log(2, {"train/loss": float("nan"), "rollout/reward_mean": 0.75})
    resolved = {"seed": 3, "model": {"mtp": {"mtp_num_layers": 2}}, "logging": {"wandb": {"project": "p"}}}
    log.save_config(resolved)
    log.close()
    run = fake_wandb.runs[0]
    assert run.kwargs["project"] == "p" and run.kwargs["name"] == "demo" and run.kwargs["mode"] == "offline"
    assert run.kwargs["tags"] == ["a"] and run.kwargs["dir"] == str(tmp_path)
    assert run.kwargs["id"] is None and run.kwargs["resume"] is None  # a fresh run
    assert run.logged[0] == (1, {"train/loss": 0.5, "rollout/reward_mean": 0.25, "train/skipped_step": 1})
    assert run.logged[1][0] == 2 and run.logged[1][1]["rollout/reward_mean"] == 0.75
    assert run.config.data == resolved and run.finished
    assert (tmp_path / RUN_ID_FILE).read_text() == "run123"

    # resume at step 3 (steps 1-2 kept in metrics.jsonl): the same W&B run continues
    log = MetricsLogger(tmp_path, 4, start_step=3, config=cfg)
    log.log(3, {"train/loss": 0.1})
    log.close()
    again = fake_wandb.runs[1]
    assert again.kwargs["id"] == "run123" and again.kwargs["resume"] == "allow"
    assert again.logged == [(3, {"train/loss": 0.1})]


def test_configured_but_not_installed_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="pip install"):
        WandbConfig(project="p")
    from _configs import demo_config

    with pytest.raises(ValueError, match="wandb package is not installed"):
        demo_config(["logging.wandb={project: p}"])
    assert WandbConfig(project="p", mode="disabled").mode == "disabled"  # off: nothing to import


def test_tensorboard_gets_the_resolved_config_as_text(tmp_path):
    log = MetricsLogger(tmp_path, 2, config=LoggingConfig(**QUIET))
    log.save_config({"seed": 7, "rollout": {"max_new_tokens": 8}})
    log.log(0, {"train/loss": 1.0})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("config/text_summary")
    text = events[0].tensor_proto.string_val[0].decode()
    assert text == "```yaml\nseed: 7\nrollout:\n  max_new_tokens: 8\n```"
    assert text[len("```yaml\n") : -3] == (tmp_path / "config.yaml").read_text()


def _wandb_records(data: bytes):
    """The records of a ``.wandb`` file: LevelDB's log format (32 KiB blocks; each record has a
    7-byte header crc32 / length / type FULL=1 FIRST=2 MIDDLE=3 LAST=4) after a 7-byte file header.
    Read here so that the test checks what was written, not what the wandb client holds."""
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # the rest of a block is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk


def _read_offline_history(run_file):
    from wandb.proto import wandb_internal_pb2

    history, config = [], {}
    for data in _wandb_records(run_file.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            )
        elif kind == "config":
            for item in rec.config.update:
                config[item.key] = json.loads(item.value_json)
    return history, config


def test_real_wandb_offline_run_holds_the_metrics_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    cfg = LoggingConfig(tensorboard=False, wandb=WandbConfig(project="splitrl-test", name="t", mode="offline"), **QUIET)
    log = MetricsLogger(tmp_path, 3, start_step=1, config=cfg)
    for step, loss in [(1, 0.5), (2, 0.25), (3, 0.125)]:
        log.log(step, {"train/loss": loss, "rollout/reward_mean": step / 10})
    log.save_config({"seed": 11, "model": {"mtp": {"mtp_num_layers": 2}}})
    log.close()
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    # run.finish() returns once the W&B service has the records; its writer may still be putting
    # them in the file (CI once read a file with none: a loaded machine). teardown() waits for the
    # service to close its streams; the poll covers a writer that is slower still.
    import wandb

    wandb.teardown()
    expected = [(1, 0.5, 0.1), (2, 0.25, 0.2), (3, 0.125, 0.3)]

    def rows():
        history, _ = _read_offline_history(run_files[0])
        return [(h["_step"], h["train/loss"], h["rollout/reward_mean"]) for h in history if "train/loss" in h]

    wait_until(lambda: rows() == expected, timeout_s=120, what=f"the history records {expected} in {run_files[0]}")
    _, config = _read_offline_history(run_files[0])
    assert config["seed"] == 11 and config["model"] == {"mtp": {"mtp_num_layers": 2}}


def test_online_mode_without_an_api_key_is_refused_before_any_worker_starts():
    """Kind: an error raised after state changed (a new user's trial). `logging.wandb={project: p}`
    (online) without a W&B key, run under nohup / a scheduler (no terminal), loaded the model, then
    died in wandb.init with a UsageError traceback. Now preflight refuses it in one line."""
    import types

    import pytest

    from splitrl.logging.wandb_logger import WandbConfig, check_credentials

    calls = []

    def stand_in(configured):
        def login(**kwargs):
            calls.append(kwargs)
            return configured

        return types.SimpleNamespace(login=login)

    online = WandbConfig(project="p")
    with pytest.raises(ValueError, match="no W&B API key is configured.*logging.wandb.mode=offline"):
        check_credentials(online, stand_in(False), interactive=False)
    assert calls == [{"prompt": False, "verify": False}]  # never prompts, never goes to the network
    check_credentials(online, stand_in(True), interactive=False)
    check_credentials(online, stand_in(False), interactive=True)  # wandb.init asks on the terminal
    check_credentials(WandbConfig(project="p", mode="offline"), stand_in(False), interactive=False)
    check_credentials(None, stand_in(False), interactive=False)
    assert len(calls) == 2


def test_preflight_checks_wandb_credentials(tmp_path, monkeypatch):
    """The check above is wired into preflight (before any worker starts)."""
    import pytest

    from _configs import demo_config
    from splitrl.controller import preflight as C

    def refuse(config, *a, **k):
        if config is not None:
            raise ValueError("no W&B API key")

    monkeypatch.setattr(C, "check_wandb_credentials", refuse)
    cfg = demo_config([f"output_dir={tmp_path}", "logging.wandb={project: p}", "cluster.backend=local"])
    with pytest.raises(ValueError, match="no W&B API key"):
        C.preflight(cfg)
