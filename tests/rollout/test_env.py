"""The kernels' SPLITRL_* switches (splitrl.rollout.env): what each value means, and that a value
that means nothing is refused at import with the variable's name, not read as "on"."""

from __future__ import annotations

import pytest
from _rollout_helpers import run_python

from splitrl.rollout import env


@pytest.mark.parametrize(
    "value, expected",
    [("0", False), ("1", True), (" Off ", False), ("TRUE", True), ("no", False), ("yes", True), ("", True)],
)
def test_flag_values(monkeypatch, value, expected):
    monkeypatch.setenv("SPLITRL_X", value)
    assert env.flag("SPLITRL_X") is expected


def test_flag_unset_is_the_default(monkeypatch):
    monkeypatch.delenv("SPLITRL_X", raising=False)
    assert env.flag("SPLITRL_X") is True and env.flag("SPLITRL_X", default=False) is False


@pytest.mark.parametrize("value", ["2", "disable", "of", "-1"])
def test_flag_refuses_other_values(monkeypatch, value):
    """Kind: bad input taken silently. Before, every value but "0" switched the kernel on:
    SPLITRL_SILU_MUL=false measured the kernel under the name of its baseline."""
    monkeypatch.setenv("SPLITRL_X", value)
    with pytest.raises(ValueError, match=r"SPLITRL_X='.*': write 0 \(or off, false, no\) to switch it off, 1 \(or on, true, yes\) to switch it on"):
        env.flag("SPLITRL_X")


def test_choice(monkeypatch):
    monkeypatch.setenv("SPLITRL_X", " Flash ")
    assert env.choice("SPLITRL_X", ("triton", "flash"), "triton") == "flash"
    monkeypatch.setenv("SPLITRL_X", "")
    assert env.choice("SPLITRL_X", ("triton", "flash"), "triton") == "triton"
    monkeypatch.setenv("SPLITRL_X", "cuda")
    with pytest.raises(ValueError, match="SPLITRL_X='cuda': use one of triton, flash"):
        env.choice("SPLITRL_X", ("triton", "flash"), "triton")


def test_ints(monkeypatch):
    monkeypatch.setenv("SPLITRL_X", " 64, 32,4 ,5")
    assert env.ints("SPLITRL_X", 4, "BLOCK_N,BLOCK_K,num_warps,num_stages") == (64, 32, 4, 5)
    monkeypatch.delenv("SPLITRL_X")
    assert env.ints("SPLITRL_X", 4, "a") == ()
    for bad in ["64,32,4", "64,32,4,x", "64,0,4,5", "64,-32,4,5", "64,,4,5"]:
        monkeypatch.setenv("SPLITRL_X", bad)
        with pytest.raises(ValueError, match=r"write 4 positive integers, BLOCK_N,BLOCK_K,num_warps,num_stages"):
            env.ints("SPLITRL_X", 4, "BLOCK_N,BLOCK_K,num_warps,num_stages")


# every on/off switch of the rollout code, with the module attribute it sets
_SWITCHES = {
    "SPLITRL_FLASH_DECODE": ("kv", "FLASH_DECODE"),
    "SPLITRL_COMPILE_KERNELS": ("engine", "COMPILE_KERNELS"),
    "SPLITRL_LOOK_AHEAD": ("engine", "LOOK_AHEAD"),
    "SPLITRL_PDL": ("pdl", "ENABLED"),
    "SPLITRL_PDL_EARLY": ("pdl", "EARLY"),
    "SPLITRL_SKINNY_GEMM": ("forward", "SKINNY_GEMM"),
    "SPLITRL_SKINNY_EPILOGUE": ("forward", "SKINNY_EPILOGUE"),
    "SPLITRL_SKINNY_GATED": ("forward", "SKINNY_GATED"),
    "SPLITRL_ROPE_WRITE": ("forward", "ROPE_WRITE"),
    "SPLITRL_FAST_PREFILL": ("forward", "FAST_PREFILL"),
    "SPLITRL_SILU_MUL": ("forward", "SILU_MUL"),
}


def test_every_switch_reads_off_and_refuses_a_typo():
    """In one subprocess (switches are read at import): "false" turns each switch off; and a value
    that means nothing stops the import with the variable's name."""
    names = " ".join(f"{m}.{a}" for m, a in _SWITCHES.values())
    code = (
        "from splitrl.rollout import engine, forward, kv, pdl\n"
        f"print(*(bool(eval(n)) for n in {names.split()!r}))"
    )
    off = run_python(code, **dict.fromkeys(_SWITCHES, "false"))
    assert off.returncode == 0, off.stderr[-2000:]
    assert off.stdout.split() == ["False"] * len(_SWITCHES)
    res = run_python(code, SPLITRL_SILU_MUL="2")
    assert res.returncode != 0 and "SPLITRL_SILU_MUL='2': write 0 (or off, false, no) to switch it off, 1" in res.stderr, res.stderr[-500:]
    # read even where what it refines is off (or its kernel cannot run here): a typo is still one
    res = run_python(code, SPLITRL_SKINNY_GEMM="0", SPLITRL_SKINNY_EPILOGUE="of")
    assert res.returncode != 0 and "SPLITRL_SKINNY_EPILOGUE='of'" in res.stderr, res.stderr[-500:]


def test_the_rollout_code_reads_its_switches_through_env():
    """Every SPLITRL_* variable of the rollout package is read by splitrl.rollout.env (which checks
    its value), and every on/off one is listed above, so that the test before covers it."""
    import pathlib
    import re

    root = pathlib.Path(env.__file__).parent
    flags = set()
    for path in root.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"environ(\.get)?[\[(]\s*['\"]SPLITRL_", text), f"{path.name} reads a SPLITRL_ variable itself"
        flags |= set(re.findall(r"env\.flag\(\s*['\"](SPLITRL_\w+)", text))
    assert flags == set(_SWITCHES)


def test_gated_tiles_typo_is_refused():
    """Three numbers, and four that no kernel can take (tl.arange needs powers of two, Triton
    powers-of-two warps), stop the import; tiles that can run are taken."""
    code = "from splitrl.rollout import skinny_gemm; print(skinny_gemm._GATED_TILES)"
    res = run_python(code, SPLITRL_GATED_TILES="64,32,4")
    assert res.returncode != 0
    assert "SPLITRL_GATED_TILES='64,32,4': write 4 positive integers, BLOCK_N,BLOCK_K,num_warps,num_stages" in res.stderr
    for bad in ("3,5,7,9", "64,32,6,4"):
        res = run_python(code, SPLITRL_GATED_TILES=bad)
        assert res.returncode != 0 and "SPLITRL_GATED_TILES: config is (BLOCK_N, BLOCK_K, num_warps[, num_stages])" in res.stderr
        assert "num_warps a power of two" in res.stderr
    res = run_python(code, SPLITRL_GATED_TILES="64,32,4,5")
    assert res.returncode == 0 and res.stdout.split() == ["(64,", "32,", "4,", "5)"], res.stderr[-500:]
