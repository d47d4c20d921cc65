"""Checkpoint cost of the train worker (issue 9): how long a save blocks training.

Builds the config's policy (fp32 master weights) and its optimizer on one device, gives the
optimizer its state (one AdamW update with zero gradients: the same tensors and bytes as after a
real step) and saves ``--saves`` checkpoints, one after the other, each waited for before the
next. Printed per save:

- ``blocked_s``: what :meth:`TrainWorker.save_checkpoint` takes, the time training stops (the
  copy of this rank's shards into CPU memory; the first save also allocates the kept, pinned
  staging buffers);
- ``written_s``: from the call until the background write of the files ends.

Baseline, measured in the same run: what a plain PyTorch loop does, ``torch.save`` of the model
and optimizer state dicts, which blocks for the whole write. Same disk (``--dir``).

    python bench/bench_checkpoint.py --config examples/qwen3_0p6b_gpu.yaml --device cuda
    python bench/bench_checkpoint.py                      # the CPU demo's model on CPU

Measured figures: bench/RESULTS.md (Checkpoints).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitrl.config import load_config
from splitrl.models import PolicyModel
from splitrl.train.worker import TrainWorker


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", default="examples/cpu_demo.yaml", help="run config whose model and train settings to use"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--saves", type=int, default=3, help="checkpoints saved one after the other (>= 2)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    args = ap.parse_args(argv)
    if args.saves < 2:
        ap.error("--saves must be >= 2: the first save also allocates the staging buffers")
    if args.dir:  # before the model is built: a bad path is a usage error, not a traceback after the setup
        taken = [n for n in [f"ck{i}" for i in range(args.saves)] + ["plain.pt"] if (Path(args.dir) / n).exists()]
        if taken:
            ap.error(
                f"--dir {args.dir} already holds {taken}: the bench would overwrite them; give an empty or new directory"
            )
        try:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--dir {args.dir}: cannot create the directory ({e.strerror}); give a writable directory path")
    print(f"command: python bench/bench_checkpoint.py {shlex.join(argv)}", flush=True)
    try:  # the task plays no part in a checkpoint; a built-in one needs no task package
        cfg = load_config(args.config, [f"cluster.device={args.device}", "task={kind: reverse_digits}"])
    except ValueError as e:  # a config error is one message, not a traceback
        ap.error(str(e))
    torch.manual_seed(0)
    model = PolicyModel.from_config(cfg.model)
    worker = TrainWorker(model, cfg.train.model_copy(update={"device": args.device}))
    for p in worker.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)
    state_bytes = sum(t.numel() * t.element_size() for t in worker.model.state_dict().values()) + sum(
        v.numel() * v.element_size()
        for st in worker.optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    root.mkdir(parents=True, exist_ok=True)
    saves = []
    try:
        for i in range(args.saves):
            with torch.no_grad():  # training between saves: each checkpoint has other values
                for p in worker.model.parameters():
                    p.add_(1e-3)
            _sync(args.device)
            t0 = time.perf_counter()
            blocked = worker.save_checkpoint(str(root / f"ck{i}"))
            worker.wait_checkpoint()
            written = time.perf_counter() - t0
            saves.append({"blocked_s": round(blocked, 3), "written_s": round(written, 3)})
            print(f"save {i + 1}: blocked {blocked:.3f} s, files written {written:.3f} s after the call", flush=True)
        _sync(args.device)
        t0 = time.perf_counter()
        torch.save({"model": worker.model.state_dict(), "optimizer": worker.optimizer.state_dict()}, root / "plain.pt")
        plain = time.perf_counter() - t0
        print(f"baseline torch.save of model + optimizer: blocked {plain:.3f} s", flush=True)
    finally:
        worker.checkpointer.close()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    steady = [s["blocked_s"] for s in saves[1:]]
    result = {
        "command": f"python bench/bench_checkpoint.py {shlex.join(argv)}",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "state_GB": round(state_bytes / 1e9, 2),
        "saves": saves,
        "first_blocked_s": saves[0]["blocked_s"],
        "later_blocked_s_max": max(steady),
        "torch_save_blocked_s": round(plain, 3),
        "torch_save_over_later_blocked": round(plain / max(steady), 1),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
