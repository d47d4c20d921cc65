"""The split train step: batch types, the shared microbatch builder, the train worker."""

from splitrl.train.batch import MicroBatch, TrainBatch
from splitrl.train.microbatch import MicrobatchConfig, build_microbatches
from splitrl.train.optim import OptimConfig
from splitrl.train.speed import SpeedConfig
from splitrl.train.worker import TrainConfig, TrainWorker

__all__ = ["MicroBatch", "MicrobatchConfig", "OptimConfig", "SpeedConfig", "TrainBatch", "TrainConfig", "TrainWorker", "build_microbatches"]
