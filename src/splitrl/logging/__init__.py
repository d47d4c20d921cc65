"""Run logging: console progress, TensorBoard, ``metrics.jsonl``, the final plot and the saved config."""

from splitrl.logging.logger import LoggingConfig, MetricsLogger, progress_postfix
from splitrl.logging.metrics_file import read_metrics
from splitrl.logging.plot import plot_metrics, plot_records

__all__ = [
    "LoggingConfig",
    "MetricsLogger",
    "plot_metrics",
    "plot_records",
    "progress_postfix",
    "read_metrics",
]
