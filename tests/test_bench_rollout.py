"""bench/bench_rollout.py refuses bad flags up front (usage error, exit 2) instead of a traceback
after minutes of setup (found by a new user: --init-range -1, --hbm-tb-s 0, --profile <dir>)."""


import pytest
from _bench import load_bench


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--init-range", "-1"], "--init-range must be a positive number, got -1.0"),
        (["--hbm-tb-s", "0"], "--hbm-tb-s must be a positive number, got 0.0"),
        (["--profile", "{tmp}"], "is a directory; give a file path"),
        (["--attention"], "--attention times the CUDA kernels: add --device cuda"),
        # a new user's --prompt-len 100000000 ran out of memory after the model was built
        (["--prompt-len", "100000000"], "the KV cache of 32 rows x 100000064 tokens (--batch-sizes"),
        (["--ragged", "4", "--ragged-batch", "100000000"], "the KV cache of 100000000 rows x 576 tokens (--ragged-batch"),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as err:
        load_bench("bench_rollout").parse_args(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_good_flags_parse(tmp_path):
    args = load_bench("bench_rollout").parse_args(["--init-range", "0.5", "--hbm-tb-s", "3.35", "--profile", str(tmp_path / "p.txt")])
    assert args.init_range == 0.5 and args.hbm_tb_s == 3.35


def test_roofline_only_where_a_bandwidth_applies():
    """A CPU run prints no roofline (4.3 TB/s, the cuda default, is the H200's) unless given one."""
    parse = load_bench("bench_rollout").parse_args
    assert parse(["--device", "cpu"]).hbm_tb_s is None
    assert parse(["--device", "cpu", "--hbm-tb-s", "0.2"]).hbm_tb_s == 0.2
