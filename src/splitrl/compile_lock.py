"""One lock around every ``torch.compile``'d call of the process.

Under the local backend the train worker and the rollout engine run on two threads of one
process. While one thread compiles (Dynamo / AOTAutograd trace with FX), torch sets a process-wide
"FX tracing" flag, and a compiled function entered meanwhile from the other thread fails with
"Detected that you are using FX to symbolically trace a dynamo-optimized function" (seen on a
GPU with `splitrl train --config examples/qwen3_0p6b_gpu.yaml`). Holding one lock
for the duration of each compiled call makes compilation exclusive. A compiled call only launches
kernels, so outside compilation the lock is held for microseconds; with one GPU shared by both
threads nothing runs less in parallel than before.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

COMPILE_LOCK = threading.RLock()


def serialized(fn: F) -> F:
    """``fn`` called under :data:`COMPILE_LOCK` (re-entrant: nested compiled calls are fine)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with COMPILE_LOCK:
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
