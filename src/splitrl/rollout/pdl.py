"""Programmatic dependent launch (PDL) of the decode step's Triton kernels, on sm90+ GPUs.

A decode step at small batch is a chain of small dependent kernels (:mod:`splitrl.rollout.forward`),
and between two of them the GPU drains one grid and ramps up the next. With PDL (CUDA's
programmatic stream serialization, kept as programmatic edges when a CUDA graph is captured) a
kernel may be launched while its predecessor still runs: it starts, does the work that needs no
result of that predecessor (index arithmetic, constants), then waits (``griddepcontrol.wait``: the
predecessor has completed and its writes are visible) before it reads or writes anything the
predecessor may touch. Each kernel signals (``griddepcontrol.launch_dependents``) after its main
loop, before its final stores (or as it starts: "Early" below), so that its successor's start
overlaps this kernel's tail.

The rule every kernel launched this way follows: no global read of a tensor an earlier kernel of
the step writes, and no global write at all, before its wait. Only our Triton kernels take part;
a cuBLAS or compiled kernel before one of them never signals, so the dependent kernel starts when
it completes (as without PDL).

Where: launches of at most :data:`MAX_ROWS` rows (tokens), where a kernel is a few microseconds
and its launch and ramp are a large part of it. Measured on an H200 (Qwen3-0.6B shape, prompt
128 + 128, bench/RESULTS.md): plain decoding 991 / 24,350 tokens/s at batch 1 / 32 with PDL against
940–951 / 23,531–23,629 without it, one session; at batch 256, where a layer's kernels run several
waves, 66,428 against 68,504, so larger launches keep the plain launch.

Early. The signal decides only when the successor may be scheduled: its wait still waits for this
grid's completion, and the signal takes effect once every program of this grid has signalled or
exited, so a successor never takes multiprocessors from a wave of this grid still to run. With
:data:`EARLY`, launches of at most :data:`EARLY_ROWS` rows signal as soon as they start, so that
the successor's launch and ramp overlap the whole of this kernel rather than its tail. It measured
faster at 1 and 8 rows and slower at 32 (bench/RESULTS.md, 2026-12-06), where the kernels are long
enough that the early grids' waiting programs cost more than the ramp they hide; hence the row
limit. Asking for the successor's weights in L2 before its wait (``cp.async.bulk.prefetch.L2``)
was tried on top and was slower at every size measured (the prefetches compete with the running
kernel for the same bandwidth), so it is not done.

Switch: ``SPLITRL_PDL=0`` turns it off (:data:`ENABLED`). Off, or under Triton's interpreter, or
before sm90, the kernels are launched as before and the waits are not compiled in (a constexpr).
"""

from __future__ import annotations

import os

import torch

from splitrl.rollout import cuda_props, env

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    SUPPORTED = True
except ImportError:  # no Triton, or a Triton without grid dependency control
    SUPPORTED = False
    gdc_launch_dependents = gdc_wait = None

try:
    import triton
    import triton.language as tl

    @triton.jit
    def wait(USE_PDL: tl.constexpr, EARLY: tl.constexpr):
        """A kernel's wait for its predecessor, before it reads or writes anything an earlier kernel
        touches (module docstring), in launches that take PDL (``USE_PDL``); with ``EARLY`` it
        signals its dependents first ("Early"). Compiles to nothing without ``USE_PDL``."""
        if USE_PDL:
            if EARLY:
                gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def signal(USE_PDL: tl.constexpr, EARLY: tl.constexpr):
        """A kernel's signal to its dependents after its main loop, unless it signalled at
        :func:`wait` (``EARLY``); nothing without ``USE_PDL``."""
        if USE_PDL:
            if not EARLY:
                gdc_launch_dependents()

except ImportError:  # CPU installs: no kernels
    wait = signal = None

ENABLED = env.flag("SPLITRL_PDL") and SUPPORTED
# The early signal (module docstring, "Early") for launches of at most EARLY_ROWS rows;
# SPLITRL_PDL_EARLY=0: the signal after the main loop at every size. Set from the environment at
# import; the launches read the module attribute (a bench flips it between engines).
EARLY = env.flag("SPLITRL_PDL_EARLY")
EARLY_ROWS = 8
MAX_ROWS = 64  # rows (tokens) of a launch up to which it takes PDL (module docstring)


def active(t: torch.Tensor, rows: int) -> bool:
    """Whether a kernel of ``rows`` rows (tokens) whose operands live where ``t`` does is launched
    with PDL: enabled, at most :data:`MAX_ROWS` rows, a CUDA tensor on an sm90+ device, not
    under Triton's interpreter."""
    if not ENABLED or rows > MAX_ROWS or not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return cuda_props.sm_major(t.device) >= 9


def early(on: bool, rows: int) -> bool:
    """Whether a launch of ``rows`` rows that takes PDL (``on``) signals its dependents as it
    starts (module docstring, "Early")."""
    return on and EARLY and rows <= EARLY_ROWS


def options(on: bool) -> dict:
    """The launch options of a kernel launched with PDL (``on``), else none."""
    return {"launch_pdl": True} if on else {}
