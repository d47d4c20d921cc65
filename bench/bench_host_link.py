"""The host side of ``train.optim.offload: cpu``: host<->device copy bandwidth and the CPU AdamW step.

Prints, on one CUDA device:

- pinned host -> device and device -> host copy bandwidth (GB/s) of ``--gib`` GiB, one way at a time
  and both ways at once (two streams), the median of ``--repeats`` copies;
- the same from pageable (unpinned) host memory;
- torch's fused CPU AdamW (``torch.optim.AdamW(fused=True)``, what the offloaded step runs) over
  ``--adam-params`` fp32 parameters on ``torch.get_num_threads()`` threads: seconds, parameters/s
  and the host memory traffic it implies (7 fp32 tensors moved a parameter: p, g, m, v read,
  p, m, v written = 28 bytes), against the same step of the fused CUDA AdamW on the device;
- a host copy (``torch.Tensor.copy_``) between two pageable fp32 buffers, as the host memory
  bandwidth a user would compare the AdamW figure with.

The offloaded step's floor per parameter is its host AdamW (28 bytes of host traffic) plus the cast
and the two copies (4 bytes down, 2 up); the figures here bound it. Run from the repository root:

    python bench/bench_host_link.py --gib 4 --adam-params 1e9
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch


def _time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="bytes of each copy, GiB")
    ap.add_argument("--adam-params", type=float, default=1e9, help="fp32 parameters of the AdamW step")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print("command: python bench/bench_host_link.py " + shlex.join(sys.argv[1:] if argv is None else argv), flush=True)
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_link measures a CUDA device's host link: no CUDA device is visible")
    copies(int(args.gib * 2**30) // 4, args.repeats)
    adamw(int(args.adam_params), args.repeats)


def copies(n: int, repeats: int) -> None:
    """The copy bandwidths of the module docstring, n fp32 elements a copy."""
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    d = torch.randn(n, device=dev)
    d2 = torch.empty_like(d)
    t0 = time.perf_counter()
    pinned = torch.empty(n, pin_memory=True)
    pinned2 = torch.empty(n, pin_memory=True)
    pin_s = (time.perf_counter() - t0) / 2
    pageable = torch.empty(n)
    gb = 4 * n / 1e9
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    rows = {
        "pinned host -> device": lambda: d2.copy_(pinned, non_blocking=True),
        "device -> pinned host": lambda: pinned.copy_(d, non_blocking=True),
        "pageable host -> device": lambda: d2.copy_(pageable),
        "device -> pageable host": lambda: pageable.copy_(d),
    }

    def both_ways():
        with torch.cuda.stream(s1):
            d2.copy_(pinned, non_blocking=True)
        with torch.cuda.stream(s2):
            pinned2.copy_(d, non_blocking=True)

    print(f"pinning {gb:.1f} GB of host memory: {pin_s:.2f} s ({gb / pin_s:.1f} GB/s)")
    for name, fn in rows.items():
        t = _time(fn, repeats, sync)
        print(f"{name:<28} {gb / t:6.1f} GB/s")
    t = _time(both_ways, repeats, sync)
    print(f"{'pinned, both ways at once':<28} {gb / t:6.1f} GB/s each way")
    host = torch.empty(n)
    t = _time(lambda: host.copy_(pageable), repeats, lambda: None)
    threads = torch.get_num_threads()
    print(f"{'host copy (read + write)':<28} {2 * gb / t:6.1f} GB/s on {threads} thread{'s' * (threads != 1)}")


def adamw(m: int, repeats: int) -> None:
    """The fused AdamW step over m fp32 parameters on the CPU and on the device."""
    sync = torch.cuda.synchronize
    for where in ("cpu", "cuda"):
        p = torch.nn.Parameter(torch.randn(m, device=where))
        p.grad = torch.randn(m, device=where)
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        t = _time(opt.step, max(2, repeats // 2), sync)
        print(
            f"fused AdamW on {where:<4}: {t:.3f} s for {m / 1e9:.2f} B parameters = {m / t / 1e9:.2f} B/s "
            f"({28 * m / t / 1e9:.0f} GB/s of traffic)",
            flush=True,
        )


if __name__ == "__main__":
    main()
