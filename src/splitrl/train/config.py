"""Configuration of the train step; no torch import, so a run config validates before torch loads."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MicrobatchConfig(BaseModel):
    """How a chunk is cut into microbatches.

    Attributes:
        micro_batch_size: samples per microbatch (used when no token budget is set).
        max_tokens_per_microbatch: token budget per microbatch (real tokens when packing, padded
            tokens b·s otherwise); a single sample longer than the budget gets a microbatch alone.
            ``auto``: the train worker's memory planner picks the largest budget that fits the
            device (:mod:`splitrl.train.memory_plan`, ``TrainConfig.memory``); the worker runs with
            the resolved number (``TrainWorker.config``).
        pack_sequences: lay a microbatch out as one packed row (per-sample attention and
            positions), unless the model owns packing.
        coalesce_chunks: the split step cuts microbatches from the stream of its chunks' samples
            rather than from each chunk alone: the last, still unfilled microbatch of a chunk
            waits for the next chunk's samples (or for finish). Many small chunks then run as the
            same full microbatches as one synchronous step (without it many small chunks run
            far slower: bench/RESULTS.md); the result is the same either way
            (chunk invariance), only the call that does the work moves.
    """

    model_config = ConfigDict(extra="forbid")

    micro_batch_size: int = Field(4, ge=1)
    max_tokens_per_microbatch: Annotated[int, Field(ge=2)] | Literal["auto"] | None = None
    pack_sequences: bool = False
    coalesce_chunks: bool = True


class SpeedConfig(BaseModel):
    """Switches of :func:`apply_speed_config` (defaults chosen by measurement, see bench/RESULTS.md).

    Attributes:
        compile_layers: ``torch.compile`` each decoder layer (backbone and MTP) on one CUDA
            device (faster than the eager step, bench/RESULTS.md; the first steps pay the
            compilation). Not applied under FSDP2, where it was not measured.
        activation_checkpointing: recompute each decoder layer in the backward instead of
            keeping its activations (saves most activation memory for ~1/3 more layer compute).
            ``auto`` (default): the memory planner turns it on when the estimated peak of a
            microbatch without it does not fit the device memory with the planner's margin
            (:mod:`splitrl.train.memory_plan`; ``TrainConfig.memory``). ``true`` / ``false``
            force it.
        fused_head_kernels: compile the output head's per-chunk softmax statistics and gradient
            into fused kernels on CUDA (see ``splitrl.models.head``).
        packed_attention: packed rows on CUDA: ``flex`` (FlexAttention block mask), ``varlen``
            (flash variable-length kernel) or ``dense`` (an [S, S] mask, the CPU path).
        compute_weight_copy: bf16/fp16 on one process: compute on low-precision weight copies made
            once per step, fp32 masters and gradients (``splitrl.train.mixed_precision``); off:
            autocast re-casts the fp32 weights on every microbatch.
    """

    model_config = ConfigDict(extra="forbid")

    compile_layers: bool = True
    activation_checkpointing: bool | Literal["auto"] = "auto"
    fused_head_kernels: bool = True
    packed_attention: Literal["flex", "varlen", "dense"] = "flex"
    compute_weight_copy: bool = True


class MemoryConfig(BaseModel):
    """The memory planner of the train worker (:mod:`splitrl.train.memory_plan`).

    It estimates the peak memory of a step from the model's shapes, the precision and where the
    optimizer state lives, and decides ``speed.activation_checkpointing: auto`` and
    ``microbatch.max_tokens_per_microbatch: auto`` so that the estimate fits.

    Attributes:
        device_memory_gib: the memory (GiB) the planner plans against. ``null`` (default): the
            free memory of the CUDA device when the worker starts (``torch.cuda.mem_get_info``),
            or on CPU the host's available memory (``MemAvailable`` of /proc/meminfo), in both
            cases plus what the model already occupies there.
        margin: fraction of that memory kept out of the plan (allocator fragmentation, kernel
            workspaces, the estimate's error): the estimated peak must stay below
            (1 - margin) · memory.
        max_auto_tokens: the largest budget ``max_tokens_per_microbatch: auto`` picks.
        min_tokens_without_checkpointing: with both ``auto``, checkpointing stays off when a
            budget of at least this many tokens fits without it (the planner then takes the
            largest such budget); otherwise it is turned on and the budget is the largest that
            fits with it.
    """

    model_config = ConfigDict(extra="forbid")

    device_memory_gib: float | None = Field(None, gt=0.0)
    margin: float = Field(0.1, ge=0.0, lt=1.0)
    max_auto_tokens: int = Field(32768, ge=1024)
    min_tokens_without_checkpointing: int = Field(8192, ge=1)


class OptimConfig(BaseModel):
    """AdamW, warmup + constant/cosine schedule, gradient clipping.

    Attributes:
        lr: peak learning rate of the policy parameters.
        mtp_lr: peak learning rate of the MTP parameters, their own AdamW group (the heads-only
            warm-up uses it too; the schedule scales it like ``lr``); ``null``: ``lr``. Default
            1e-3, measured best for fresh heads on a pretrained policy, far above a policy's
            RL learning rate (``bench/bench_mtp_warmstart.py``; figures in bench/RESULTS.md).
        warmup_steps: linear warmup from lr/warmup_steps to lr.
        schedule: ``constant`` after warmup, or ``cosine`` decay to ``min_lr_ratio``·lr at
            ``total_steps`` (required for cosine; a run config fills in its ``schedule.num_steps``
            before this config validates).
        betas / eps: AdamW's.
        total_steps: the step at which the cosine decay ends (default for a run: ``schedule.num_steps``).
        min_lr_ratio: the cosine schedule's final LR as a fraction of ``lr``.
        max_grad_norm: clip of the policy gradient norm (None: no clipping).
        mtp_max_grad_norm: clip of the MTP group with detached heads (None: same as
            ``max_grad_norm``; ``inf`` to disable for MTP only).
        offload: where the fp32 master weights and the AdamW moments live. ``none`` (default):
            on the device, next to the model. ``cpu``: in host memory, with the AdamW step run
            on the CPU; the device keeps only a compute copy in the training dtype and the fp32
            gradient accumulators (6 bytes a parameter instead of 18 with bf16; see
            :mod:`splitrl.train.offload`). One process only (not with data parallelism).
        offload_bucket_mb: with ``offload: cpu``, the gradients go to the host and the updated
            weights back in buckets of about this many MiB of fp32 gradient (a parameter larger
            than that is a bucket alone); two buckets' staging buffers are pinned host memory.
    """

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-5, gt=0.0)
    mtp_lr: float | None = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int | None = Field(None, ge=1)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    mtp_max_grad_norm: float | None = Field(None, gt=0.0)
    offload: Literal["none", "cpu"] = "none"
    offload_bucket_mb: float = Field(1024.0, gt=0.0)

    @model_validator(mode="after")
    def _check(self) -> "OptimConfig":
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("schedule='cosine' needs total_steps (the step at which the decay ends)")
        return self

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak LR at optimizer step ``step`` (0-indexed)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TrainConfig(BaseModel):
    """Configuration of a :class:`TrainWorker`.

    Attributes:
        precision: ``fp32``; ``bf16`` (fp32 master weights and optimizer state, bf16 compute,
            fp32 gradient reduction); ``fp16`` (the same with fp16 compute and dynamic loss scaling).
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda``.
        microbatch: how chunks are cut (:class:`MicrobatchConfig`).
        optim: AdamW, schedule and clipping (:class:`OptimConfig`).
        initial_loss_scale / loss_scale_growth_interval: fp16 loss scaler.
        fsdp_reshard_after_forward: FSDP2 frees a layer's gathered weights after its forward.
        mtp_warmup_steps: the first this many steps train only the MTP heads (on the policy's own
            samples): the policy's gradients are dropped before the optimizer step, so its weights
            and AdamW state stay as they were (fresh heads of a pretrained model get a head start
            before RL moves the policy). Needs MTP heads with ``mtp_loss_scaling_factor > 0``.
        mtp_warmup_update_samples: in a warm-up step, one update of the MTP parameters per this
            many samples (this rank's, in the order its chunks came; each update normalized by its
            own N_t), instead of one for the whole step: more updates per rollout sample. ``null``:
            one update a step. On a pretrained policy, the same samples in small updates drafted
            much better than in one update a step (``bench/bench_mtp_warmstart.py``; figures in
            bench/RESULTS.md).
        speed: compiled layers, activation checkpointing, fused head kernels (:class:`SpeedConfig`).
        memory: the memory planner's device memory and margin (:class:`MemoryConfig`).
    """

    model_config = ConfigDict(extra="forbid")

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    microbatch: MicrobatchConfig = Field(default_factory=MicrobatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    initial_loss_scale: float = Field(2.0**16, gt=0.0)
    loss_scale_growth_interval: int = Field(2000, ge=1)
    fsdp_reshard_after_forward: bool = True
    mtp_warmup_steps: int = Field(0, ge=0)
    mtp_warmup_update_samples: int | None = Field(None, ge=1)
    speed: SpeedConfig = Field(default_factory=SpeedConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
