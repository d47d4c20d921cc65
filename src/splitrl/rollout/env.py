"""The rollout kernels' switches, read from ``SPLITRL_*`` environment variables at import.

Each switch is read once, when its module is imported (benches flip the module attributes between
engines instead: ``bench/bench_switches.py``). A value outside the accepted ones raises ValueError
at import naming the variable and what to write: a typo would otherwise measure the default under
another name. ``splitrl.cli`` reports that error as one line (exit 2).
"""

from __future__ import annotations

import os

__all__ = ["choice", "flag", "ints"]

_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The value of environment variable ``name`` among ``choices`` (case and surrounding spaces
    ignored; unset or empty: ``default``).

    Raises:
        ValueError: any other value, with the choices.
    """
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(choices)} (or leave it unset)")
    return value


def flag(name: str, default: bool = True) -> bool:
    """An on/off switch: ``1`` / ``on`` / ``true`` / ``yes`` is on, ``0`` / ``off`` / ``false`` /
    ``no`` is off (case and surrounding spaces ignored); unset or empty: ``default``.

    Raises:
        ValueError: any other value (``SPLITRL_SILU_MUL=2``, ``=disable``), naming the variable.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(
        f"{name}={value!r}: write 0 (or off, false, no) to switch it off, 1 (or on, true, yes) to switch it on, "
        "or leave it unset"
    )


def ints(name: str, count: int, what: str) -> tuple[int, ...]:
    """``count`` comma-separated positive integers from ``name``; unset or empty: ``()``.

    Raises:
        ValueError: another number of values, or a value that is not a positive integer, with ``what``
        (the names of the values).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return ()
    parts = [p.strip() for p in raw.split(",")]
    if len(parts) != count or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{name}={raw!r}: write {count} positive integers, {what} (or leave it unset)")
    return tuple(int(p) for p in parts)
