"""Data plane (DESIGN.md §4): per-sample tensors keyed by sample id, behind one small interface.

- :class:`DataPlane` — ``put`` / ``get`` / ``delete`` / ``clear`` / ``close`` (see :mod:`.base`).
- :class:`InProcessDataPlane` — a dict in this process (unit tests, single-process runs).
- :class:`TransferQueueDataPlane` — TransferQueue actors on the Ray cluster, shared by the
  generation and train workers (see :mod:`.transferqueue` for how processes attach).

Build one from config with :func:`make_data_plane`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from splitrl.dataplane.base import DataPlane
from splitrl.dataplane.inprocess import InProcessDataPlane
from splitrl.dataplane.transferqueue import TransferQueueConfig, TransferQueueDataPlane


class DataPlaneConfig(BaseModel):
    """Which data plane to use.

    Attributes:
        kind: ``"transferqueue"`` (shared across Ray actors; needs ``ray.init`` first) or
            ``"inprocess"`` (one process only).
        transferqueue: TransferQueue settings, used when ``kind == "transferqueue"``.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["inprocess", "transferqueue"] = "transferqueue"
    transferqueue: TransferQueueConfig = Field(default_factory=TransferQueueConfig)


def make_data_plane(config: DataPlaneConfig) -> DataPlane:
    """Build the data plane ``config`` describes (for TransferQueue: start it or attach to it).

    Raises:
        RuntimeError: TransferQueue requested without a Ray cluster with enough free logical CPUs.
    """
    if config.kind == "inprocess":
        return InProcessDataPlane()
    return TransferQueueDataPlane(config.transferqueue)


__all__ = [
    "DataPlane",
    "DataPlaneConfig",
    "InProcessDataPlane",
    "TransferQueueConfig",
    "TransferQueueDataPlane",
    "make_data_plane",
]
