"""The silu(gate) · up kernel (splitrl.rollout.silu_mul) against the torch function it replaces
(fused.silu_mul on the product's two halves): Triton's interpreter in fp32 on the CPU, CUDA in
bf16; its input checks everywhere."""

import os

import pytest
import torch
from _rollout_helpers import run_interpreted, run_python

from splitrl.rollout import fused, silu_mul

needs_cuda_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and silu_mul.AVAILABLE), reason="needs CUDA and Triton"
)

_INTERPRETED = """
import torch
from splitrl.rollout import fused, silu_mul
worst, untouched = 0.0, 1
for shape, stride_pad in (((1, 6), 0), ((5, 2 * 1030), 0), ((2, 3, 2 * 7), 0), ((9, 2 * 1024), 6), ((0, 8), 0)):
    torch.manual_seed(sum(shape))
    rows, two_f = (shape[0] * shape[1], shape[-1]) if len(shape) == 3 else shape
    big = torch.randn(max(rows, 1), two_f + stride_pad) * 3
    x = big[:rows, :two_f].view(*shape)  # rows stride_pad apart: a view of a wider tensor
    before = big.clone()
    y = silu_mul.silu_mul(x)
    ref = fused.silu_mul(*x.chunk(2, dim=-1))
    assert y.shape == ref.shape and y.is_contiguous(), (y.shape, ref.shape)
    if y.numel():
        worst = max(worst, float(((y - ref).abs() / (1 + ref.abs())).max()))
    untouched &= int(torch.equal(big, before))  # the input and the columns past it
print(worst, untouched)
"""


@pytest.mark.skipif(not silu_mul.AVAILABLE, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_the_kernel_under_the_interpreter_is_the_torch_function():
    """fp32 on the CPU: one row of one feature pair, F past a tile (masked features), rows past a
    tile, 3-D input, rows a wider stride apart (a view), no rows: fused.silu_mul's values within
    fp32 rounding, the input unchanged."""
    here = os.path.dirname(os.path.abspath(__file__))
    worst, untouched = map(float, run_interpreted(_INTERPRETED, SPLITRL_TEST_DIR=here)[-2:])
    assert worst < 1e-6, worst
    assert untouched == 1


@pytest.mark.skipif(not silu_mul.AVAILABLE, reason="needs Triton: without it silu_mul raises RuntimeError")
@pytest.mark.parametrize(
    "x, match",
    [
        (torch.zeros(3, 5), "floating \\[..., 2F\\]"),
        (torch.zeros(3, 0), "F >= 1"),
        (torch.zeros(3, 4, dtype=torch.int32), "floating"),
        (torch.zeros(3, 4, dtype=torch.float64), "fp16, bf16 or fp32"),
        (torch.zeros(4, 3).t(), "last dim must be contiguous|flatten without a copy"),
        (torch.zeros(2, 3, 8).transpose(0, 1), "flatten without a copy"),
    ],
)
def test_bad_inputs_are_refused_with_what_to_pass(x, match):
    with pytest.raises(ValueError, match=match):
        silu_mul.silu_mul(x)


@pytest.mark.skipif(not silu_mul.AVAILABLE, reason="needs Triton: without it silu_mul raises RuntimeError")
def test_a_cpu_tensor_outside_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA tensor .*fused.silu_mul"):
        silu_mul.silu_mul(torch.zeros(2, 8))


def test_applies_only_to_16_bit_cuda_tensors():
    """The CPU and fp32 keep the torch function (they are what the exactness tests compare bit for bit)."""
    assert not silu_mul.applies(torch.zeros(2, 8))
    assert not silu_mul.applies(torch.zeros(2, 8, dtype=torch.bfloat16))
    if torch.cuda.is_available() and silu_mul.AVAILABLE:
        x = torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda")
        assert silu_mul.applies(x)
        assert not silu_mul.applies(x.float())
        assert not silu_mul.applies(torch.zeros(8, 2, dtype=torch.bfloat16, device="cuda").t())


def test_the_forward_switch_reads_its_environment_variable():
    """SPLITRL_SILU_MUL=0 turns the kernel off in the decode forward (the compiled function then)."""
    code = "from splitrl.rollout import forward, silu_mul; print(int(forward.SILU_MUL), int(silu_mul.AVAILABLE))"
    off, on = (run_python(code, SPLITRL_SILU_MUL=v).stdout.split() for v in ("0", "1"))
    assert off[0] == "0"
    assert on[0] == on[1]  # on wherever Triton is


@needs_cuda_triton
@pytest.mark.parametrize("rows", [1, 32, 256, 4099])
def test_bf16_on_cuda_matches_the_compiled_function(rows):
    """bf16, F = 3072 (Qwen3-0.6B): against the compiled function the decode forward used before
    (both compute in fp32 and round once; their exp may differ in the last fp32 bit, so at most one
    bf16 ulp apart) and against an fp64 reference (within bf16 rounding)."""
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * 3072, device="cuda") * 3).to(torch.bfloat16)
    y = silu_mul.silu_mul(x)
    compiled = fused.Kernels(True, torch.device("cuda"), torch.bfloat16).silu_mul(*x.chunk(2, dim=-1))
    g, u = x.double().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(g) * u
    assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-30).all()
    ulp = (compiled.float().abs() * 2**-7).clamp_min(2**-133)
    assert ((y.float() - compiled.float()).abs() <= ulp).all()
    assert (y == compiled).float().mean() > 0.99
