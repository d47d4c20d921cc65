"""The memory planner: activation checkpointing and the microbatch token budget from the shapes.

Legend: P = parameters, T = tokens of one microbatch, H = hidden size, I = MLP width (a MoE
layer: experts per token × expert width), n_q = query heads × head dim, n_kv = key/value heads ×
head dim, V = vocabulary, L = backbone decoder layers, D = MTP depths, C = positions of one
output-head chunk, a = bytes of an element of the compute dtype (2 for bf16 / fp16, 4 for fp32),
f = 4 (an fp32 element). "Bytes a token" are per token of the microbatch.

The peak of a step on the device is estimated as

    peak = state + T · saved(T) + transient

**State** (bytes a parameter, read from the code that allocates each tensor; ``state_layout``):

    one process, bf16/fp16     fp32 master 4 (the nn.Parameter) + compute copy 2
                               (``mixed_precision.ComputeWeights``) + fp32 gradient 4 + AdamW
                               exp_avg 4 + exp_avg_sq 4                                   = 18
    one process, bf16 autocast (``speed.compute_weight_copy: false``) 16, + 2 for autocast's
                               per-microbatch weight casts, which the backward keeps        = 18
    one process, fp32          master 4 + gradient 4 + AdamW 8                            = 16
    ``optim.offload: cpu``     device: compute copy 2 (fp32: 4) + fp32 gradient 4          = 6 (8)
                               host: fp32 master 4 + AdamW 8                               = 12
    FSDP2 over W ranks         (4 + 4 + 8) / W sharded, plus the gathered compute copies and
                               unsharded fp32 gradients of the root unit (embedding, output head,
                               MTP) and of two decoder layers in flight: (a + 4) · (P_root + 2 P_layer)

Frozen parameters (the MTP heads with ``mtp_loss_scaling_factor = 0``) keep their master and
compute copy only. The AdamW moments exist from the first optimizer step on (torch allocates them
there), so the first step's backward runs without them (``PeakEstimate.first_step_peak``).

**Saved for the backward** (``activation_bytes_per_token``), per decoder layer, counted from the
Hugging Face layer code (Qwen3 / Llama / Qwen2: RMSNorm upcasts its input to fp32 and keeps it,
the weight product keeps the normalized input in the compute dtype; SwiGLU keeps gate, up, their
product; attention keeps q, k, v and its output, o_proj its own contiguous input):

    eager      2(f + 2a)·H + (f + 4a)·n_q + (f + 3a)·n_kv + 4a·I     (q/k-norm families)
               2(f + 2a)·H + 3a·n_q + 2a·n_kv + 4a·I                  (no q/k norm)
    compiled   4a·H + 4a·n_q + 3a·n_kv + 3a·I                         (``speed.compile_layers`` on
               one GPU: the norms', rotary's and SwiGLU's pointwise intermediates are recomputed
               from their compute-dtype inputs in the fused backward; an estimate, fitted to no
               measurement but agreeing with the one in the Findings, below)
    checkpointed  a·H (the layer's input; the layer's own set is rebuilt during its backward)

applied to L + D layers (every MTP depth runs one decoder layer). Outside the layers, always
eager: the backbone's final norm and the output head's gathered input (f + 2a)·H, each MTP depth's
three norms, concatenation and head input (3f + 6a)·H, and 128 + 32·(1 + D) bytes of
per-position scalars (masks, logprobs, loss terms, the head's log-normalizer and entropy).
Where attention gets a dense [S, S] mask (packed rows on CPU, or ``packed_attention: dense``) the
mask (T² bytes) is kept too, and k / v are expanded to the query heads (n_kv → n_q above).

**Transient** (the largest short-lived buffer on top, ``transient_bytes``): the output head's
chunk (``splitrl.models.head``: logits and their gradient, [C, V] in the compute dtype; the
eager CPU kernels add fp32 upcasts, ~5 f·C·V) with the head weight's fp32 gradient and its casts
((2f + a)·V·H), or during a layer's backward its gradient buffers (4a·H + 3a·I + 2a·n_q a token)
plus, when checkpointing, the layer's rebuilt set; at the end of the step the gradient norm works
on chunks of 2^24 elements (16 bytes each).

Checked against the measurements in /work/shared/FINDINGS.md and bench/RESULTS.md (H200, bf16,
packed rows): Qwen3-0.6B shape + 2 MTP depths, eager layers: estimate 49.9 / 85.5 GiB at 16 k /
32 k tokens a microbatch against 49.7 / 81.1 measured; with checkpointing 16.2 / 18.0 GiB against
19.1 / 19.1 (that measured peak does not grow with T: a buffer of the step this model does not
name; the margin covers it). Qwen3-1.7B shape + 1 depth, compiled layers, 16 k: 69.6 GiB against
64.8; Qwen3-4B shape + 1 depth, compiled, 32 k with checkpointing: 84.1 GiB against 78.8; the same
at 16 k without checkpointing: 143.0 GiB, and it ran out of memory.

**Plan** (``plan_memory``): the usable memory is (1 − margin) × the free memory of the device
(``torch.cuda.mem_get_info``; on CPU the host's ``MemAvailable``) plus what the model already
occupies there. With ``activation_checkpointing: auto`` and a fixed budget, checkpointing is on
exactly when the estimate without it exceeds the usable memory. With ``max_tokens_per_microbatch:
auto`` the budget is the largest multiple of 1024 tokens up to ``max_auto_tokens`` whose estimate
fits: without checkpointing when that budget is at least ``min_tokens_without_checkpointing``
(or checkpointing is forced off), otherwise with checkpointing. A forced setting is kept as given
and the plan reports whether it fits.

Torch-free at import (the run's preflight uses it before any worker starts); the functions that
read a device's memory import torch when called.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

GiB = 2**30
FP32 = 4
# element bytes of the compute dtype of each precision
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# per-position scalars outside the layers (masks, position / segment ids, logprobs, loss terms)
POSITION_BYTES = 128
# per position and output head: log-normalizer, entropy, target id (splitrl.models.head)
HEAD_POSITION_BYTES = 32
# positions of one output-head chunk (splitrl.models.head._head_settings)
HEAD_CHUNK = {"cuda": 4096, "cpu": 2048}
# the gradient norm reads a gradient in pieces of this many elements, 16 bytes each (fp64 + square)
NORM_CHUNK = 2**24
# budgets ``auto`` considers are multiples of this
TOKEN_STEP = 1024
# ``auto`` budget when no memory figure exists at all (the train-step bench's fixed default)
DEFAULT_AUTO_TOKENS = 8192
# the measured peak may exceed the estimate by this fraction before the estimate is called low
LOW_ESTIMATE_TOLERANCE = 0.10


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


@dataclass(frozen=True, kw_only=True)
class ParameterCount:
    """Parameters of a policy, by part (elements, not bytes).

    Attributes:
        embedding: V·H (also the output head when embeddings are tied).
        layers: the backbone's decoder layers and final norm.
        output_head: an untied output head's V·H; 0 when tied.
        mtp: the MTP block (every stored depth module: norms, ``fc``, decoder layer).
        mtp_trains: the MTP parameters are in the optimizer (λ > 0); otherwise they are frozen.
        largest: elements of the largest single tensor.
        root: the parameters FSDP2 keeps in its root unit (embedding, final norm, output head, MTP).
        largest_layer: parameters of the largest backbone decoder layer.
    """

    embedding: int
    layers: int
    output_head: int
    mtp: int
    mtp_trains: bool
    largest: int
    root: int
    largest_layer: int

    @property
    def backbone(self) -> int:
        return self.embedding + self.layers + self.output_head

    @property
    def total(self) -> int:
        return self.backbone + self.mtp

    @property
    def trainable(self) -> int:
        return self.total if self.mtp_trains else self.backbone

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes the planner reads, from a transformers config (:meth:`from_hf_config`).

    Attributes:
        vocab_size / hidden_size / intermediate_size / num_layers / num_heads / num_kv_heads /
            head_dim: the backbone's (head_dim defaults to hidden_size // num_heads).
        tie_word_embeddings: the output head is the embedding.
        qk_norm: per-head q/k RMSNorm (Qwen3 families).
        qkv_bias / o_bias / mlp_bias: biases of q/k/v, of o_proj, of the MLP projections.
        mtp_depths: D; mtp_modules: depth modules stored (1 with a repeated layer); mtp_trains: λ > 0.
        num_experts / experts_per_token / moe_intermediate_size: a routed MoE MLP's sizes.
        sparse_layers: per backbone layer, whether its MLP is routed; mtp_sparse: per MTP module.
        max_position_embeddings: the context (bounds a sample's length); None if unknown.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    mtp_depths: int = 0
    mtp_modules: int = 0
    mtp_trains: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = ()
    mtp_sparse: tuple[bool, ...] = ()
    max_position_embeddings: int | None = None

    @classmethod
    def from_hf_config(cls, hf_config: Any, mtp: Any = None) -> "ModelShape":
        """Read a transformers config (object or dict, as ``config.json`` holds it) and the MTP knobs.

        Args:
            hf_config: the backbone's config; its ``model_type`` names the family
                (:mod:`splitrl.models.families`: q/k norms, q/k/v biases, routed MLP).
            mtp: an :class:`~splitrl.models.config.MTPConfig` (or a dict of its fields); None: no MTP.

        Raises:
            ValueError: an unsupported family (as :func:`splitrl.models.families.get_family`).
        """
        from splitrl.models.families import get_family

        family = get_family(_get(hf_config, "model_type"))
        H = int(_get(hf_config, "hidden_size"))
        heads = int(_get(hf_config, "num_attention_heads"))
        L = int(_get(hf_config, "num_hidden_layers"))
        attention_bias = bool(_get(hf_config, "attention_bias", False))
        experts = int(_get(hf_config, "num_experts", 0)) if family.moe else 0
        only_dense = set(_get(hf_config, "mlp_only_layers", ()) or ())
        step = int(_get(hf_config, "decoder_sparse_step", 1))

        def sparse(i: int) -> bool:  # transformers' Qwen3MoeDecoderLayer rule
            return experts > 0 and i not in only_dense and (i + 1) % step == 0

        D = int(_get(mtp, "mtp_num_layers", 0)) if mtp is not None else 0
        repeated = bool(_get(mtp, "mtp_use_repeated_layer", False)) if mtp is not None else False
        modules = (1 if repeated else D) if D > 0 else 0
        scale = float(_get(mtp, "mtp_loss_scaling_factor", 0.1)) if mtp is not None else 0.0
        return cls(
            vocab_size=int(_get(hf_config, "vocab_size")),
            hidden_size=H,
            intermediate_size=int(_get(hf_config, "intermediate_size")),
            num_layers=L,
            num_heads=heads,
            num_kv_heads=int(_get(hf_config, "num_key_value_heads", heads)),
            head_dim=int(_get(hf_config, "head_dim", H // heads)),
            tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
            qk_norm=family.qk_norm,
            qkv_bias=family.qkv_bias or attention_bias,
            o_bias=attention_bias and not family.qkv_bias,
            mlp_bias=bool(_get(hf_config, "mlp_bias", False)),
            mtp_depths=D,
            mtp_modules=modules,
            mtp_trains=D > 0 and scale > 0,
            num_experts=experts,
            experts_per_token=int(_get(hf_config, "num_experts_per_tok", 0)) if experts else 0,
            moe_intermediate_size=int(_get(hf_config, "moe_intermediate_size", 0)) if experts else 0,
            sparse_layers=tuple(sparse(i) for i in range(L)),
            # the MTP layers are built from a copy of the config with num_hidden_layers = modules
            mtp_sparse=tuple(sparse(i) for i in range(modules)),
            max_position_embeddings=_get(hf_config, "max_position_embeddings"),
        )

    # ------------------------------------------------------------------ parameters
    @property
    def n_q(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def n_kv(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_parameters(self, sparse: bool = False) -> int:
        """Parameters of one decoder layer (transformers' Qwen3 / Llama / Qwen2 / Qwen3-MoE modules)."""
        H, q, kv = self.hidden_size, self.n_q, self.n_kv
        n = H * q + 2 * H * kv + q * H  # q, k, v, o projections
        if self.qkv_bias:
            n += q + 2 * kv
        if self.o_bias:
            n += H
        if self.qk_norm:
            n += 2 * self.head_dim
        if sparse:  # router [E, H] + fused experts: gate_up [E, 2·I_moe, H], down [E, H, I_moe]
            n += self.num_experts * H + 3 * self.num_experts * H * self.moe_intermediate_size
        else:
            n += 3 * H * self.intermediate_size + (2 * self.intermediate_size + H if self.mlp_bias else 0)
        return n + 2 * H  # input and post-attention RMSNorm

    def mtp_module_parameters(self, sparse: bool = False) -> int:
        """One MTP depth module: enorm, hnorm, ``fc`` [H, 2H] (no bias), decoder layer, final norm."""
        H = self.hidden_size
        return 3 * H + 2 * H * H + self.layer_parameters(sparse)

    def parameter_count(self) -> ParameterCount:
        """Every parameter, from the shapes alone (no model is built)."""
        H, V = self.hidden_size, self.vocab_size
        layers = [
            self.layer_parameters(self.sparse_layers[i] if self.sparse_layers else False)
            for i in range(self.num_layers)
        ]
        mtp = sum(
            self.mtp_module_parameters(self.mtp_sparse[i] if self.mtp_sparse else False)
            for i in range(self.mtp_modules)
        )
        head = 0 if self.tie_word_embeddings else V * H
        tensors = [V * H, H * self.intermediate_size, H * self.n_q]
        if self.num_experts:
            tensors.append(2 * self.num_experts * self.moe_intermediate_size * H)
        if self.mtp_modules:
            tensors.append(2 * H * H)
        return ParameterCount(
            embedding=V * H,
            layers=sum(layers) + H,
            output_head=head,
            mtp=mtp,
            mtp_trains=self.mtp_trains,
            largest=max(tensors),
            root=V * H + H + head + mtp,
            largest_layer=max(layers) if layers else 0,
        )

    # ------------------------------------------------------------------ activations
    def _mlp_width(self, sparse: bool) -> int:
        return self.experts_per_token * self.moe_intermediate_size if sparse else self.intermediate_size

    def layer_activation_bytes(
        self, *, compute_bytes: int, compiled: bool, sparse: bool = False, dense_mask: bool = False
    ) -> int:
        """Bytes a token that one decoder layer keeps for its backward (module docstring's table)."""
        a, f, H = compute_bytes, FP32, self.hidden_size
        q, I = self.n_q, self._mlp_width(sparse)
        kv = q if dense_mask else self.n_kv  # a dense mask: transformers expands k / v to the query heads
        if compiled:
            n = 4 * a * H + 4 * a * q + 3 * a * kv + 3 * a * I
        elif self.qk_norm:
            n = 2 * (f + 2 * a) * H + (f + 4 * a) * q + (f + 3 * a) * kv + 4 * a * I
        else:
            n = 2 * (f + 2 * a) * H + 3 * a * q + 2 * a * kv + 4 * a * I
        if sparse:  # router logits (fp32) and their softmax
            n += 2 * f * self.num_experts
        return n

    def _layer_sparsity(self) -> list[bool]:
        backbone = list(self.sparse_layers) or [False] * self.num_layers
        mtp = list(self.mtp_sparse) or [False] * self.mtp_modules
        # depth k runs module k (or the one repeated module) once
        per_depth = [mtp[k % len(mtp)] if mtp else False for k in range(self.mtp_depths)]
        return backbone + per_depth

    def activation_bytes_per_token(
        self, *, compute_bytes: int, checkpointing: bool, compiled: bool, dense_mask: bool = False
    ) -> int:
        """Bytes a token kept for the backward over the whole forward (module docstring)."""
        a, f, H, D = compute_bytes, FP32, self.hidden_size, self.mtp_depths
        if checkpointing:
            layers = a * H * (self.num_layers + D)
        else:
            layers = sum(
                self.layer_activation_bytes(compute_bytes=a, compiled=compiled, sparse=s, dense_mask=dense_mask)
                for s in self._layer_sparsity()
            )
        outside = (f + 2 * a) * H + D * (3 * f + 6 * a) * H
        return layers + outside + POSITION_BYTES + HEAD_POSITION_BYTES * (1 + D)

    def backward_working_bytes_per_token(self, *, compute_bytes: int, checkpointing: bool, compiled: bool) -> int:
        """Bytes a token alive during one layer's backward: its gradient buffers, and with
        checkpointing the layer's rebuilt activations (the largest layer)."""
        a = compute_bytes
        worst = 0
        for s in set(self._layer_sparsity()) or {False}:
            n = 4 * a * self.hidden_size + 3 * a * self._mlp_width(s) + 2 * a * self.n_q
            if checkpointing:
                n += self.layer_activation_bytes(compute_bytes=a, compiled=compiled, sparse=s)
            worst = max(worst, n)
        return worst

    def head_transient_bytes(self, tokens: int, *, compute_bytes: int, fused: bool, chunk: int) -> int:
        """The output head's largest buffers at once (``splitrl.models.head``): one chunk's logits
        and their gradient [C, V] (eager kernels: fp32 upcasts too), and the head weight's fp32
        gradient with its casts [V, H]."""
        a, f = compute_bytes, FP32
        C = max(1, min(chunk, tokens))
        per_chunk = 2 * a if fused else a + 5 * f
        return per_chunk * C * self.vocab_size + (2 * f + a) * self.vocab_size * self.hidden_size


@dataclass(frozen=True, kw_only=True)
class StateLayout:
    """Bytes a parameter keeps on the device and on the host for the whole run.

    Attributes:
        device_trainable / device_frozen / host_trainable / host_frozen: bytes a parameter.
        moments_on_device: of ``device_trainable``, the AdamW moments (allocated at the first update).
        parts: the breakdown, for the log line.
        world_size: data-parallel ranks (FSDP2 shards the state over them).
        compute_bytes: a.
    """

    device_trainable: float
    device_frozen: float
    host_trainable: float
    host_frozen: float
    moments_on_device: float
    parts: str
    world_size: int
    compute_bytes: int


def state_layout(
    precision: str, *, offload: str = "none", compute_weight_copy: bool = True, world_size: int = 1
) -> StateLayout:
    """Where each parameter's state lives (the module docstring's table).

    Args:
        precision: ``fp32``, ``bf16`` or ``fp16``.
        offload: ``none`` or ``cpu`` (``train.optim.offload``).
        compute_weight_copy: ``speed.compute_weight_copy`` (one process, bf16 / fp16).
        world_size: data-parallel ranks; > 1 means FSDP2.

    Raises:
        ValueError: ``offload: cpu`` with ``world_size`` > 1 (not built), or an unknown precision.
    """
    if precision not in COMPUTE_BYTES:
        raise ValueError(f"precision must be one of {sorted(COMPUTE_BYTES)}, got {precision!r}")
    a = COMPUTE_BYTES[precision]
    low = precision != "fp32"
    if offload == "cpu":
        if world_size > 1:
            raise ValueError("train.optim.offload=cpu runs on one process; with data parallelism set it to none")
        dt = "fp32" if not low else precision
        return StateLayout(
            device_trainable=a + FP32,
            device_frozen=a,
            host_trainable=3 * FP32,
            host_frozen=FP32,
            moments_on_device=0.0,
            parts=f"device: {dt} copy {a} + fp32 grads 4; host: fp32 masters 4 + AdamW 8",
            world_size=1,
            compute_bytes=a,
        )
    if world_size > 1:
        return StateLayout(
            device_trainable=16 / world_size,
            device_frozen=4 / world_size,
            host_trainable=0.0,
            host_frozen=0.0,
            moments_on_device=8 / world_size,
            parts=f"FSDP2 shards of fp32 masters + grads + AdamW, 16/{world_size}",
            world_size=world_size,
            compute_bytes=a,
        )
    if not low:
        return StateLayout(
            device_trainable=16.0,
            device_frozen=4.0,
            host_trainable=0.0,
            host_frozen=0.0,
            moments_on_device=8.0,
            parts="fp32 masters 4 + fp32 grads 4 + AdamW 8",
            world_size=1,
            compute_bytes=a,
        )
    what = f"{precision} copy 2" if compute_weight_copy else f"autocast's {precision} casts 2"
    return StateLayout(
        device_trainable=18.0,
        device_frozen=6.0,
        host_trainable=0.0,
        host_frozen=0.0,
        moments_on_device=8.0,
        parts=f"fp32 masters 4 + {what} + fp32 grads 4 + AdamW 8",
        world_size=1,
        compute_bytes=a,
    )


@dataclass(frozen=True, kw_only=True)
class PeakEstimate:
    """The estimated peak of a step on the device (bytes).

    Attributes:
        state: parameters, gradients and optimizer state (the device's share).
        activations: what the forward of one microbatch keeps for its backward.
        transient: the largest short-lived buffer on top of both (module docstring).
        peak: state + activations + transient, and at least state + the finish step's buffers.
        first_step_peak: the same for the first step, whose backward runs before the AdamW
            moments exist.
        host: host bytes of the optimizer state (``offload: cpu``; staging buffers included); on
            a CPU device they are part of ``state`` and ``peak`` instead (one memory).
        tokens: the microbatch tokens T this is for.
    """

    state: int
    activations: int
    transient: int
    peak: int
    first_step_peak: int
    host: int
    tokens: int


def estimate_peak(
    shape: ModelShape,
    tokens: int,
    layout: StateLayout,
    *,
    checkpointing: bool,
    compiled: bool = False,
    fused_head: bool = True,
    device_type: str = "cuda",
    dense_mask: bool = False,
    offload_bucket_bytes: int = 0,
) -> PeakEstimate:
    """The peak of a step whose microbatches hold ``tokens`` tokens (module docstring).

    Args:
        shape: the model.
        tokens: T, tokens of the largest microbatch.
        layout: :func:`state_layout` of the run.
        checkpointing: activation checkpointing of every decoder layer.
        compiled: compiled decoder layers (``speed.compile_layers`` on one CUDA device).
        fused_head: the output head's compiled kernels (CUDA with ``speed.fused_head_kernels``).
        device_type: ``cuda`` or ``cpu`` (the head's chunk size).
        dense_mask: attention takes a dense [S, S] mask (packed rows on CPU, or
            ``packed_attention: dense``).
        offload_bucket_bytes: ``offload: cpu``: the fp32 bytes of the largest bucket.
    """
    counts = shape.parameter_count()
    a = layout.compute_bytes
    state = layout.device_trainable * counts.trainable + layout.device_frozen * counts.frozen
    if layout.world_size > 1:  # FSDP2: gathered copies and unsharded gradients of the root and two layers
        state += (a + FP32) * (counts.root + 2 * counts.largest_layer)
    moments = layout.moments_on_device * counts.trainable
    saved = tokens * shape.activation_bytes_per_token(
        compute_bytes=a, checkpointing=checkpointing, compiled=compiled, dense_mask=dense_mask
    )
    if dense_mask:
        saved += tokens * tokens  # the bool [S, S] mask of one packed row
    chunk = HEAD_CHUNK.get(device_type, HEAD_CHUNK["cpu"])
    head = shape.head_transient_bytes(tokens, compute_bytes=a, fused=fused_head, chunk=chunk)
    layer = tokens * shape.backward_working_bytes_per_token(
        compute_bytes=a, checkpointing=checkpointing, compiled=compiled
    )
    transient = max(head, layer)
    finish = 16 * min(counts.largest, NORM_CHUNK)
    peak = max(state + saved + transient, state + finish)
    first = max(state - moments + saved + transient, state + finish)
    host = 0.0
    if layout.host_trainable:
        host = layout.host_trainable * counts.trainable + layout.host_frozen * counts.frozen
        host += 2 * offload_bucket_bytes * (1 + a / FP32)  # two buckets of fp32 grads + compute-dtype weights
        if device_type == "cpu":  # host and device are one memory
            state, peak, first, host = state + host, peak + host, first + host, 0.0
    return PeakEstimate(
        state=int(state),
        activations=int(saved),
        transient=int(transient),
        peak=int(peak),
        first_step_peak=int(first),
        host=int(host),
        tokens=tokens,
    )


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """The planner's choice and the estimate it rests on.

    Attributes:
        parameters: the parameter count.
        layout: bytes a parameter, by place.
        estimate: the peak at the chosen settings.
        activation_checkpointing: the choice (or the forced setting).
        max_tokens_per_microbatch: the budget the worker runs with (None: by sample count).
        available_bytes: the memory planned against (None: no figure; nothing was decided).
        available_source: where that figure comes from.
        margin: the fraction of it kept out of the plan.
        host_available_bytes: the host memory figure, with ``offload: cpu`` (None otherwise).
        reason: how the two settings came about.
        device: the device, for the log line.
    """

    parameters: ParameterCount
    layout: StateLayout
    estimate: PeakEstimate
    activation_checkpointing: bool
    max_tokens_per_microbatch: int | None
    available_bytes: int | None
    available_source: str
    margin: float
    host_available_bytes: int | None
    reason: str
    device: str

    @property
    def usable_bytes(self) -> int | None:
        """(1 − margin) · available memory."""
        return None if self.available_bytes is None else int(self.available_bytes * (1.0 - self.margin))

    @property
    def fits(self) -> bool:
        """The estimated peak stays within the usable memory (True when there is no figure)."""
        return self.usable_bytes is None or self.estimate.peak <= self.usable_bytes

    def summary(self) -> str:
        """One line: parameters, bytes a parameter, estimated peak, free memory, the choice."""
        p, lay, est = self.parameters, self.layout, self.estimate
        head = "tied output head" if p.output_head == 0 else f"output head {format_count(p.output_head)}"
        frozen = f", {format_count(p.frozen)} frozen" if p.frozen else ""
        mem = (
            "no memory figure"
            if self.available_bytes is None
            else f"of {format_gib(self.usable_bytes)} usable ({format_gib(self.available_bytes)} "
            f"{self.available_source}, {100 * self.margin:.0f} % margin)"
        )
        host = ""
        if est.host:
            host = f"; host {format_gib(est.host)}"
            if self.host_available_bytes is not None:
                host += f" of {format_gib(self.host_available_bytes)} available"
        budget = (
            "by sample count" if self.max_tokens_per_microbatch is None else f"{self.max_tokens_per_microbatch} tokens"
        )
        return (
            f"memory plan: {format_count(p.total)} parameters (backbone {format_count(p.backbone)}, MTP "
            f"{format_count(p.mtp)}, {head}{frozen}), {lay.device_trainable:g} bytes a parameter on {self.device} "
            f"({lay.parts}); estimated peak {format_gib(est.peak)} {mem} = state {format_gib(est.state)} + "
            f"activations {format_gib(est.activations)} + transient {format_gib(est.transient)} at {est.tokens} "
            f"tokens{host}; activation checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}, microbatch budget {budget} ({self.reason})"
            + ("" if self.fits else "; THE ESTIMATE DOES NOT FIT")
        )

    def compare(self, measured_peak: int, step: int) -> tuple[str, bool]:
        """A log line comparing a step's measured peak (``torch.cuda.max_memory_allocated``)
        with the estimate for that step, and whether the estimate was low by more than
        ``LOW_ESTIMATE_TOLERANCE`` (step 1 is compared with ``first_step_peak``)."""
        est = self.estimate.first_step_peak if step == 1 else self.estimate.peak
        ratio = measured_peak / est if est else float("inf")
        low = measured_peak > est * (1.0 + LOW_ESTIMATE_TOLERANCE)
        line = (
            f"memory after step {step}: measured peak {format_gib(measured_peak)}, estimated "
            f"{format_gib(est)} ({100 * ratio:.0f} % of the estimate"
            + (", AdamW moments allocated during its update)" if step == 1 and self.layout.moments_on_device else ")")
        )
        if low:
            line += (
                f"; the estimate was LOW by {100 * (ratio - 1):.0f} %: raise train.memory.margin, or lower "
                "train.microbatch.max_tokens_per_microbatch / turn on train.speed.activation_checkpointing"
            )
        return line, low


def _fits(peak: int, usable: int | None) -> bool:
    return usable is None or peak <= usable


def plan_memory(
    shape: ModelShape,
    *,
    precision: str,
    available_bytes: int | None,
    available_source: str = "",
    device: str = "cuda",
    margin: float = 0.1,
    offload: str = "none",
    compute_weight_copy: bool = True,
    world_size: int = 1,
    compiled: bool = False,
    fused_head: bool = True,
    dense_mask: bool = False,
    checkpointing: bool | Literal["auto"] = "auto",
    max_tokens: int | Literal["auto"] | None = None,
    micro_batch_size: int = 4,
    max_auto_tokens: int = 32768,
    min_tokens_without_checkpointing: int = 8192,
    offload_bucket_bytes: int = 0,
    host_available_bytes: int | None = None,
) -> MemoryPlan:
    """Choose activation checkpointing and the microbatch token budget (module docstring, "Plan").

    Args:
        shape: the model.
        precision / offload / compute_weight_copy / world_size: as :func:`state_layout`.
        available_bytes: the memory to plan against (free device memory + what the model already
            holds there); None: no figure (``auto`` then means off / ``DEFAULT_AUTO_TOKENS``).
        available_source: where that figure comes from (for the log line).
        device: the device's name (``cuda:0``, ``cpu``); its type sets the head's chunk size.
        margin: the fraction of ``available_bytes`` kept out of the plan.
        compiled / fused_head / dense_mask: as :func:`estimate_peak`.
        checkpointing: ``speed.activation_checkpointing`` (``auto`` or forced).
        max_tokens: ``microbatch.max_tokens_per_microbatch``: a budget, ``auto``, or None
            (microbatches by sample count: the estimate is for ``micro_batch_size`` samples of
            the model's full context).
        micro_batch_size: samples per microbatch when ``max_tokens`` is None.
        max_auto_tokens / min_tokens_without_checkpointing: ``train.memory``'s.
        offload_bucket_bytes: ``offload: cpu``: fp32 bytes of the largest bucket.
        host_available_bytes: the host's available memory, reported next to the host estimate.

    Returns:
        The :class:`MemoryPlan`. A forced setting that does not fit is kept (``fits`` is False).
    """
    layout = state_layout(precision, offload=offload, compute_weight_copy=compute_weight_copy, world_size=world_size)
    device_type = device.split(":")[0]
    usable = None if available_bytes is None else int(available_bytes * (1.0 - margin))

    def estimate(tokens: int, ckpt: bool) -> PeakEstimate:
        return estimate_peak(
            shape,
            tokens,
            layout,
            checkpointing=ckpt,
            compiled=compiled,
            fused_head=fused_head,
            device_type=device_type,
            dense_mask=dense_mask,
            offload_bucket_bytes=offload_bucket_bytes,
        )

    def largest(ckpt: bool) -> int | None:
        top = max(TOKEN_STEP, max_auto_tokens - max_auto_tokens % TOKEN_STEP)
        for tokens in range(top, 0, -TOKEN_STEP):
            if _fits(estimate(tokens, ckpt).peak, usable):
                return tokens
        return None

    if max_tokens == "auto":
        if usable is None:
            ckpt = checkpointing is True
            tokens, reason = DEFAULT_AUTO_TOKENS, "no memory figure: the default budget"
        elif checkpointing != "auto":
            ckpt = bool(checkpointing)
            found = largest(ckpt)
            tokens = found or TOKEN_STEP
            reason = (
                f"checkpointing forced {'on' if ckpt else 'off'}; the largest budget that fits"
                if found
                else f"checkpointing forced {'on' if ckpt else 'off'}; not even {TOKEN_STEP} tokens fit"
            )
        else:
            plain = largest(False)
            if plain is not None and plain >= min(min_tokens_without_checkpointing, max_auto_tokens):
                ckpt, tokens = False, plain
                reason = f"auto: {plain} tokens fit without checkpointing"
            else:
                found = largest(True)
                ckpt, tokens = True, found or TOKEN_STEP
                without = f"only {plain} tokens fit without it" if plain else f"not {TOKEN_STEP} tokens fit without it"
                reason = (
                    f"auto: {without} (< {min_tokens_without_checkpointing}), {found} with it"
                    if found
                    else f"auto: {without}, and not {TOKEN_STEP} with it"
                )
        budget: int | None = tokens
        planned = tokens
    else:
        budget = max_tokens
        if budget is None:
            context = shape.max_position_embeddings or 2048
            planned = micro_batch_size * context
            what = f"{micro_batch_size} samples x {context} positions"
        else:
            planned, what = budget, f"{budget} tokens"
        if checkpointing != "auto":
            ckpt = bool(checkpointing)
            reason = f"checkpointing forced {'on' if ckpt else 'off'}, budget as configured"
        elif usable is None:
            ckpt, reason = False, "no memory figure: checkpointing off"
        else:
            ckpt = not _fits(estimate(planned, False).peak, usable)
            reason = (
                f"auto: {what} do not fit without checkpointing" if ckpt else f"auto: {what} fit without checkpointing"
            )
    return MemoryPlan(
        parameters=shape.parameter_count(),
        layout=layout,
        estimate=estimate(planned, ckpt),
        activation_checkpointing=ckpt,
        max_tokens_per_microbatch=budget,
        available_bytes=available_bytes,
        available_source=available_source,
        margin=margin,
        host_available_bytes=host_available_bytes,
        reason=reason,
        device=device,
    )


# ---------------------------------------------------------------------------------- memory figures
def host_available_memory() -> tuple[int | None, str]:
    """The host's available memory in bytes and its source: ``MemAvailable`` of /proc/meminfo
    (what can be allocated without swapping), else ``os.sysconf`` free pages; (None, ...) when
    neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available on the host (MemAvailable)"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free on the host (sysconf)"
    except (OSError, ValueError, AttributeError):
        return None, "unknown"


def cuda_free_memory(index: int = 0, *, create_context: bool = True) -> tuple[int | None, str]:
    """Free memory of CUDA device ``index`` (bytes) and its source.

    With ``create_context=False`` (a process that will not use the GPU itself, e.g. the run's
    controller under Ray) it asks NVML first (``pynvml``, no CUDA context: torch's
    ``mem_get_info`` would create one, holding ~0.5 GiB of the GPU for the life of the process)
    and gives (None, ...) when NVML is missing; otherwise ``torch.cuda.mem_get_info``.
    """
    if not create_context:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                physical = int(visible.split(",")[index]) if visible else index
                info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(physical))
                return int(info.free), f"free on cuda:{index} (NVML)"
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - no NVML binding, a non-numeric CUDA_VISIBLE_DEVICES, ...
            return None, "unknown (no NVML)"
    import torch

    free, _total = torch.cuda.mem_get_info(index)
    return int(free), f"free on cuda:{index} (torch.cuda.mem_get_info)"


def format_count(n: float) -> str:
    """A parameter count: ``8.417 B``, ``35.7 M``, ``12 k``."""
    if n >= 1e9:
        return f"{n / 1e9:.3f} B"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    return f"{n / 1e3:.0f} k"


def format_gib(n: float) -> str:
    """Bytes as ``86.5 GiB`` (``12.0 MiB`` below 0.1 GiB)."""
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:.1f} MiB"
