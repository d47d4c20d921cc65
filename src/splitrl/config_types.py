"""Field types shared by the typed config sections (run, model, tokenizer), and what an odd path is."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator

# A filesystem path as the user wrote it, with a leading ``~`` expanded: the shell does not expand
# it inside key=value overrides, so ``output_dir=~/runs/x`` made a directory named ``~`` in the
# working directory.
UserPath = Annotated[str, AfterValidator(os.path.expanduser)]


def path_problem(path: str | Path) -> str | None:
    """What ``path`` is when it is neither a regular file, a directory nor simply absent, for
    messages: a symbolic link that loops or points nowhere (for the link itself or a folder on the
    way to it), a pipe (FIFO), a character or block device, a socket. None otherwise."""
    p = Path(path)
    for part in [*reversed(p.parents), p]:
        try:
            os.stat(part)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"{'' if part == p else f'under {str(part)!r}, '}a symbolic link that loops (it leads back to itself)"
            if e.errno == errno.ENOENT and part.is_symlink():
                where = "" if part == p else f"under {str(part)!r}, "
                return f"{where}a symbolic link to {os.readlink(part)!r}, which does not exist"
            return None
    mode = os.stat(p).st_mode
    for test, kind in (
        (stat.S_ISFIFO, "a pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return None
