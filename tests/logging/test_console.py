"""Issue 6 item 8, the console part: a console whose reader is gone stops nothing."""

import os
import warnings

from tqdm.utils import DisableOnWriteError

from splitrl.logging import LoggingConfig, MetricsLogger, read_metrics
from splitrl.logging.console import GuardedStream


def _dead_pipe_stream():
    r, w = os.pipe()
    os.close(r)  # the reader (tee) is gone: every write fails with EPIPE
    return os.fdopen(w, "w", buffering=1)


def test_a_guarded_stream_swallows_a_dead_reader_and_silences_its_descriptor():
    """Kind: BrokenPipeError from a console write ends the run. Before the guard the first write
    raised; after it every write, flush and raw write to the descriptor succeeds, unseen."""
    raw = _dead_pipe_stream()
    try:
        raw.write("x\n")
        raise AssertionError("the unguarded write should have failed")
    except BrokenPipeError:
        pass
    stream = GuardedStream(raw)
    stream.write("progress 1/10\n")
    stream.flush()
    assert stream.dead
    os.write(raw.fileno(), b"from C code\n")  # now /dev/null: no EPIPE
    print("and print", file=stream)


def test_the_metrics_logger_outlives_a_dead_progress_bar(tmp_path):
    """Kind: the progress bar's write error stops the step before its checkpoint (library use,
    without the CLI's guard): the bar turns itself off with a warning, the metrics are recorded."""
    logger = MetricsLogger(tmp_path, 3, config=LoggingConfig(tensorboard=False, plot=False))
    # tqdm's output stream, wrapped as tqdm wraps it (it turns itself off on EIO, not on EPIPE)
    logger._bar.fp = DisableOnWriteError(_dead_pipe_stream(), logger._bar)
    logger._bar.mininterval = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            logger.log(step, {"rollout/reward_mean": 0.5})
        logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert any("progress bar turned off" in str(w.message) for w in caught)
