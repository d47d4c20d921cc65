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
