"""Waiting in tests: on a condition, with a generous deadline, never for a fixed time.

A test that sleeps a fixed time and then checks an outcome fails on a busy machine (CI runs on a
developer's machine; a test that passed in 0.5 s on an idle one failed at load 8 on 2 cores).
Wait for the condition instead; the deadline only bounds a test that would otherwise hang, so it
is generous, and its failure says what was waited for."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

# How long a condition that normally holds within a second may take on a loaded 2-core machine.
DEFAULT_TIMEOUT_S = 60.0
_POLL_S = 0.05


def wait_until(predicate: Callable[[], object], *, what: str, timeout_s: float = DEFAULT_TIMEOUT_S,
               poll_s: float = _POLL_S) -> object:
    """Poll ``predicate`` until it returns a truthy value and return that value; fail the test
    with ``what`` (what was waited for) after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


async def async_wait_until(predicate: Callable[[], object], *, what: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                           poll_s: float = _POLL_S) -> object:
    """:func:`wait_until` for a coroutine: polls with ``asyncio.sleep`` so the loop keeps running."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(poll_s)
