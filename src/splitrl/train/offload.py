"""Optimizer state in host memory: ``train.optim.offload: cpu`` (one process).

Where each tensor of a trainable parameter lives, bytes a parameter (bf16 / fp16 training; an fp32
run keeps an fp32 compute copy, 4 bytes):

    host (CPU)   the fp32 master weight (the ``nn.Parameter`` itself, between microbatches),
                 AdamW's exp_avg and exp_avg_sq (``torch.optim.AdamW`` over CPU tensors)     12
    device       the compute copy in the training dtype, the fp32 gradient accumulator          6

against 18 on the device without offload (:mod:`splitrl.train.memory_plan`): the Qwen3-8B shape +
1 MTP depth (8.4 B parameters) needs 151 GB there, more than one H200 holds, and 50 GB with offload.

The forward and backward are those of :class:`~splitrl.train.mixed_precision.ComputeWeights`:
during a microbatch every parameter's ``.data`` is its compute copy on the device, and each
gradient is folded into an fp32 accumulator on the device as soon as autograd has finished it.
Unlike there, the accumulators stay here (:meth:`HostOffload.grads`): ``.grad`` of a parameter
on the host cannot hold a device tensor. The train worker computes the norms, the clipping and
the single gradient scaling of finish on these accumulators, on the device, with the same code
as without offload, and then calls :meth:`HostOffload.step`, which walks the trainable
parameters in buckets of about ``bucket_bytes`` of fp32 gradient, in order:

    1. device → host: the bucket's accumulators into a pinned fp32 staging buffer (on a copy
       stream, issued one bucket ahead, so the copy of bucket b + 1 overlaps the CPU work on b);
    2. the AdamW step on the CPU: ``.grad`` of the bucket's parameters is set to their staging
       views and ``optimizer.step()`` runs; torch's AdamW updates only parameters that have a
       gradient, so one call per bucket updates every parameter exactly once, as one call over
       all of them would (per-parameter step counts, LR, betas, weight decay);
    3. the updated fp32 masters are cast to the training dtype into a pinned staging buffer on
       the CPU and copied to the compute copies (copy stream) — half the bytes of an fp32 copy.

Two staging buffers of each kind alternate, so a buffer is reused only after its previous copy
has completed (an event each). At the end the copy stream is drained. The step's result is the
on-device step's up to AdamW's rounding (torch's fused CPU kernel instead of the fused CUDA one;
tests/core/test_offload.py compares them), and checkpoints (``state_dict``, the sharded
checkpointer) see plain CPU parameters and a plain AdamW state, so they are unchanged.

A master written from outside (``load_state_dict``, a checkpoint load) is found at the next
:meth:`HostOffload.refresh` by its version counter and storage and copied to the device; the
worker also calls :meth:`HostOffload.invalidate` after its own loads. The step's own updates are
copied explicitly (step 3): torch's fused CPU AdamW leaves the version counters alone (torch 2.13,
seen here), so they could not be found that way. ``HostOffload.timings`` holds the seconds of the
last step's phases (waiting for gradients, AdamW, cast and send, draining).

On CPU (the tests) "host" and "device" are both the CPU, but every step above runs as on CUDA:
the compute copies and the accumulators are tensors of their own, the staging copies and the
copy-back happen; only the streams and pinning are skipped.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from splitrl.train.mixed_precision import ComputeWeights


def bucket_indices(numels: list[int], bucket_elements: int) -> list[list[int]]:
    """Consecutive indices grouped so that each group's elements stay within ``bucket_elements``;
    an index whose own count exceeds it is a group alone."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        if current and size + n > bucket_elements:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


class HostOffload(ComputeWeights):
    """fp32 masters and AdamW state on the host, compute copies and gradients on ``device``.

    Args:
        module: the model; its parameters (fp32, on the CPU) are the masters and stay there.
        device: where the forward and backward run.
        dtype: the training dtype of the compute copies (``torch.bfloat16``, ``torch.float16``
            or ``torch.float32``).
        bucket_bytes: fp32 gradient bytes per bucket of :meth:`step` (see the module docstring).

    Raises:
        ValueError: a parameter is not an fp32 CPU tensor.
    """

    def __init__(self, module: nn.Module, device: torch.device, dtype: torch.dtype, bucket_bytes: int) -> None:
        bad = [n for n, p in module.named_parameters() if p.device.type != "cpu" or p.dtype != torch.float32]
        if bad:
            raise ValueError(f"offload keeps fp32 masters on the CPU: build the model in fp32 on the CPU ({bad[0]})")
        self.device = torch.device(device)
        super().__init__(module, dtype)
        self._seen: list[tuple[int, int] | None] = [None] * len(self.params)
        self._record(range(len(self.params)))
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        groups = bucket_indices([self.params[i].numel() for i in trainable], max(1, bucket_bytes // 4))
        self.buckets = [[trainable[j] for j in g] for g in groups]
        most = max((sum(self.params[i].numel() for i in b) for b in self.buckets), default=1)
        self.bucket_bytes = 4 * most
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._grad_staging = [torch.empty(most, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        self._low_staging = [torch.empty(most, dtype=dtype, pin_memory=cuda) for _ in range(2)]
        # seconds of the last step by phase: waiting for gradients, AdamW on the CPU, cast and send
        # of the weights, draining the copy stream at the end
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------ compute copies
    def _compute_copy(self, p: torch.Tensor) -> torch.Tensor:
        # always a tensor of its own, also when the device is the CPU and the dtype fp32
        return torch.empty(p.shape, dtype=self.dtype, device=self.device).copy_(p.detach())

    def _record(self, indices) -> None:
        for i in indices:
            p = self.params[i]
            self._seen[i] = (p.data_ptr(), p._version)

    def invalidate(self) -> None:
        """Copy every master to the device at the next :meth:`refresh` (after an outside write)."""
        self._seen = [None] * len(self.params)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy to the device the masters written since their last copy (version counter or storage changed)."""
        if self._active:
            raise RuntimeError("HostOffload.refresh() inside active(); refresh between microbatches")
        stale = [i for i, p in enumerate(self.params) if self._seen[i] != (p.data_ptr(), p._version)]
        for i in stale:
            self.low[i].copy_(self.params[i].detach())
        self._record(stale)

    def _swap_in(self) -> None:
        for i, p in enumerate(self.params):
            assert p.grad is None, "offload keeps gradients in its accumulators, never in .grad"
            self.master[i] = p.data
            p.data = self.low[i]

    def _swap_out(self) -> None:
        for i, p in enumerate(self.params):
            p.data = self.master[i]
            self.master[i] = None
            p.grad = None  # a device gradient cannot stay on a host parameter; the hooks folded it in

    # ------------------------------------------------------------------ gradients
    def grads(self, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The fp32 gradient accumulators (on the device) of ``params``; None where none arrived."""
        return [self.acc[self._index[id(p)]] for p in params]

    def drop_grads(self, params: list[torch.Tensor]) -> None:
        """Forget the gradients of ``params`` (AdamW then leaves them alone, as for ``.grad = None``)."""
        for p in params:
            self.acc[self._index[id(p)]] = None

    def zero_grads(self) -> None:
        self.acc = [None] * len(self.params)

    # ------------------------------------------------------------------ the step
    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _event(self):
        if self._stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self._stream)
        return ev

    def _send_grads(self, b: int):
        """Queue bucket ``b``'s accumulators into its staging buffer; (index, host view) pairs and an event."""
        flat = self._grad_staging[b % 2]
        views, offset = [], 0
        with self._on_stream():
            for i in self.buckets[b]:
                p = self.params[i]
                view = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
                if self.acc[i] is not None:
                    view.copy_(self.acc[i], non_blocking=True)
                    views.append((i, view))
        return views, self._event()

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step over the host masters, bucket by bucket (module docstring), and the
        copy of the updated weights to the device. The accumulators must hold the final, scaled
        gradients; they are left in place (:meth:`zero_grads` drops them)."""
        if not self.buckets:
            return
        clock = {"wait_grads": 0.0, "adamw": 0.0, "cast_send": 0.0, "drain": 0.0}
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the scaled gradients
        sent = self._send_grads(0)
        back_events = [None, None]
        for b in range(len(self.buckets)):
            views, arrived = sent
            if b + 1 < len(self.buckets):
                sent = self._send_grads(b + 1)
            t0 = time.perf_counter()
            if arrived is not None:
                arrived.synchronize()
            t1 = time.perf_counter()
            for i, view in views:
                self.params[i].grad = view
            try:
                optimizer.step()
            finally:
                for i, _ in views:
                    self.params[i].grad = None
            t2 = time.perf_counter()
            if back_events[b % 2] is not None:
                back_events[b % 2].synchronize()  # this staging buffer's last copy (bucket b - 2) is done
            flat, offset = self._low_staging[b % 2], 0
            with self._on_stream():
                for i, _ in views:
                    p = self.params[i]
                    low = flat[offset : offset + p.numel()].view(p.shape)
                    offset += p.numel()
                    low.copy_(p.detach())  # cast on the CPU: half the bytes to send
                    self.low[i].copy_(low, non_blocking=True)
            back_events[b % 2] = self._event()
            self._record(i for i, _ in views)
            t3 = time.perf_counter()
            clock["wait_grads"] += t1 - t0
            clock["adamw"] += t2 - t1
            clock["cast_send"] += t3 - t2
        t0 = time.perf_counter()
        if self._stream is not None:
            self._stream.synchronize()
        clock["drain"] = time.perf_counter() - t0
        self.timings = clock
