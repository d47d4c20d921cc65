"""MetricsLogger: metrics.jsonl, TensorBoard events, resume truncation, config.yaml, progress bar."""

import json
import math
import time

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from splitrl.logging import LoggingConfig, MetricsLogger, progress_postfix, read_metrics

QUIET = LoggingConfig(progress_bar=False, plot=False)
JSONL_ONLY = LoggingConfig(tensorboard=False, progress_bar=False, plot=False)


def step_metrics(step: int, run: int = 0) -> dict:
    return {
        "train/loss": 1.5 / (step + 1) + run,
        "train/mtp/mtp_1_acceptance_rate": 40.0 + step,
        "train/reward": 0.125 * step,
        "buffer/evicted_groups": step * 2,
    }


def tensorboard_scalars(out_dir, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(out_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_jsonl_holds_exactly_what_was_logged(tmp_path):
    logged = {
        "train/loss": 0.731,
        "train/lr": 3e-6,
        "train/mtp/mtp_2_loss": 2.5,
        "buffer/evicted_groups": 7,
        "train/skipped_step": True,
    }
    with MetricsLogger(tmp_path, total_steps=3, config=JSONL_ONLY) as logger:
        logger.log(0, logged)
        logger.log(2, {"rollout/tokens_per_s": 812.25})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 0, **logged, "train/skipped_step": 1},
        {"step": 2, "rollout/tokens_per_s": 812.25},
    ]
    # Integer counters stay integers (no "7.0" in the file).
    assert '"buffer/evicted_groups": 7,' in lines[0]
    assert read_metrics(tmp_path / "metrics.jsonl")[1] == {"step": 2, "rollout/tokens_per_s": 812.25}


def test_non_finite_values_are_strings_in_jsonl_and_floats_when_read(tmp_path):
    with MetricsLogger(tmp_path, total_steps=1, config=JSONL_ONLY) as logger:
        logger.log(0, {"train/loss": math.nan, "train/grad_norm": math.inf, "train/kl": -math.inf})

    line = (tmp_path / "metrics.jsonl").read_text().strip()
    # Standard JSON (no bare NaN/Infinity tokens), so strict parsers accept it.
    parsed = json.loads(line, parse_constant=lambda token: pytest.fail(f"non-standard token {token}"))
    assert parsed == {"step": 0, "train/loss": "nan", "train/grad_norm": "inf", "train/kl": "-inf"}
    [record] = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(record["train/loss"])
    assert record["train/grad_norm"] == math.inf and record["train/kl"] == -math.inf


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    with MetricsLogger(tmp_path, total_steps=3, config=QUIET) as logger:
        for step in range(3):
            logger.log(step, step_metrics(step))

    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert tensorboard_scalars(tmp_path, "train/loss") == [
        (step, pytest.approx(1.5 / (step + 1), rel=1e-6)) for step in range(3)
    ]
    assert tensorboard_scalars(tmp_path, "buffer/evicted_groups") == [(0, 0.0), (1, 2.0), (2, 4.0)]


def test_resume_drops_steps_at_and_after_the_resume_step(tmp_path):
    with MetricsLogger(tmp_path, total_steps=6, config=QUIET) as logger:
        for step in range(5):  # interrupted after step 4
            logger.log(step, step_metrics(step, run=0))
    # A resumed run starts in a later second, and TensorBoard reads event files in name order:
    # events.out.tfevents.<second>.<host>.<pid>.<writer number of the process>. Two writers of one
    # process within one second sort by that number as text, so writer 10 came before writer 9
    # (CI: the resumed run's events were read first and purged). Wait for the next second, as a
    # real resume does.
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.05)

    with MetricsLogger(tmp_path, total_steps=6, start_step=3, config=QUIET) as logger:
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
        for step in range(3, 6):
            logger.log(step, step_metrics(step, run=100))

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["train/loss"] for r in records] == [1.5 / (s + 1) + (0 if s < 3 else 100) for s in range(6)]
    # TensorBoard shows each step once, with the resumed run's values from step 3 on.
    assert [(s, round(v, 3)) for s, v in tensorboard_scalars(tmp_path, "train/loss")] == [
        (s, round(1.5 / (s + 1) + (0 if s < 3 else 100), 3)) for s in range(6)
    ]


def test_fresh_run_in_an_old_directory_starts_an_empty_record(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "train/loss": 9.0}\n')
    with MetricsLogger(tmp_path, total_steps=1, config=JSONL_ONLY) as logger:
        logger.log(0, {"train/loss": 1.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "train/loss": 1.0}]


def test_resume_drops_a_partly_written_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "train/loss": 2.0}\n{"step": 1, "train/lo')
    with pytest.warns(UserWarning, match="partly written"):
        logger = MetricsLogger(tmp_path, total_steps=4, start_step=2, config=JSONL_ONLY)
    logger.log(2, {"train/loss": 1.0})
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "train/loss": 2.0}, {"step": 2, "train/loss": 1.0}]


def test_resume_says_which_steps_it_drops(tmp_path, caplog):
    """Kind: data dropped without a word (new user). A run stopped 18 steps after its last
    checkpoint lost those steps' records on resume and nothing said so; now a warning names them."""
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {k}, "train/loss": 1.0}}\n' for k in range(1, 23)))
    with caplog.at_level("WARNING", logger="splitrl.logging.logger"):
        MetricsLogger(tmp_path, total_steps=30, start_step=5, config=JSONL_ONLY).close()
    assert "dropping the records of steps 5-22" in caplog.text and "from step 5" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    caplog.clear()
    with caplog.at_level("WARNING", logger="splitrl.logging.logger"):
        MetricsLogger(tmp_path, total_steps=30, start_step=5, config=JSONL_ONLY).close()
    assert "dropping" not in caplog.text  # nothing past the resume step: nothing said
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {k}, "train/loss": 1.0}}\n' for k in range(1, 4)))
    with caplog.at_level("WARNING", logger="splitrl.logging.logger"):
        MetricsLogger(tmp_path, total_steps=30, start_step=3, config=JSONL_ONLY).close()
    assert "dropping the records of step 3," in caplog.text  # one step: not "steps 3-3"


def test_resume_rejects_a_corrupt_record_and_leaves_it_untouched(tmp_path):
    text = '{"step": 0}\nnot json\n{"step": 1}\n'
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not valid JSON"):
        MetricsLogger(tmp_path, total_steps=4, start_step=1, config=JSONL_ONLY)
    assert (tmp_path / "metrics.jsonl").read_text() == text


@pytest.mark.parametrize(
    ("step", "metrics", "message"),
    [
        (1, {"train/loss": 1.0}, "steps must increase"),
        (0, {"train/loss": 1.0}, "steps must increase"),
        (5, {"step": 1.0}, "reserved"),
        (5, {"train/loss": "high"}, "must be scalar numbers"),
        (5, {"train/loss": [1.0, 2.0]}, "must be scalar numbers"),
    ],
)
def test_bad_log_calls_raise_and_write_nothing(tmp_path, step, metrics, message):
    logger = MetricsLogger(tmp_path, total_steps=9, config=JSONL_ONLY)
    logger.log(1, {"train/loss": 0.5})
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=message):
        logger.log(step, metrics)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    logger.log(2, {"train/loss": 0.25})  # the logger is still usable
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_step_before_resume_step_and_log_after_close_are_rejected(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=9, start_step=4, config=JSONL_ONLY)
    with pytest.raises(ValueError, match="before start_step=4"):
        logger.log(3, {"train/loss": 1.0})
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(4, {"train/loss": 1.0})


@pytest.mark.parametrize(("total_steps", "start_step"), [(0, 0), (5, -1), (5, 6)])
def test_bad_construction_raises_before_creating_anything(tmp_path, total_steps, start_step):
    out_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="total_steps|start_step"):
        MetricsLogger(out_dir, total_steps, start_step=start_step)
    assert not out_dir.exists()


def test_disabled_sinks_write_nothing(tmp_path):
    off = LoggingConfig(tensorboard=False, jsonl=False, progress_bar=False, plot=False)
    with MetricsLogger(tmp_path, total_steps=2, config=off) as logger:
        logger.log(0, {"train/loss": 1.0})
    assert list(tmp_path.iterdir()) == []


def test_logging_config_rejects_unknown_keys():
    with pytest.raises(ValidationError, match="tensorbord"):
        LoggingConfig.model_validate({"tensorbord": False})


def test_save_config_round_trips_through_yaml(tmp_path):
    config = {
        "model": {"name": "tiny-qwen3", "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.1},
        "grpo": {"clip": [0.2, 0.28], "kl_coef": 0.0, "loss_type": "TOKEN_LEVEL"},
        "seed": 7,
        "resume": None,
    }
    logger = MetricsLogger(tmp_path, total_steps=1, config=JSONL_ONLY)
    path = logger.save_config(config)
    logger.close()
    assert path == tmp_path / "config.yaml"
    loaded = yaml.safe_load(path.read_text())
    assert loaded == config
    assert list(loaded) == list(config)  # written in the given order, not sorted


def test_save_config_accepts_pydantic_models_and_rejects_unrepresentable_values(tmp_path):
    class RunConfig(BaseModel):
        model_config = ConfigDict(extra="forbid")
        out_dir: str = "runs/a"
        logging: LoggingConfig = LoggingConfig(plot=False)

    logger = MetricsLogger(tmp_path, total_steps=1, config=JSONL_ONLY)
    logger.save_config(RunConfig())
    loaded = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert RunConfig.model_validate(loaded) == RunConfig()
    with pytest.raises(ValueError, match="cannot represent"):
        logger.save_config({"out_dir": tmp_path})
    logger.close()


def test_progress_postfix_shows_the_headline_metrics():
    metrics = {
        "train/loss": 0.012345,
        "train/reward": 0.5,
        "train/mtp/mtp_1_acceptance_rate": 61.27,
        "train/mtp/mtp_2_acceptance_rate": 30.0,
        "rollout/tokens_per_s": 1520.4,
        "timing/train_s": 3.0,
    }
    assert progress_postfix(7, metrics) == {
        "step": "7",
        "reward": "0.5",
        "loss": "0.01235",
        "mtp_acc": "61.3%",
        "tok/s": "1520",
    }
    assert progress_postfix(0, {"train/reward": 0.25}) == {"step": "0", "reward": "0.25"}
    # a NaN is left out (the bar showed tok/s=nan), or the next key of the field is shown
    nan = float("nan")
    assert progress_postfix(3, {"train/reward": 0.5, "rollout/tokens_per_s": nan, "train/mtp/mtp_1_acceptance_rate": nan}) == {
        "step": "3", "reward": "0.5"}  # fmt: skip
    assert progress_postfix(3, {"rollout/tokens_per_s": nan, "train/tokens_per_s": 900.0})["tok/s"] == "900"


def test_progress_bar_counts_from_the_resume_step(tmp_path, capsys):
    config = LoggingConfig(tensorboard=False, jsonl=False, plot=False)
    with MetricsLogger(tmp_path, total_steps=10, start_step=6, config=config) as logger:
        logger.log(6, {"train/reward": 0.75, "train/loss": 2.0})
        logger.log(7, {"train/reward": 0.875, "train/loss": 1.0})
    err = capsys.readouterr().err
    assert "8/10" in err
    assert "step=7, reward=0.875, loss=1" in err
