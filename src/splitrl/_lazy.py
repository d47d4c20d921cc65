"""Lazy package exports (PEP 562), so that ``import splitrl.config`` does not load torch.

A run config is validated before anything heavy is imported (``splitrl train bad.key=1`` fails in
a fraction of a second instead of after torch and transformers load). Packages therefore import
their pydantic configs eagerly and their torch-backed classes on first attribute access.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module path) on first access.

    Raises:
        AttributeError: ``name`` is not an export of ``package``.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__


_DEFER_IMPORT_CHECKS: ContextVar[bool] = ContextVar("splitrl_defer_import_checks", default=False)


@contextmanager
def deferred_import_checks() -> Iterator[None]:
    """Within this block, config validators skip the checks that must import a library (the
    reasoning-gym generator names, CUDA being visible): a first validation pass over keys, types
    and combinations then runs without torch, transformers or reasoning-gym, so a typo is
    reported at once. Validate again outside the block for the full checks."""
    token = _DEFER_IMPORT_CHECKS.set(True)
    try:
        yield
    finally:
        _DEFER_IMPORT_CHECKS.reset(token)


def import_checks_deferred() -> bool:
    """True inside :func:`deferred_import_checks` (validators then skip their importing checks)."""
    return _DEFER_IMPORT_CHECKS.get()
