"""bench/bench_e2e.py's figures: the steady-state formulas of its docstring on hand-made metrics
(kind of bug guarded: a benchmark that counts the warm-up step, or tokens per sample instead of
per step)."""

from pathlib import Path

import pytest

from _bench import load_bench
from _configs import demo_config
from splitrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _step(step_s, prompt_len, response_len, reward=0.5):
    return {
        "timing/step_s": step_s,
        "rollout/prompt_length_mean": prompt_len,
        "rollout/response_length_mean": response_len,
        "timing/exposed_wait_s": 0.1 * step_s,
        "timing/generation_during_train_s": 0.2 * step_s,
        "train/reward": reward,
        "rollout/response_length_max": 2 * response_len,
        "rollout/truncation_rate": response_len / 100,
    }


def test_figures_pool_the_steady_state_steps_of_every_run():
    cfg = demo_config(["schedule.groups_per_step=4", "schedule.group_size=2"])  # 8 samples a step
    runs = [
        [_step(100.0, 9, 9), _step(2.0, 10, 6), _step(2.0, 12, 4, reward=0.25)],  # step 1 (100 s) left out
        [_step(50.0, 9, 9), _step(4.0, 10, 2)],
    ]
    f = load_bench("bench_e2e").figures(cfg, runs)
    wall = 2.0 + 2.0 + 4.0
    assert f["samples_per_s"] == pytest.approx(3 * 8 / wall)
    assert f["gen_tokens_per_s"] == pytest.approx((6 + 4 + 2) * 8 / wall)
    assert f["trained_tokens_per_s"] == pytest.approx((16 + 16 + 12) * 8 / wall)
    assert f["step_s"] == pytest.approx(wall / 3)
    assert f["step1_s"] == pytest.approx(75.0)
    assert f["wait_s"] == pytest.approx(0.1 * wall / 3)
    assert f["overlap_s"] == pytest.approx(0.2 * wall / 3)
    # observed lengths of the steady steps: a mean over steps, the largest max (step 1's 18 left out)
    assert f["response_length_mean"] == pytest.approx((6 + 4 + 2) / 3)
    assert f["response_length_max"] == 12
    assert f["truncation_rate"] == pytest.approx((6 + 4 + 2) / 300)


def test_each_schedule_is_a_valid_config():
    bench = load_bench("bench_e2e")
    for name, overrides in bench.SCHEDULES.items():
        cfg = load_config(ROOT / "examples" / "cpu_demo.yaml", bench.COMMON + overrides)
        assert cfg.schedule.mode == name.split()[0] and not cfg.eval.enabled and cfg.checkpoint.every == 0, name
        assert cfg.buffer.max_staleness == (1 if name == "async s=1" else 0), name


def test_bench_config_errors_are_usage_errors_before_any_run(capsys, tmp_path):
    """Kind: a raw traceback instead of a clear error (a new user's trial). A misspelled override
    of bench_e2e.py, a missing --config of bench_checkpoint.py / bench_weight_sync.py and
    `bench_rollout.py --batch-sizes 0` each raised a Python traceback (bench_e2e only when its run
    started); now each is one usage error (exit 2) before anything runs."""
    missing = str(tmp_path / "nowhere.yaml")
    calls = [
        (lambda: load_bench("bench_e2e").parse_args(["--steps", "2", "num_step=3"]), "sync: invalid config"),
        (
            lambda: load_bench("bench_e2e").parse_args(["--schedules", "async s=1", "rollout.top_k=1"]),
            "async s=1: invalid config",
        ),
        (lambda: load_bench("bench_checkpoint").main(["--device", "cpu", "--config", missing]), "does not exist"),
        (lambda: load_bench("bench_weight_sync").main(["--device", "cpu", "--config", missing]), "does not exist"),
        (lambda: load_bench("bench_rollout").parse_args(["--batch-sizes", "1,0"]), "positive integers"),
    ]
    for call, why in calls:
        with pytest.raises(SystemExit) as e:
            call()
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and "Traceback" not in err
    assert load_bench("bench_e2e").parse_args(["--steps", "2", "cluster.backend=local"]).steps == 2


def test_overrides_the_bench_replaces_are_usage_errors(capsys, tmp_path):
    """Kind: a setting silently without effect. `bench_e2e.py num_steps=5` ran 6 steps a run and
    `output_dir=x` wrote elsewhere (the bench's own num_steps / output_dir / schedule come after
    the user's overrides); `--output-dir` naming a file raised a traceback after the warm-up had
    started. Each is now a usage error (exit 2) that names the flag to use instead."""
    afile = tmp_path / "afile"
    afile.write_text("")
    calls = [
        (["schedule.num_steps=5"], "use --steps"),
        (["output_dir=/tmp/x"], "use --output-dir"),
        (["schedule.mode=sync"], "use --schedules"),
        (["buffer.max_staleness=2"], "use --schedules"),
        (["checkpoint.every=3"], "remove the override"),
        (["--output-dir", str(afile)], "lies under) a file"),
        (["--output-dir", str(afile / "sub")], "lies under) a file"),
    ]
    for argv, why in calls:
        with pytest.raises(SystemExit) as e:
            load_bench("bench_e2e").parse_args(["--steps", "2", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and "Traceback" not in err, (argv, err)
    assert load_bench("bench_e2e").parse_args(["--steps", "2", "buffer.capacity_groups=32"]).overrides == [
        "buffer.capacity_groups=32"
    ]


DEMO = ROOT / "examples" / "cpu_demo.yaml"


def test_stop_prob_ids_count_to_p_times_vocab_and_spell_no_text():
    """Kind: ragged-length stop ids that collide with text (a digit that ends every answer) or
    that miss P·vocab. The CPU demo's tokenizer spells text with ids 4..21 (specials 0..3, EOS 2)."""
    bench = load_bench("bench_e2e")
    cfg = load_config(DEMO, ["model.backbone.vocab_size=1000", "rollout.stop_token_ids=[500,2]"])
    ids = bench.stop_token_ids(cfg, 0.25)
    # 250 stopping ids in all: the config's 500 and 2 (EOS) + the 248 highest free ids
    assert ids == [500, 2] + list(range(752, 1000)) and len(set(ids)) == 250
    assert bench.stop_token_ids(load_config(DEMO, ["model.backbone.vocab_size=1000"]), 0.1) == list(range(901, 1000))
    # vocab 22: only <unk> (3) and <bos> (1) are neither text nor pad; EOS already stops (~1/22)
    assert bench.stop_token_ids(load_config(DEMO, []), 0.1) == [3]
    assert bench.stop_token_ids(load_config(DEMO, []), 0.13) == [1, 3]
    assert bench.stop_token_ids(load_config(DEMO, []), 0.05) == []
    with pytest.raises(ValueError, match="use --stop-prob <= 0.136"):
        bench.stop_token_ids(load_config(DEMO, []), 0.2)


def test_stop_prob_out_of_range_is_a_usage_error(capsys):
    for p in ["1", "-0.1", "0.01"]:  # 0.01 * 22 rounds to 0 ids
        with pytest.raises(SystemExit) as e:
            load_bench("bench_e2e").parse_args(["--config", str(DEMO), "--stop-prob", p])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--stop-prob" in err and "Traceback" not in err, p


def test_help_lists_every_key_the_bench_sets(capsys):
    """Kind: documentation out of step with the code. `--help` listed the keys an override may not
    set by hand, and missed chunk_order when the arrival schedule made it one."""
    bench = load_bench("bench_e2e")
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    listed = out.split("not the keys the bench sets:", 1)[1].split(")", 1)[0]
    assert [k.strip() for k in listed.split(",")] == list(bench.BENCH_KEYS) and "chunk_order" in listed


def test_a_config_error_with_stop_prob_is_not_blamed_on_stop_prob(capsys):
    """Kind: an error that names the wrong cause (a new user's trial). `--stop-prob 0.136
    backend=local dataplane.kind=transferqueue` on the CPU demo said `--stop-prob
    0.136: invalid config: ...`, as if the probability were wrong; the config error now names the
    schedule it was loaded for, as without --stop-prob."""
    with pytest.raises(SystemExit) as e:
        load_bench("bench_e2e").parse_args(
            [
                "--config",
                str(DEMO),
                "--stop-prob",
                "0.136",
                "--schedules",
                "async s=1",
                "cluster.backend=local",
                "dataplane.kind=transferqueue",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and "async s=1: invalid config" in err and "dataplane.kind=inprocess" in err, err
    assert "--stop-prob 0.136:" not in err


def test_stop_prob_makes_response_lengths_ragged(capsys):
    """Kind: an option that does not reach the runs. A near-uniform random-init model (vocab 1000,
    EOS 1 id of 1000) runs almost every response to max_new_tokens=16 (expected mean 15.9); with
    --stop-prob 0.25 the lengths are about geometric, expected mean (1 - 0.75^16) / 0.25 = 3.96."""
    common = [
        "--config",
        str(DEMO),
        "--steps",
        "2",
        "--warmup-steps",
        "0",
        "--schedules",
        "sync",
        "cluster.backend=local",
        "dataplane.kind=inprocess",
        "model.backbone.vocab_size=1000",
        "rollout.max_new_tokens=16",
        "schedule.groups_per_step=4",
        "schedule.group_size=4",
        "schedule.min_groups_per_chunk=2",
        "schedule.generation_groups_per_call=4",
    ]
    full = load_bench("bench_e2e").main(common)["sync"]
    ragged = load_bench("bench_e2e").main(common + ["--stop-prob", "0.25"])["sync"]
    out = capsys.readouterr().out
    assert full["response_length_mean"] >= 15.0 and full["response_length_max"] == 16 and full["truncation_rate"] >= 0.9
    assert 2.5 <= ragged["response_length_mean"] <= 6.0 and ragged["truncation_rate"] <= 0.2
    assert "249 id(s) in 751-999" in out and "resp mean" in out


def test_bench_checkpoint_bad_dir_is_a_usage_error_and_overwrites_nothing(capsys, tmp_path):
    """Kind: a traceback for a user mistake, and files lost. `bench_checkpoint.py --dir` naming a
    path under a file raised NotADirectoryError after the model and optimizer were built, and a
    --dir holding an earlier run's ck0/ or plain.pt had them overwritten. Both are now usage
    errors (exit 2) before anything is built or written."""
    afile = tmp_path / "afile"
    afile.write_text("")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "plain.pt").write_bytes(b"an earlier result")
    for d, why in [(afile / "x", "cannot create the directory"), (earlier, "would overwrite them")]:
        with pytest.raises(SystemExit) as e:
            load_bench("bench_checkpoint").main(["--device", "cpu", "--dir", str(d)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and "Traceback" not in err, err
    assert (earlier / "plain.pt").read_bytes() == b"an earlier result"
    assert sorted(p.name for p in earlier.iterdir()) == ["plain.pt"]


def test_bench_rollout_bad_flags_are_usage_errors_before_any_model(capsys, tmp_path):
    """Kind: tracebacks and silent no-ops for user mistakes (a new user's trial of
    bench_rollout.py): --temperature 0 / --top-k -1 / --new-tokens 0 printed pydantic tracebacks,
    --repeats 0 an AttributeError, --prompt-len 0 a ValueError, --speculative --mtp-depths 0
    "optimizer got an empty parameter list", --device tpu a RuntimeError, --ragged-mean-len 0 a
    ZeroDivisionError after the table; --baselines foo was timed as a plain HF call named foo and
    --profile into a missing directory failed only after the run. Each is now a usage error (exit 2)."""
    calls = [
        (["--temperature", "0"], "temperature must be > 0"),
        (["--temperature", "inf"], "temperature must be finite"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
        (["--new-tokens", "0"], "--new-tokens must be >= 1"),
        (["--prompt-len", "0"], "--prompt-len must be >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--speculative", "--mtp-depths", "0"], "--mtp-depths >= 1"),
        (["--device", "tpu"], "invalid choice"),
        (["--ragged", "4", "--ragged-mean-len", "0"], "--ragged-mean-len must be a positive"),
        (["--baselines", "hf-eager,foo"], "unknown ['foo']"),
        (["--profile", str(tmp_path / "missing" / "p.txt")], "its directory does not exist"),
    ]
    bench = load_bench("bench_rollout")
    for argv, why in calls:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and why in err and "Traceback" not in err, (argv, err)
    ok = bench.parse_args(["--baselines", "hf-eager,hf-static", "--top-k", "1", "--profile", str(tmp_path / "p.txt")])
    assert ok.baselines == "hf-eager,hf-static" and ok.top_k == 1


def test_a_run_stopped_by_a_signal_exits_with_its_code_not_a_traceback(capsys, monkeypatch, tmp_path):
    """Kind: a traceback for a user's action. Ctrl-C / SIGTERM (`timeout 120 python bench/bench_e2e.py`)
    stops the running train() cleanly, and the bench then raised "RuntimeError: sync: the run
    stopped after 1 of 6 steps". It now says which signal stopped which run and exits 128 + signal."""
    from splitrl.controller.controller import RunResult

    bench = load_bench("bench_e2e")
    monkeypatch.setattr(
        bench,
        "train",
        lambda cfg: RunResult(
            output_dir=str(cfg.output_dir), steps_done=1, stopped_early=True, interrupted=True, interrupt_signal=15
        ),
    )
    with pytest.raises(SystemExit) as e:
        bench.main(
            [
                "--steps",
                "2",
                "--warmup-steps",
                "0",
                "--schedules",
                "sync",
                "--output-dir",
                str(tmp_path),
                "cluster.backend=local",
            ]
        )
    assert e.value.code == 143
    assert "sync: stopped by SIGTERM after 1 of 2 steps" in capsys.readouterr().err
