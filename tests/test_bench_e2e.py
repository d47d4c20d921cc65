"""bench/bench_e2e.py's figures: the steady-state formulas of its docstring on hand-made metrics
(kind of bug guarded: a benchmark that counts the warm-up step, or tokens per sample instead of
per step)."""

import importlib.util
from pathlib import Path

import pytest

from splitrl.config import load_config


ROOT = Path(__file__).resolve().parents[1]


def _bench():
    path = ROOT / "bench" / "bench_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_e2e", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(step_s, prompt_len, response_len, reward=0.5):
    return {
        "timing/step_s": step_s, "rollout/prompt_length_mean": prompt_len, "rollout/response_length_mean": response_len,
        "timing/exposed_wait_s": 0.1 * step_s, "timing/generation_during_train_s": 0.2 * step_s, "train/reward": reward,
    }


def test_figures_pool_the_steady_state_steps_of_every_run():
    cfg = load_config(None, ["groups_per_step=4", "group_size=2"])  # 8 samples a step
    runs = [
        [_step(100.0, 9, 9), _step(2.0, 10, 6), _step(2.0, 12, 4, reward=0.25)],  # step 1 (100 s) left out
        [_step(50.0, 9, 9), _step(4.0, 10, 2)],
    ]
    f = _bench().figures(cfg, runs)
    wall = 2.0 + 2.0 + 4.0
    assert f["samples_per_s"] == pytest.approx(3 * 8 / wall)
    assert f["gen_tokens_per_s"] == pytest.approx((6 + 4 + 2) * 8 / wall)
    assert f["trained_tokens_per_s"] == pytest.approx((16 + 16 + 12) * 8 / wall)
    assert f["step_s"] == pytest.approx(wall / 3)
    assert f["step1_s"] == pytest.approx(75.0)
    assert f["wait_s"] == pytest.approx(0.1 * wall / 3)
    assert f["overlap_s"] == pytest.approx(0.2 * wall / 3)


def test_each_schedule_is_a_valid_config():
    bench = _bench()
    for name, overrides in bench.SCHEDULES.items():
        cfg = load_config(ROOT / "examples" / "cpu_demo.yaml", bench.COMMON + overrides)
        assert cfg.schedule == name.split()[0] and not cfg.eval.enabled and cfg.checkpoint_every == 0, name
        assert cfg.buffer.max_staleness == (1 if name == "async s=1" else 0), name


def _load_bench(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_config_errors_are_usage_errors_before_any_run(capsys, tmp_path):
    """Kind: a raw traceback instead of a clear error (a new user's trial). A misspelled override
    of bench_e2e.py, a missing --config of bench_checkpoint.py / bench_weight_sync.py and
    `bench_rollout.py --batch-sizes 0` each raised a Python traceback (bench_e2e only when its run
    started); now each is one usage error (exit 2) before anything runs."""
    missing = str(tmp_path / "nowhere.yaml")
    calls = [
        (lambda: _bench().parse_args(["--steps", "2", "num_step=3"]), "sync: invalid config"),
        (lambda: _bench().parse_args(["--schedules", "async s=1", "rollout.top_k=1"]), "async s=1: invalid config"),
        (lambda: _load_bench("bench_checkpoint").main(["--device", "cpu", "--config", missing]), "does not exist"),
        (lambda: _load_bench("bench_weight_sync").main(["--device", "cpu", "--config", missing]), "does not exist"),
        (lambda: _load_bench("bench_rollout").parse_args(["--batch-sizes", "1,0"]), "positive integers"),
    ]
    for call, why in calls:
        with pytest.raises(SystemExit) as e:
            call()
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and "Traceback" not in err
    assert _bench().parse_args(["--steps", "2", "backend=local"]).steps == 2
