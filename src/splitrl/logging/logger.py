"""Per-step metrics of a run: console progress, TensorBoard, ``metrics.jsonl``, a final plot.

The controller calls :meth:`MetricsLogger.log` once per optimizer step with one flat dict of
scalars whose keys name their source (``train/loss``, ``train/mtp/mtp_1_acceptance_rate``,
``train/reward``, ``timing/train_s``, ...). Everything a run writes lands in one output
directory::

    out_dir/
      metrics.jsonl     one JSON object per step: {"step": k, "<key>": value, ...}
      tensorboard/      TensorBoard event files (one scalar series per key)
      metrics.png       reward and MTP acceptance per step, written by close()
      config.yaml       the resolved run config, written by save_config() (also as TensorBoard
                        text and, with ``logging.wandb``, as the W&B run config)

``metrics.jsonl`` is the record a resumed run continues: on resume at step k every line with
step >= k is dropped (those steps are about to be run again) and the TensorBoard writer purges
the same steps from its view, so neither shows a step twice.

Non-finite values. JSON has no NaN or infinity, so ``metrics.jsonl`` stores them as the strings
``"nan"``, ``"inf"`` and ``"-inf"``; every line stays valid JSON, and the information survives
(``null`` would not tell a diverged loss from an infinite one). :func:`~splitrl.logging.metrics_file.read_metrics` turns them
back into floats. Metric values are numbers only, so a string in a metric field always means one
of these three.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict
from tqdm.auto import tqdm

from splitrl.logging.metrics_file import _encode_non_finite, _parse_line, write_atomically
from splitrl.logging.plot import plot_metrics, plot_records
from splitrl.logging.wandb_logger import WandbConfig, WandbSink

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "metrics.png"
CONFIG_FILE = "config.yaml"

# Progress-bar fields: label -> metric keys tried in order (the first one present is shown).
_POSTFIX_FIELDS: dict[str, tuple[str, ...]] = {
    "reward": ("train/reward",),
    "loss": ("train/loss",),
    "mtp_acc": ("train/mtp/mtp_1_acceptance_rate",),
    "tok/s": ("rollout/tokens_per_s", "train/tokens_per_s"),
}


class LoggingConfig(BaseModel):
    """Which sinks a run writes to.

    Attributes:
        tensorboard: write TensorBoard event files under ``out_dir/tensorboard``.
        jsonl: append one JSON line per step to ``out_dir/metrics.jsonl``.
        progress_bar: show a tqdm bar (on stderr) with step, reward, loss, MTP acceptance of
            the first depth and tokens/s.
        plot: on ``close()``, write ``out_dir/metrics.png`` (reward and MTP acceptance per step).
        wandb: also log to Weights & Biases (``{project, name, mode}``; None: off).
    """

    model_config = ConfigDict(extra="forbid")

    tensorboard: bool = True
    jsonl: bool = True
    progress_bar: bool = True
    plot: bool = True
    wandb: WandbConfig | None = None


class MetricsLogger:
    """Writes each step's metrics to every sink enabled in :class:`LoggingConfig`.

    Steps are the controller's optimizer-step indices; they must increase from one ``log`` call
    to the next. Resuming "at step k" means step k is the next one to run, so everything already
    recorded for steps >= k is dropped from ``metrics.jsonl`` (a fresh run, ``start_step=0``,
    therefore starts from an empty file even when the directory holds an old one).

    Args:
        out_dir: the run's output directory (created if missing).
        total_steps: number of steps of the whole run; the progress bar's total.
        start_step: first step this process will log (0 for a fresh run, k on resume at k).
        config: the sinks to enable; default: all.

    Raises:
        ValueError: ``total_steps`` < 1, ``start_step`` outside ``[0, total_steps]``, or an
            existing ``metrics.jsonl`` with a malformed line (other than a partly written last
            line, which a crash can leave and which is dropped with a warning).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        total_steps: int,
        *,
        start_step: int = 0,
        config: LoggingConfig | None = None,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}; pass the run's number of steps")
        if not 0 <= start_step <= total_steps:
            raise ValueError(
                f"start_step must be in [0, total_steps={total_steps}], got {start_step}; "
                "pass the step the run resumes at (0 for a fresh run)"
            )
        self.config = config or LoggingConfig()
        self.out_dir = Path(out_dir)
        self.total_steps = total_steps
        self.start_step = start_step
        self.metrics_path = self.out_dir / METRICS_FILE
        self.plot_path = self.out_dir / PLOT_FILE
        self.config_path = self.out_dir / CONFIG_FILE

        # Read (and validate) the old record before creating anything, so a bad file changes nothing.
        kept_lines: list[str] = []
        # A fresh run (start_step 0) keeps nothing, so an old file there is not even read.
        if self.config.jsonl and start_step > 0 and self.metrics_path.exists():
            kept_lines = _lines_before_step(self.metrics_path, start_step)

        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._last_step: int | None = None
        # This process's records; the plot falls back on them when there is no jsonl file.
        self._records: list[dict[str, Any]] = []
        self._closed = False

        self._jsonl = None
        if self.config.jsonl:
            _rewrite_atomically(self.metrics_path, kept_lines)
            self._jsonl = open(self.metrics_path, "a", encoding="utf-8")

        self._writer = None
        if self.config.tensorboard:
            # Imported here: torch's writer is slow to import and not needed when disabled.
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events of steps >= start_step left by the interrupted run.
            self._writer = SummaryWriter(str(self.out_dir / TENSORBOARD_DIR), purge_step=start_step)

        self._wandb = None
        if self.config.wandb is not None:
            # a resumed run (steps kept from before) continues the same W&B run
            self._wandb = WandbSink(self.config.wandb, self.out_dir, resume=bool(kept_lines) or start_step > 1)

        self._bar = None
        if self.config.progress_bar:
            # the bar counts logged steps: those kept from an earlier run, then one per log()
            done_before = len(kept_lines) if self.config.jsonl else start_step
            self._bar = tqdm(total=total_steps, initial=done_before, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of one step in every enabled sink.

        Args:
            step: the optimizer step the metrics belong to.
            metrics: metric name -> scalar (Python/NumPy number or a one-element tensor).
                Integers stay integers in ``metrics.jsonl``; bools are stored as 0/1.

        Raises:
            ValueError: ``step`` is below ``start_step`` or not above the last logged step, a
                key is ``"step"``, or a value is not a scalar number. Nothing is written then.
            RuntimeError: the logger is closed.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger.log() called after close(); create a new MetricsLogger")
        if step < self.start_step:
            raise ValueError(
                f"step {step} is before start_step={self.start_step}; on resume, construct the "
                "logger with the step the run resumes at"
            )
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} logged after step {self._last_step}; steps must increase")
        values = {key: _to_number(key, value) for key, value in metrics.items()}

        record = {"step": step, **values}
        self._records.append(record)
        self._last_step = step
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(_encode_non_finite(record)) + "\n")
            # One flush per step: a crash loses at most the step being written.
            self._jsonl.flush()
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, global_step=step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(step, values)
        if self._bar is not None:
            postfix = progress_postfix(step, values)
            self._console(lambda: (self._bar.set_postfix(postfix, refresh=False), self._bar.update(1)))

    def _console(self, call) -> None:
        """Run a progress-bar call; a console nobody reads any more (a closed pipe, a dead
        terminal) turns the bar off instead of stopping the run before its checkpoint."""
        try:
            call()
        except (OSError, ValueError) as err:
            bar, self._bar = self._bar, None
            if bar is not None:
                bar.disable = True  # its close() must not write either
            warnings.warn(f"progress bar turned off: the console cannot be written ({err})", stacklevel=3)

    def save_config(self, config: Mapping[str, Any] | BaseModel) -> Path:
        """Write the resolved run config to ``out_dir/config.yaml`` (keys in their given order).

        Args:
            config: a plain mapping of YAML-representable values, or a pydantic model (dumped
                with ``model_dump(mode="json")``).

        Returns:
            The path written.

        Raises:
            ValueError: the mapping holds a value YAML cannot represent (a path, an enum, ...);
                convert it first, e.g. with ``model_dump(mode="json")``.
        """
        data = config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config)
        try:
            text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
        except yaml.representer.RepresenterError as err:
            raise ValueError(
                f"config holds a value YAML cannot represent ({err}); pass plain types, e.g. "
                "model.model_dump(mode='json') for a pydantic config"
            ) from err
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.config_path, text.encode("utf-8"))
        if self._writer is not None:  # TensorBoard's text tab renders markdown
            self._writer.add_text("config", f"```yaml\n{text}```", global_step=self.start_step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.set_config(data)
        return self.config_path

    def close(self) -> None:
        """Flush and close every sink, then write ``metrics.png`` if ``plot`` is on.

        The plot covers the whole run as recorded in ``metrics.jsonl`` (earlier sessions of a
        resumed run included); without a jsonl file it covers the steps logged by this process.
        Calling ``close`` again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._console(self._bar.close)
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.close()
        if self.config.plot:
            # written to a temporary file and renamed (plot.py): a full disk leaves the previous
            # picture or none, never a truncated one, and costs a warning, not the run's exit
            try:
                if self.config.jsonl:
                    plot_metrics(self.metrics_path, self.plot_path)
                else:
                    plot_records(self._records, self.plot_path)
            except (OSError, ValueError) as err:  # ValueError: a directory at plot_path
                warnings.warn(f"{self.plot_path} not written: {err}", stacklevel=2)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def progress_postfix(step: int, metrics: Mapping[str, float]) -> dict[str, str]:
    """The progress bar's postfix fields for one step: step, then those of reward, loss,
    MTP acceptance (first depth, percent) and tokens/s that are present in ``metrics``."""
    fields = {"step": str(step)}
    for label, keys in _POSTFIX_FIELDS.items():
        # a NaN (no rollout timed this step, no MTP targets) is left out, not shown as "nan"
        key = next((k for k in keys if k in metrics and math.isfinite(float(metrics[k]))), None)
        if key is not None:
            fields[label] = _format_value(label, float(metrics[key]))
    return fields


def _to_number(key: str, value: Any) -> int | float:
    if key == "step":
        raise ValueError("metric key 'step' is reserved for the step index; rename the metric")
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        # One-element tensors and arrays convert; anything else is a caller mistake.
        return float(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"metric {key!r} has value {value!r} of type {type(value).__name__}; metrics must be "
            "scalar numbers (call .item() on tensors)"
        ) from err


def _format_value(label: str, value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if label == "tok/s":
        return f"{value:.0f}"
    if label == "mtp_acc":
        return f"{value:.1f}%"
    return f"{value:.4g}"


def check_metrics_record(out_dir: str | os.PathLike[str], start_step: int) -> None:
    """Check that ``out_dir``'s ``metrics.jsonl`` (if any) is a record a run resuming at
    ``start_step`` can keep: JSON objects with an integer ``step`` (a crash's partial last line is
    allowed).

    Raises:
        ValueError: the file is not a splitrl metrics record; the message says how to proceed.
    """
    path = Path(out_dir) / METRICS_FILE
    if not path.exists():
        return
    try:
        _lines_before_step(path, start_step, quiet=True)
    except ValueError as e:
        raise ValueError(
            f"{e}; {path} is not a splitrl metrics record, which this run would extend: move it out of "
            f"{out_dir} or give this run another output_dir"
        ) from None


def _lines_before_step(path: Path, start_step: int, quiet: bool = False) -> list[str]:
    """The lines of an existing metrics file whose step is < ``start_step``, unchanged (``quiet``:
    no warnings, for a check before the run)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept, dropped = [], []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = _parse_line(path, line_no, line)
        except ValueError:
            if line_no == len(lines):
                # A crash mid-write leaves a partial last line; that step is run again anyway.
                if not quiet:
                    warnings.warn(f"dropping the partly written last line of {path}", stacklevel=3)
                continue
            raise
        if not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{line_no} has no integer 'step' field: {line[:80]!r}")
        if record["step"] < start_step:
            kept.append(line)
        else:
            dropped.append(record["step"])
    if dropped and not quiet:
        # say it: a user who stopped a run after its last checkpoint sees steps vanish from the record
        lo, hi = min(dropped), max(dropped)
        log.warning(
            "%s: dropping the records of %s, logged after the checkpoint this run resumes from; "
            "those steps run again from step %d",
            path, f"step {lo}" if lo == hi else f"steps {lo}-{hi}", start_step,
        )  # fmt: skip
    return kept


def _rewrite_atomically(path: Path, lines: list[str]) -> None:
    # Replace in one rename so an interruption here cannot lose the steps being kept.
    write_atomically(path, "".join(line + "\n" for line in lines).encode("utf-8"))
