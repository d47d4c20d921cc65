"""bench/bench_train_step.py's interleaved timing: rounds alternate their order and each
function's ratio to the first is taken within a round, so a drift of the machine's speed cancels."""

from _bench import load_bench


def test_interleaved_rounds_alternate_and_ratios_cancel_a_drift(monkeypatch):
    bench = load_bench("bench_train_step")
    clock = {"t": 0.0}
    calls: list[str] = []
    # B does 0.9 of A's work; the machine slows down by 50 % a call (a steady drift)
    speed = {"n": 0}

    def work(name, units):
        def run():
            calls.append(name)
            speed["n"] += 1
            clock["t"] += units * (1.5 ** speed["n"])

        return run

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock["t"])
    med, ratio = bench.time_interleaved({"A": work("A", 1.0), "B": work("B", 0.9)}, "cpu", repeats=4, warmups=1)
    assert calls == ["A", "B", "A", "B", "B", "A", "A", "B", "B", "A"]  # warm-ups, then A B, B A, A B, B A
    # B runs 1/0.9 as fast as A; each forward-reverse pair of rounds cancels the drift exactly
    assert ratio["A"] == 1.0
    assert abs(ratio["B"] - 1 / 0.9) < 1e-9
    assert set(med) == {"A", "B"}
    _, odd = bench.time_interleaved({"A": work("A", 1.0), "B": work("B", 0.9)}, "cpu", repeats=3, warmups=0)
    assert abs(odd["B"] - 1 / 0.9) < 1e-9  # 3 rounds run as 4: pairs stay whole


def test_the_scale_presets_default_to_the_planned_mode():
    bench = load_bench("bench_train_step")
    for preset in ("qwen3-1.7b", "qwen3-4b", "qwen3-8b"):
        args = bench.parse_args(["--preset", preset])
        assert (args.mode, args.mtp, args.samples, args.max_tokens) == ("planned", 1, 32, "auto")
    full = bench.parse_args(["--preset", "qwen3-0.6b"])  # the recorded comparison keeps its defaults
    assert (full.mode, full.mtp, full.samples, full.max_tokens) == ("full", 2, 16, 8192)
    assert bench.parse_args(["--preset", "tiny", "--mode", "planned", "--max-tokens", "512"]).max_tokens == 512


def test_planned_mode_runs_tiny_on_cpu_with_offload(capsys):
    """The planned run on CPU: the plan's line, tokens/s, the estimate (no CUDA peak to measure
    here) and the offloaded AdamW step's phases."""
    bench = load_bench("bench_train_step")
    argv = ["--device", "cpu", "--preset", "tiny", "--mode", "planned", "--offload", "--repeats", "1"]
    bench.main(argv + ["--samples", "2", "--also-samples", "3", "--prompt", "8", "--response", "8", "--max-tokens", "64"])
    out = capsys.readouterr().out
    assert "memory plan:" in out and "host: fp32 masters 4 + AdamW 8" in out
    assert "microbatch budget 64 tokens" in out
    # one timed line per step size, the --also-samples step with the same worker
    assert "splitrl, 1 MTP, packed, sync, planned, 2 samples:" in out and "tokens/s" in out
    assert "splitrl, 1 MTP, packed, sync, planned, 3 samples:" in out
    assert "peak memory: not measured on cpu" in out
    assert "offloaded AdamW step (last step): wait_grads" in out
