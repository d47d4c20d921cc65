"""Data plane (DESIGN.md §4): per-sample tensors keyed by sample id, behind one small interface.

- :class:`DataPlane` — ``put`` / ``get`` / ``delete`` / ``clear`` / ``close`` (see :mod:`.base`).
- :class:`InProcessDataPlane` — a dict in this process (unit tests, single-process runs).
- :class:`TransferQueueDataPlane` — TransferQueue actors on the Ray cluster, shared by the
  generation and train workers (see :mod:`.transferqueue` for how processes attach).

Build one from config with :func:`make_data_plane`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitrl._lazy import lazy_getattr
from splitrl.dataplane.config import DataPlaneConfig, TransferQueueConfig

if TYPE_CHECKING:
    from splitrl.dataplane.base import DataPlane
    from splitrl.dataplane.inprocess import InProcessDataPlane
    from splitrl.dataplane.transferqueue import TransferQueueDataPlane

# the data planes import torch: loaded on first use (see splitrl._lazy)
__getattr__ = lazy_getattr(
    __name__,
    {
        "DataPlane": "splitrl.dataplane.base",
        "InProcessDataPlane": "splitrl.dataplane.inprocess",
        "TransferQueueDataPlane": "splitrl.dataplane.transferqueue",
    },
)


def make_data_plane(config: DataPlaneConfig) -> DataPlane:
    """Build the data plane ``config`` describes (for TransferQueue: start it or attach to it).

    Raises:
        RuntimeError: TransferQueue requested without a Ray cluster with enough free logical CPUs.
    """
    if config.kind == "inprocess":
        from splitrl.dataplane.inprocess import InProcessDataPlane

        return InProcessDataPlane()
    from splitrl.dataplane.transferqueue import TransferQueueDataPlane

    return TransferQueueDataPlane(config.transferqueue)


__all__ = [
    "DataPlane",
    "DataPlaneConfig",
    "InProcessDataPlane",
    "TransferQueueConfig",
    "TransferQueueDataPlane",
    "make_data_plane",
]
