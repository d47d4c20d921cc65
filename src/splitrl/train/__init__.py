"""The split train step: batch types, the shared microbatch builder, the train worker."""

from typing import TYPE_CHECKING

from splitrl._lazy import lazy_getattr
from splitrl.train.config import MemoryConfig, MicrobatchConfig, OptimConfig, SpeedConfig, TrainConfig

if TYPE_CHECKING:
    from splitrl.train.batch import MicroBatch, TrainBatch
    from splitrl.train.microbatch import build_microbatches
    from splitrl.train.worker import TrainWorker

# these import torch: loaded on first use (see splitrl._lazy)
__getattr__ = lazy_getattr(
    __name__,
    {
        "MicroBatch": "splitrl.train.batch",
        "TrainBatch": "splitrl.train.batch",
        "build_microbatches": "splitrl.train.microbatch",
        "TrainWorker": "splitrl.train.worker",
    },
)

__all__ = [
    "MemoryConfig",
    "MicroBatch",
    "MicrobatchConfig",
    "OptimConfig",
    "SpeedConfig",
    "TrainBatch",
    "TrainConfig",
    "TrainWorker",
    "build_microbatches",
]
