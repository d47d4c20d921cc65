"""Start-up of a train worker: its device and its memory plan (:mod:`splitrl.train.memory_plan`)
from the model, the train config and what the device and the host have free."""

from __future__ import annotations

import torch

from splitrl.distributed import utils as du
from splitrl.models.policy import PolicyModel
from splitrl.train.config import TrainConfig
from splitrl.train.memory_plan import (
    GiB,
    MemoryPlan,
    ModelShape,
    cuda_free_memory,
    host_available_memory,
    plan_memory,
)
from splitrl.train.offload import bucket_indices


def worker_device(device: str) -> torch.device:
    """``train.device``: ``auto`` is the current CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def plan_worker_memory(model: PolicyModel, cfg: TrainConfig, dev: torch.device, distributed: bool) -> MemoryPlan:
    """The memory plan of a train worker on ``dev`` (before the model moves to the device)."""
    offload = cfg.optim.offload == "cpu"
    # memory the model already occupies where the plan counts it (it is part of the estimate)
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == dev.type)
    if cfg.memory.device_memory_gib is not None:
        available, source = int(cfg.memory.device_memory_gib * GiB), "train.memory.device_memory_gib"
    elif dev.type == "cuda":
        free, source = cuda_free_memory(dev.index if dev.index is not None else torch.cuda.current_device())
        available = free + held
    else:
        free, source = host_available_memory()
        available = None if free is None else free + held
    host = None
    if offload and dev.type == "cuda":  # the masters already in host memory count as available to them
        free_host = host_available_memory()[0]
        on_cpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
        host = None if free_host is None else free_host + on_cpu
    bucket = 0
    if offload:  # the largest bucket HostOffload will stage (fp32 bytes)
        numels = [p.numel() for p in model.parameters() if p.requires_grad]
        groups = bucket_indices(numels, max(1, int(cfg.optim.offload_bucket_mb * 2**20) // 4))
        bucket = 4 * max((sum(numels[i] for i in g) for g in groups), default=0)
    packed_dense = (
        cfg.microbatch.pack_sequences
        and not model.capabilities.owns_sequence_packing
        and (dev.type != "cuda" or cfg.speed.packed_attention == "dense")
    )
    return plan_memory(
        ModelShape.from_hf_config(model.config, model.mtp_config),
        precision=cfg.precision,
        available_bytes=available,
        available_source=source,
        device=str(dev),
        margin=cfg.memory.margin,
        offload=cfg.optim.offload,
        compute_weight_copy=cfg.speed.compute_weight_copy,
        world_size=du.world_size(),
        compiled=cfg.speed.compile_layers and dev.type == "cuda" and not distributed,
        fused_head=cfg.speed.fused_head_kernels and dev.type == "cuda",
        dense_mask=packed_dense,
        checkpointing=cfg.speed.activation_checkpointing,
        max_tokens=cfg.microbatch.max_tokens_per_microbatch,
        micro_batch_size=cfg.microbatch.micro_batch_size,
        max_auto_tokens=cfg.memory.max_auto_tokens,
        min_tokens_without_checkpointing=cfg.memory.min_tokens_without_checkpointing,
        offload_bucket_bytes=bucket,
        host_available_bytes=host,
    )
