"""Run checkpoints on disk: written whole or not at all, verified before they are trusted.

Layout: ``output_dir/checkpoints/step_{k:06d}/`` with ``trainer/`` (the train workers' model and
optimizer shards, :mod:`splitrl.train.checkpoint`), ``trainer_state.pt``, ``controller.pt``,
``run_config.json``, ``policy/`` (a Hugging Face export; only every ``checkpoint.export_every`` steps and in
a run's last checkpoint) and, written last, ``COMPLETE``::

    {"step": k, "files": {"trainer/__0_0.distcp": {"size": 1234, "sha256": "..."}, "controller.pt": ...}}

Checkpoints of splitrl before sharded ones hold ``trainer.pt`` (the whole trainer state) instead
of ``trainer/`` and ``trainer_state.pt``; they still load.

A checkpoint is written into ``step_{k:06d}.tmp/`` and renamed into place once ``COMPLETE`` is
in it, so a crash or a full disk leaves either the whole checkpoint or none. The trainer shards
are written in the background while training goes on; ``COMPLETE`` follows only once every
train worker reports its files written. Loading trusts a
checkpoint only when every file listed in ``COMPLETE`` is there with its size and SHA-256 (a
file truncated after the fact, a partly synced disk, a hand-edited directory); a damaged newest
checkpoint is skipped with a warning and the previous intact one is used.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
RUN_CONFIG = "run_config.json"  # the run config the checkpoint was written by (resume checks it)
CONTROLLER_STATE = "controller.pt"  # the controller's own state: buffer, prompt cursor, RNG
TMP_SUFFIX = ".tmp"
# complete checkpoints a run keeps (the newest ones; the newest with a policy/ export is kept too)
KEPT_CHECKPOINTS = 2
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the message says where, why, and what is intact)."""


def format_bytes(n: float) -> str:
    """``n`` bytes for a message: ``512 B``, ``3.4 MiB``, ``12.0 GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f"step_{step:06d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoint directories with a ``COMPLETE`` marker, oldest first (not yet verified)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(TMP_SUFFIX) and (p / COMPLETE).exists()
    )


def unusable_checkpoints(output_dir: str | Path) -> list[tuple[str, str]]:
    """(name, why) of every checkpoint directory that cannot be resumed from: no ``COMPLETE``
    marker (a write that never finished), or damaged (see :func:`damage`); oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.glob("step_*")):
        if not p.is_dir() or p.name.endswith(TMP_SUFFIX):
            continue
        if not (p / COMPLETE).exists():
            out.append((p.name, "incomplete: no COMPLETE marker, its write never finished"))
            continue
        why = _cached_damage(p)
        if why is not None:
            out.append((p.name, f"damaged: {why}"))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest(directory: Path) -> dict[str, dict[str, int | str]]:
    """Size (bytes) and SHA-256 of every file under ``directory``, by relative POSIX path."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != COMPLETE:
            out[p.relative_to(directory).as_posix()] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    return out


def write_complete(directory: Path, step: int) -> None:
    """Write the ``COMPLETE`` marker with the manifest of everything already in ``directory``."""
    text = json.dumps({"step": step, "files": manifest(directory)}, indent=1)
    with open(directory / COMPLETE, "w") as f:
        f.write(text)


def damage(path: Path, under: str = "") -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted, or None when it is intact; with
    ``under`` (e.g. ``"policy/"``) only the files below that prefix are checked.

    A ``COMPLETE`` without a file list (written by an older splitrl) is trusted as before.
    """
    try:
        record = json.loads((path / COMPLETE).read_text())
        int(record["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{COMPLETE} is unreadable ({type(e).__name__}: {e})"
    files = record.get("files")
    if files is None:
        return None
    files = {name: want for name, want in files.items() if name.startswith(under)}
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written"
    for name, want in files.items():  # sizes first: they are cheap and catch truncation
        if _sha256(path / name) != want["sha256"]:
            return f"{name} does not match its SHA-256 (the file changed after it was written)"
    return None


_verified: dict[tuple[str, int], str | None] = {}


def intact_checkpoints(output_dir: str | Path):
    """Checkpoints that pass :func:`damage`, newest first (a generator: each is verified when
    reached). Each damaged one passed over is logged with what is wrong with it."""
    for path in reversed(complete_checkpoints(output_dir)):
        why = _cached_damage(path)
        if why is None:
            yield path
        else:
            log.warning("checkpoint %s is damaged (%s); falling back to an older one", path.name, why)


def _cache_key(path: Path) -> tuple[str, int]:
    """A checkpoint's key in ``_verified``: a rewritten ``COMPLETE`` marker is a new checkpoint."""
    return (str(path), (path / COMPLETE).stat().st_mtime_ns)


def _cached_damage(path: Path) -> str | None:
    """:func:`damage` of a checkpoint with a ``COMPLETE`` marker, computed once per marker
    (preflight, restore and the listing of unusable checkpoints all ask; hashing is slow)."""
    key = _cache_key(path)
    if key not in _verified:
        _verified[key] = damage(path)
    return _verified[key]


def known_damaged(path: Path) -> bool:
    """Whether ``path`` was already found damaged in this process (by :func:`intact_checkpoints`
    or :func:`mark_damaged`); never hashes anything, so it is cheap on every prune."""
    try:
        key = _cache_key(path)
    except OSError:
        return False
    return _verified.get(key) is not None


def mark_damaged(path: Path, why: str) -> None:
    """Record that ``path`` failed to load although its files matched (e.g. a checkpoint of an
    older splitrl without checksums): later calls skip it."""
    _verified[_cache_key(path)] = why


def latest_intact_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest checkpoint that passes :func:`damage`, or None; a damaged newer one is skipped
    with a warning naming what is wrong with it."""
    found = next(intact_checkpoints(output_dir), None)
    if found is not None and found != (complete_checkpoints(output_dir) or [None])[-1]:
        log.warning("resuming from %s, the newest intact checkpoint", found.name)
    return found


def checkpoint_step(path: Path) -> int:
    return int(json.loads((path / COMPLETE).read_text())["step"])


# Temporary files of the run's atomic writes in output_dir (``.{name}.{pid}.tmp``, see
# splitrl.logging.logger.write_atomically; ``{name}.tmp`` too). Only these are leftovers: output_dir
# may be a directory of the user's own (``output_dir=.``) whose ``*.tmp`` files are not ours.
_OWN_TMP = re.compile(r"\.?(metrics\.jsonl|metrics\.png|config\.yaml)(\.\d+)?\.tmp")


def remove_leftovers(output_dir: str | Path) -> list[Path]:
    """Delete what interrupted writes leave behind: ``checkpoints/*.tmp`` directories and the
    temporary files of the run's atomic writes in ``output_dir`` (no other ``*.tmp`` file).
    Returns what was removed."""
    out = Path(output_dir)
    gone = []
    root = checkpoint_root(out)
    if root.is_dir():
        for p in root.glob(f"*{TMP_SUFFIX}"):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            gone.append(p)
    if out.is_dir():
        for p in [*out.glob(f"*{TMP_SUFFIX}"), *out.glob(f".*{TMP_SUFFIX}")]:
            if p.is_file() and _OWN_TMP.fullmatch(p.name):
                p.unlink(missing_ok=True)
                gone.append(p)
    if gone:
        log.info("removed %d leftover(s) of interrupted writes: %s", len(gone), ", ".join(p.name for p in gone))
    return gone


RUN_LOCK = ".splitrl.lock"


class RunDirInUse(ValueError):
    """Another process runs in this ``output_dir`` (a ValueError: the CLI prints it in one line)."""


class RunDirLock:
    """An exclusive lock on ``output_dir`` for the life of a run: ``flock`` on
    ``output_dir/.splitrl.lock``, which holds the owner's pid.

    Why: two runs started in one directory both resumed from the same checkpoint, each dropped
    the other's metrics lines as "logged after the checkpoint", and the last to finish left its
    own record and checkpoints over the other's (a new user's trial, 2026-12-01). The kernel
    releases a ``flock`` when its process dies, so a killed run leaves no stale lock.

    Raises:
        RunDirInUse: the lock is held (by the pid named in the message), before anything is
            written to the directory.
    """

    def __init__(self, output_dir: str | Path):
        import fcntl

        path = Path(output_dir) / RUN_LOCK
        self._file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the run's life
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                # a file system without flock (some Lustre, FUSE or object-store mounts): run as
                # before the lock existed rather than refuse a run that worked there
                log.warning("cannot lock %s (%s): not guarding it against a second run", path, e.strerror or e)
                return
            self._file.seek(0)
            owner = self._file.read().strip() or "unknown"
            self._file.close()
            raise RunDirInUse(
                f"{output_dir} is in use by another splitrl run (pid {owner}); wait for it to end, "
                "or give this run another output_dir"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        """Unlock (closing the file releases the flock); the file stays behind, emptied of the pid
        (a killed run's file keeps its pid, and its lock is free all the same)."""
        if not self._file.closed:
            self._file.seek(0)
            self._file.truncate()
            self._file.close()


EARLIER_RUNS = "earlier_runs"
# what a run writes at the top of output_dir besides checkpoints/ (splitrl.logging.logger)
RUN_RECORD = ("metrics.jsonl", "tensorboard", "metrics.png", "config.yaml")


def set_aside_earlier_run(output_dir: str | Path) -> tuple[Path | None, list[str]]:
    """Move an earlier run's record out of the way of a run started with ``checkpoint.resume: false`` in
    the same ``output_dir``: its splitrl checkpoints (``checkpoints/step_*`` holding splitrl's
    files; another tool's folders stay) and its ``metrics.jsonl``, ``tensorboard/``,
    ``metrics.png`` and ``config.yaml`` go to ``output_dir/earlier_runs/<UTC time>/``.

    Why: kept in place, the earlier checkpoints (steps 5, 6, ...) sort above the fresh run's
    (1, 2, ...), so the fresh run would prune its own as the oldest and the next start would
    resume the earlier run; and the fresh run's logger would overwrite the earlier metrics.
    Moved rather than deleted, so that nothing a run produced is lost by a start-over.

    Returns:
        (the folder they went to, or None when there was nothing; the names moved).
    """
    out = Path(output_dir)
    root = checkpoint_root(out)
    ours = (COMPLETE, CONTROLLER_STATE, RUN_CONFIG)
    ckpts = (
        sorted(p for p in root.glob("step_*") if p.is_dir() and any((p / f).exists() for f in ours))
        if root.is_dir()
        else []
    )
    files = [out / name for name in RUN_RECORD if (out / name).exists()]
    if not ckpts and not files:
        return None, []
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = out / EARLIER_RUNS / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = out / EARLIER_RUNS / f"{stamp}-{n}"
    (dest / root.name).mkdir(parents=True)
    for p in ckpts:
        shutil.move(str(p), str(dest / root.name / p.name))
    for p in files:
        shutil.move(str(p), str(dest / p.name))
    _verified.clear()  # the same paths will hold the fresh run's checkpoints
    return dest, [p.name for p in ckpts] + [p.name for p in files]
