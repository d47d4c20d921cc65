"""bench/bench_colocated.py runs end to end on a tiny model (CPU) and prints every phase."""

from _bench import load_bench


def test_bench_colocated_prints_each_phase(capsys):
    bench = load_bench("bench_colocated")
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--gen-batch", "2", "--prompt-len", "4",
                       "--new-tokens", "4", "--big-samples", "2", "--small-samples", "1", "--train-len", "16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    for phase in ("warm (before any train step)", "after a small train step", "after a large train step",
                  "and the call after that", "after a large train step + empty_cache()"):  # fmt: skip
        line = next(ln for ln in out.splitlines() if phase in ln)
        assert "plain" in line and "speculative" in line, line
    assert out.count("train step:") == 3
