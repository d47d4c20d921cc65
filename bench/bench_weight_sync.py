"""Weight sync time (issue 9): the colocated on-device hand-over
(:func:`~splitrl.distributed.weight_sync.stage_weights`, the trainer's side, then
:func:`~splitrl.distributed.weight_sync.apply_staged`, the engine's pause between two calls),
trainer (fp32 master weights) → rollout engine (``--engine-dtype``), on one device, and the same through a torch.distributed group in
flat buckets when ``--group`` is given (2 processes: a sender and a receiver on the same device;
gloo on CPU only — NCCL refuses two ranks on one GPU, so the 2-GPU NCCL figure comes from
``splitrl train ... placement=split`` on a 2-GPU machine).

Seconds are wall time of one full sync (device synchronized), best and median of ``--repeats``
after a warm-up; every sync is checked exact against the trainer's weights cast to the engine's
dtype (MTP tensors included).

    python bench/bench_weight_sync.py                                    # tiny model, CPU
    python bench/bench_weight_sync.py --device cpu --group               # + the gloo group path
    python bench/bench_weight_sync.py --device cuda --config examples/qwen3_0p6b_gpu.yaml

End to end, the figure a run logs (``timing/weight_sync_s``; one H200, colocated)::

    splitrl train --config examples/qwen3_0p6b_gpu.yaml backend=ray placement=colocated \\
        dataplane.kind=transferqueue num_steps=3 checkpoint_every=0 "task={kind: reverse_digits}" \\
        output_dir=runs/sync_colocated
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from splitrl.distributed.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    WeightLayout,
    WeightSyncGroup,
    apply_staged,
    listen_socket,
    receive_weights,
    send_weights,
    stage_weights,
)
from splitrl.models import ModelConfig, MTPConfig, PolicyModel

TINY = ModelConfig(
    family="qwen3",
    backbone=dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),
    mtp=MTPConfig(mtp_num_layers=2),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _models(model_cfg: ModelConfig, device: str, engine_dtype: torch.dtype):
    from splitrl.rollout import GenerationConfig, RolloutEngine

    trainer = PolicyModel.from_config(model_cfg).to(device)
    with torch.no_grad():  # weights unlike the engine's, so a missed tensor shows in the check
        for p in trainer.parameters():
            p.add_(0.01)
    engine = RolloutEngine(
        PolicyModel.from_config(model_cfg).to(engine_dtype), GenerationConfig(max_new_tokens=4), device=device
    )
    return trainer, engine


def _check(trainer: torch.nn.Module, got: dict[str, torch.Tensor]) -> None:
    for k, v in trainer.state_dict().items():
        if not torch.equal(got[k], v.to(got[k].dtype)):
            raise AssertionError(f"weight sync differs at {k}")


def _times(fn, device: str, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _group_rank(rank, model_cfg, engine_dtype, bucket, repeats, q, out_q):
    torch.set_num_threads(1)
    trainer, engine = _models(model_cfg, "cpu", engine_dtype)
    layout = WeightLayout.of(engine.weight_tensors())
    if rank == 0:
        sock, port = listen_socket("127.0.0.1")
        q.put(port)
        group = WeightSyncGroup("127.0.0.1", port, 0, 2, "cpu", listen_sock=sock)
        out_q.put(_times(lambda: send_weights(group, layout, trainer, bucket), "cpu", repeats))
    else:
        group = WeightSyncGroup("127.0.0.1", q.get(), 1, 2, "cpu")
        own = engine.weight_tensors()
        staging = torch.empty(layout.staging_nbytes(bucket), dtype=torch.uint8)
        for _ in range(repeats + 1):
            receive_weights(group, layout, staging, bucket)
            apply_staged(layout, staging, own, bucket)
        _check(trainer, engine.model.state_dict())
    group.close()


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py
    from shapes import check_switches

    # a bad SPLITRL_* value: one line and exit 2, not a traceback from the engine's import in _models
    # (here, not at import: the group's spawned processes import this module again)
    check_switches()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="a run config whose model to use (default: a tiny model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--engine-dtype", choices=DTYPES, default=None, help="default: the config's cluster.rollout_dtype (tiny: fp32)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_BYTES // 2**20)
    ap.add_argument("--group", action="store_true", help="also time the bucketed group path (gloo, CPU only)")
    args = ap.parse_args(argv)
    model_cfg, dtype = TINY, "fp32"
    if args.config:
        from splitrl.config import load_config

        try:
            cfg = load_config(args.config)
        except ValueError as e:  # a config error is one message, not a traceback
            ap.error(str(e))
        model_cfg, dtype = cfg.model, cfg.cluster.rollout_dtype
    engine_dtype = DTYPES[args.engine_dtype or dtype]
    trainer, engine = _models(model_cfg, args.device, engine_dtype)
    own = engine.weight_tensors()
    layout = WeightLayout.of(own)
    bucket = args.bucket_mb * 2**20
    staging = torch.empty(layout.staging_nbytes(bucket), dtype=torch.uint8, device=args.device)
    stage = _times(lambda: stage_weights(layout, trainer, staging, bucket), args.device, args.repeats)
    apply = _times(lambda: apply_staged(layout, staging, own, bucket), args.device, args.repeats)
    _check(trainer, engine.model.state_dict())
    result = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "params": sum(p.numel() for p in trainer.parameters()),
        "engine_bytes": layout.nbytes,
        "colocated_stage_s": {"best": min(stage), "median": statistics.median(stage)},
        "colocated_apply_s (generation pauses)": {"best": min(apply), "median": statistics.median(apply)},
    }
    if args.group:
        if args.device != "cpu":
            raise SystemExit("--group runs on CPU (gloo): NCCL refuses two ranks on one GPU")
        del trainer, engine, own, staging
        ctx = mp.get_context("spawn")
        q, out_q = ctx.Queue(), ctx.Queue()
        mp.spawn(_group_rank, args=(model_cfg, engine_dtype, args.bucket_mb * 2**20, args.repeats, q, out_q), nprocs=2)
        t = out_q.get()
        result["group_gloo_s"] = {"best": min(t), "median": statistics.median(t)}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
