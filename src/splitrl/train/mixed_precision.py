"""bf16/fp16 compute weights made once per optimizer step, fp32 master weights and gradients.

On a single process (no FSDP2, which casts the gathered shards itself), autocast alone re-casts
every fp32 weight on every microbatch and, worse, keeps the residual stream in fp32: a Hugging
Face RMSNorm multiplies its fp32 weight with a bf16 activation, so every layer's elementwise work
and every matmul input pays an fp32 round trip (a large share of a step's kernel time in casts and
copies: bench/RESULTS.md). :class:`ComputeWeights` instead keeps one low-precision copy of
every parameter, refreshed from the fp32 masters once per step (:meth:`refresh`), and swaps it in
for the duration of a microbatch's forward and backward (:meth:`active`):

- forward and backward run on the low-precision copies (activations stay bf16/fp16);
- each parameter's gradient is added into an fp32 accumulator as soon as autograd has finished
  it (a post-accumulate-grad hook), so gradients still accumulate in fp32 across microbatches;
- on leaving, every parameter holds its fp32 master again and ``.grad`` is the fp32 accumulator,
  so the optimizer, clipping, norms, checkpoints and weight sync see only fp32 tensors.

Within one microbatch a parameter used twice (tied embedding and output head) sums its two
gradient contributions in the compute dtype before the fp32 accumulation, as bf16 training does.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class ComputeWeights:
    """Low-precision compute copies of a module's floating-point parameters.

    Args:
        module: the model (fp32 parameters).
        dtype: compute dtype (``torch.bfloat16`` or ``torch.float16``).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params = [p for p in module.parameters() if p.is_floating_point()]
        self.low = [self._compute_copy(p) for p in self.params]
        self.master: list[torch.Tensor | None] = [None] * len(self.params)
        self.acc: list[torch.Tensor | None] = [None] * len(self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._active = False
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulate)

    def _compute_copy(self, p: torch.Tensor) -> torch.Tensor:
        """The low-precision copy of ``p`` (on ``p``'s device)."""
        return p.detach().to(self.dtype)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the fp32 masters into the compute copies (after the weights changed)."""
        if self._active:
            raise RuntimeError("ComputeWeights.refresh() inside active(); refresh between microbatches")
        torch._foreach_copy_(self.low, [p.detach() for p in self.params])

    def _accumulate(self, p: torch.Tensor) -> None:
        if not self._active:
            return
        i = self._index[id(p)]
        g = p.grad
        p.grad = None  # the low-precision gradient is folded in and dropped at once
        if self.acc[i] is None:
            self.acc[i] = g.to(torch.float32)
        else:
            self.acc[i].add_(g)

    @contextlib.contextmanager
    def active(self):
        """Run the body's forward and backward on the compute copies; gradients land in fp32 ``.grad``."""
        self._swap_in()
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self._swap_out()

    def _swap_in(self) -> None:
        for i, p in enumerate(self.params):
            self.acc[i] = p.grad
            p.grad = None
            self.master[i] = p.data
            p.data = self.low[i]

    def _swap_out(self) -> None:
        for i, p in enumerate(self.params):
            p.data = self.master[i]
            self.master[i] = None
            p.grad = self.acc[i]
            self.acc[i] = None
