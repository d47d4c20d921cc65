"""A console that may die without taking the run with it.

``splitrl train 2>&1 | tee log`` followed by Ctrl-C kills ``tee`` together with splitrl (the
terminal interrupts the whole foreground process group). From then on every write to stdout or
stderr fails with ``BrokenPipeError`` (EPIPE: Python ignores SIGPIPE), and an exception raised by
a progress bar or a ``print`` would stop the run before its final checkpoint. A stream guarded
here swallows the first such failure, points its file descriptor at ``/dev/null`` (so that writes
from C code, child processes and Python's own flush at exit cannot fail either), and drops
everything written afterwards. Output only stops where it could not be delivered anyway; the
run's record (``metrics.jsonl``, checkpoints) does not depend on the console.
"""

from __future__ import annotations

import errno
import io
import os
import sys
from typing import TextIO

# errors that mean "nobody reads this stream any more"
_DEAD_ERRNOS = {errno.EPIPE, errno.EBADF, errno.ECONNRESET, errno.EIO}


class GuardedStream(io.TextIOBase):
    """A text stream that stops writing, silently, once its reader is gone.

    Args:
        stream: the stream to write to (``sys.stdout`` or ``sys.stderr``).

    Attributes:
        dead: True after the first write or flush that failed with a dead-reader error.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.dead = False

    def _died(self) -> None:
        self.dead = True
        try:
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, fd)  # later writes by anyone to this descriptor succeed, unseen
            finally:
                os.close(null)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass

    def _guard(self, call, *args):
        if self.dead:
            return None
        try:
            return call(*args)
        except BrokenPipeError:
            self._died()
        except OSError as e:
            if e.errno not in _DEAD_ERRNOS:
                raise
            self._died()
        except ValueError:  # "I/O operation on closed file"
            if not getattr(self._stream, "closed", False):
                raise
            self.dead = True
        return None

    def write(self, text: str) -> int:
        self._guard(self._stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        try:
            return (not self.dead) and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self._stream, "errors", None)


def guard_console() -> None:
    """Replace ``sys.stdout`` and ``sys.stderr`` by :class:`GuardedStream` s (idempotent).

    Call it before anything captures the streams (logging handlers, progress bars).
    """
    if not isinstance(sys.stdout, GuardedStream) and sys.stdout is not None:
        sys.stdout = GuardedStream(sys.stdout)
    if not isinstance(sys.stderr, GuardedStream) and sys.stderr is not None:
        sys.stderr = GuardedStream(sys.stderr)
