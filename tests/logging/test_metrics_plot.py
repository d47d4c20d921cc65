"""plot_metrics / the PNG written by MetricsLogger.close()."""

import json
import struct

import pytest

from splitrl.logging import LoggingConfig, MetricsLogger, plot_metrics, plot_records

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels, read from the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_with_mtp_has_reward_and_acceptance_panels(tmp_path):
    records = [
        {
            "step": s,
            "train/reward": s / 10,
            "train/mtp/mtp_1_acceptance_rate": 50.0 + s,
            "train/mtp/mtp_2_acceptance_rate": "nan" if s == 3 else 30.0 + s,
        }
        for s in range(10)
    ]
    write_jsonl(tmp_path / "metrics.jsonl", records)
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "metrics.png")
    assert out == tmp_path / "plots" / "metrics.png"
    # 8 x 3 inches per panel at 100 dpi: two panels.
    assert png_size(out) == (800, 600)


def test_plot_without_mtp_has_reward_only(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": s, "train/reward": 0.1 * s, "train/loss": 1.0} for s in range(4)])
    assert png_size(plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "metrics.png")) == (800, 300)


def test_plot_with_nothing_to_show_still_writes_a_png(tmp_path):
    assert png_size(plot_records([], tmp_path / "empty.png")) == (800, 300)


def test_plot_of_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        plot_metrics(tmp_path / "absent.jsonl", tmp_path / "x.png")


def test_a_directory_as_the_png_path_is_refused_before_anything_is_written(tmp_path):
    """Kind: an unclear error. A directory as the output was an IsADirectoryError naming the
    internal temporary file (a new user's trial); now a ValueError that names a file path to give."""
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 0, "train/reward": 0.5}])
    out = tmp_path / "plots"
    out.mkdir()
    before = sorted(tmp_path.rglob("*"))
    for plot in (lambda: plot_metrics(tmp_path / "metrics.jsonl", out), lambda: plot_records([], out)):
        with pytest.raises(ValueError, match=r"is a directory: the output must be a file path, such as .*metrics\.png"):
            plot()
    assert sorted(tmp_path.rglob("*")) == before  # no temporary file left beside it


def test_close_warns_when_the_plot_path_is_a_directory(tmp_path):
    config = LoggingConfig(tensorboard=False, progress_bar=False)
    (tmp_path / "metrics.png").mkdir()
    logger = MetricsLogger(tmp_path, total_steps=1, config=config)
    logger.log(0, {"train/reward": 0.5})
    with pytest.warns(UserWarning, match="not written: .*is a directory"):
        logger.close()


@pytest.mark.parametrize("jsonl", [True, False])
def test_close_writes_the_plot(tmp_path, jsonl):
    config = LoggingConfig(tensorboard=False, progress_bar=False, jsonl=jsonl)
    with MetricsLogger(tmp_path, total_steps=3, config=config) as logger:
        for step in range(3):
            logger.log(step, {"train/reward": 0.5, "train/mtp/mtp_1_acceptance_rate": 70.0})
    assert png_size(tmp_path / "metrics.png") == (800, 600)
