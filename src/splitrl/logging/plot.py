"""The end-of-run picture: reward and MTP acceptance rate per step, as a PNG.

Panels (top to bottom, each only when its keys were logged):
- reward: ``train/reward`` (the step's mean reward), plus the held-out evaluation's
  ``eval/reward_mean``, ``eval/pass@k`` and ``eval/greedy/...`` as points at the steps evaluated;
- acceptance (percent, 0-100): one line per MTP depth k from ``train/mtp/mtp_{k}_acceptance_rate``
  (teacher-forced, training side), plus dashed lines for any ``rollout/...acceptance_rate`` key
  (speculative decoding during rollouts) and points for ``eval/acceptance_rate``.

A run without MTP heads gets the reward panel only. Steps where a key is missing or non-finite
show as gaps. The figure is drawn on matplotlib's Agg canvas directly, so plotting neither needs a
display nor touches pyplot's global backend.
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitrl.logging.metrics_file import read_metrics, write_atomically

REWARD_KEYS = ("train/reward",)
_MTP_ACCEPTANCE = re.compile(r"^train/mtp/mtp_(\d+)_acceptance_rate$")
_ROLLOUT_ACCEPTANCE = re.compile(r"^rollout/.*acceptance_rate$")
_EVAL_REWARD = re.compile(r"^eval/(greedy/)?(reward_mean|pass@\d+)$")
_EVAL_ACCEPTANCE = re.compile(r"^eval/(greedy/)?acceptance_rate$")


def plot_metrics(jsonl_path: str | os.PathLike[str], png_path: str | os.PathLike[str]) -> Path:
    """Plot reward and MTP acceptance per step from a ``metrics.jsonl`` file into a PNG.

    Args:
        jsonl_path: metrics file written by :class:`~splitrl.logging.MetricsLogger`.
        png_path: where to write the PNG (parent directories are created).

    Returns:
        ``png_path`` as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: ``jsonl_path`` does not exist.
        ValueError: a line of the file is not a JSON object, or ``png_path`` is a directory (it
            names the file to write, e.g. ``runs/demo/metrics.png``).
        OSError: the PNG could not be written; ``png_path`` is then unchanged (written through a
            temporary file and a rename).
    """
    _check_png_path(png_path)  # before the metrics are read: a mistake in the call costs nothing
    return plot_records(read_metrics(jsonl_path), png_path)


def _check_png_path(png_path: str | os.PathLike[str]) -> None:
    """A directory as the output used to fail at the rename, naming the temporary file (a new user's trial)."""
    if Path(png_path).is_dir():
        raise ValueError(
            f"png_path {os.fspath(png_path)!r} is a directory: the output must be a file path, such as "
            f"{os.fspath(Path(png_path) / 'metrics.png')!r}"
        )


def plot_records(records: Sequence[dict[str, Any]], png_path: str | os.PathLike[str]) -> Path:
    """Like :func:`plot_metrics`, from records already in memory (``{"step": k, key: value}``).

    With no reward and no acceptance key in any record, the PNG holds a single empty panel that
    says so, so a run always leaves a picture behind. A directory as ``png_path`` is a ValueError,
    raised before anything is drawn or written.
    """
    _check_png_path(png_path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = plot_series(records)
    fig = Figure(figsize=(8, 3 * max(len(panels), 1)), layout="constrained")
    FigureCanvasAgg(fig)
    if not panels:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no reward or MTP acceptance metrics logged", ha="center", va="center")
        ax.set_axis_off()
    else:
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (ylabel, lines) in zip(axes, panels):
            for label, xs, ys, style in lines:
                # Markers keep short runs visible (a line through one point draws nothing);
                # evaluation points carry their own ("o")
                extra = {} if style.startswith("o") else {"marker": "." if len(xs) < 50 else None}
                ax.plot(xs, ys, style, label=label, **extra)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(loc="best", fontsize="small")
        axes[-1].set_xlabel("step")

    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    # one rename: a full disk leaves the old picture (or none), never a truncated PNG
    write_atomically(png_path, buf.getvalue())
    return png_path


def plot_series(records: Sequence[dict[str, Any]]) -> list[tuple[str, list[tuple[str, list, list, str]]]]:
    """What :func:`plot_records` draws: panels ``(ylabel, [(label, steps, values, style)])``.

    Missing or non-finite values are NaN (gaps); evaluation keys (logged every few steps) keep
    only the steps that have them, drawn as points.
    """
    keys = {key for record in records for key in record}
    # the first reward key present (one today; a tuple so that a renamed key can be read back)
    reward_keys = [key for key in REWARD_KEYS if key in keys][:1]
    mtp_keys = sorted(
        (key for key in keys if _MTP_ACCEPTANCE.match(key)),
        key=lambda k: int(_MTP_ACCEPTANCE.match(k).group(1)),  # depth 10 after depth 2
    )
    rollout_keys = sorted(key for key in keys if _ROLLOUT_ACCEPTANCE.match(key))
    eval_reward_keys = sorted(key for key in keys if _EVAL_REWARD.match(key))
    eval_acceptance_keys = sorted(key for key in keys if _EVAL_ACCEPTANCE.match(key))
    steps = [record["step"] for record in records]

    # (key, label, style); "o" lines are sparse (evaluations): only the steps that have them
    panels = []
    if reward_keys or eval_reward_keys:
        lines = [(key, key, "-") for key in reward_keys] + [(key, key, "o--") for key in eval_reward_keys]
        panels.append(("reward", lines))
    if mtp_keys or rollout_keys or eval_acceptance_keys:
        lines = [(key, f"MTP depth {_MTP_ACCEPTANCE.match(key).group(1)}", "-") for key in mtp_keys]
        lines += [(key, key, "--") for key in rollout_keys]
        lines += [(key, key, "o--") for key in eval_acceptance_keys]
        panels.append(("acceptance rate (%)", lines))

    out = []
    for ylabel, lines in panels:
        series = []
        for key, label, style in lines:
            if style.startswith("o"):
                points = [(r["step"], _as_float(r[key])) for r in records if key in r]
                series.append((label, [p[0] for p in points], [p[1] for p in points], style))
            else:
                series.append((label, steps, [_as_float(r.get(key)) for r in records], style))
        out.append((ylabel, series))
    return out


def _as_float(value: Any) -> float:
    # Missing (None) or unreadable values become NaN so matplotlib leaves a gap.
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
