"""Configuration of the data plane; no torch import, so a run config validates before torch loads."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TransferQueueConfig(BaseModel):
    """Settings of the TransferQueue data plane.

    Attributes:
        partition_id: TransferQueue partition holding this data plane's samples; ``clear`` empties
            only this partition.
        num_storage_units: SimpleStorage actors to start (each takes 1 logical Ray CPU); samples
            are spread over them by hash. Only used by the process that starts TransferQueue.
        storage_capacity: most samples held across all storage units (each unit holds at most
            ``ceil(capacity / num_storage_units)``); ``None`` = unlimited. A ``put`` beyond it
            raises ``RuntimeError``. Only used by the process that starts TransferQueue.
    """

    model_config = ConfigDict(extra="forbid")

    partition_id: str = Field(default="rollouts", min_length=1)
    num_storage_units: int = Field(default=2, ge=1)
    storage_capacity: int | None = Field(default=None, ge=1)

    @property
    def num_actor_cpus(self) -> int:
        """Logical Ray CPUs TransferQueue's actors take (controller + storage units)."""
        return 1 + self.num_storage_units


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
