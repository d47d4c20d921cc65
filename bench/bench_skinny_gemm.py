"""The decode step's linear layers at few rows: our skinny-product kernel against cuBLAS, per shape.

For each projection of a Qwen3 preset's decoder layer (q/k/v fused, o, gate/up fused, down) and
each row count M, on one CUDA device in bf16: microseconds a product of
``torch.nn.functional.linear`` (cuBLAS, what the engine ran before; the baseline) and of
:func:`splitrl.rollout.skinny_gemm.skinny_linear` with :func:`~splitrl.rollout.skinny_gemm.plan`'s
tiles and with each alternative tile set of ``--sweep``, the weight bandwidth each reaches (weight
bytes / time; the floor is the weight bytes over the copy bandwidth, about 4.3 TB/s here) and the
error of both against an fp32 product of the same bf16 inputs (‖y − ref‖ / ‖ref‖).

Timing: 8 weight copies used in turn (more bytes than the 50 MB L2), 32 products captured in one
CUDA graph (as the engine replays its steps), the median of 20 replays / 32.

    python bench/bench_skinny_gemm.py --preset qwen3-0.6b --rows 1,3,8,32,64 --sweep 1,32
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import QWEN3_SHAPES  # noqa: E402
from splitrl.rollout import skinny_gemm  # noqa: E402


def time_us(fn, copies: int = 8, per_graph: int = 32, replays: int = 20) -> float:
    """Microseconds of one ``fn(i)`` (i = weight copy), from CUDA-graph replays of per_graph calls."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(per_graph):
            fn(j % copies)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_graph)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(QWEN3_SHAPES))
    ap.add_argument("--rows", default="1,3,8,32,64", help="comma list of row counts M (each <= 64)")
    ap.add_argument("--sweep", default="", help="comma list of row counts at which alternative tiles are timed too")
    args = ap.parse_args(argv)
    print(
        "command: python bench/bench_skinny_gemm.py " + shlex.join(sys.argv[1:] if argv is None else argv), flush=True
    )
    if not torch.cuda.is_available() or not skinny_gemm.AVAILABLE:
        raise SystemExit("bench_skinny_gemm needs a CUDA device and Triton")
    c = QWEN3_SHAPES[args.preset]
    H, F, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nq, nk = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"qkv": (nq + 2 * nk, H), "o": (H, nq), "gate_up": (2 * F, H), "down": (H, F)}
    rows = [int(r) for r in args.rows.split(",")]
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    total = {"cublas": {}, "skinny": {}}
    print(f"{'proj':<8} {'N x K':>12} {'M':>3} {'cuBLAS us':>10} {'ours us':>8} {'ratio':>6} {'ours TB/s':>9} "
          f"{'err cuBLAS':>10} {'err ours':>9}  plan (BM, BN, BK, split, warps)", flush=True)  # fmt: skip
    for name, (N, K) in shapes.items():
        ws = [torch.randn(N, K, device=dev, dtype=dt) / K**0.5 for _ in range(8)]
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=dt)
            ref = x.float() @ ws[0].float().T
            err = {}
            for kind, fn in (("cublas", torch.nn.functional.linear), ("skinny", skinny_gemm.skinny_linear)):
                y = fn(x, ws[0])
                err[kind] = ((y.float() - ref).norm() / ref.norm()).item()
            t_c = time_us(lambda i: torch.nn.functional.linear(x, ws[i]))
            t_s = time_us(lambda i: skinny_gemm.skinny_linear(x, ws[i]))
            total["cublas"][M] = total["cublas"].get(M, 0.0) + t_c
            total["skinny"][M] = total["skinny"].get(M, 0.0) + t_s
            tbs = N * K * 2 / (t_s * 1e-6) / 1e12
            print(f"{name:<8} {f'{N}x{K}':>12} {M:>3} {t_c:10.2f} {t_s:8.2f} {t_c / t_s:6.2f} {tbs:9.2f} "
                  f"{err['cublas']:10.2e} {err['skinny']:9.2e}  {skinny_gemm.plan(M, N, K)}", flush=True)  # fmt: skip
            if str(M) in args.sweep.split(","):
                best = None
                bm = skinny_gemm.plan(M, N, K)[0]
                for bn, bk, split, warps in itertools.product((16, 32), (128, 256), (1, 2, 4, 8), (4,)):
                    if K % (split * bk) or bm * bk + bn * bk > 64 * 512:
                        continue
                    cfg = (bm, bn, bk, split, warps)
                    try:
                        t = time_us(lambda i, cfg=cfg: skinny_gemm.skinny_linear(x, ws[i], config=cfg), replays=5)
                    except Exception as e:  # noqa: BLE001 - a tile set the compiler refuses
                        print(f"    {cfg}: {type(e).__name__}", flush=True)
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                print(f"    best of the sweep: {best[0]:.2f} us {best[1]}", flush=True)
    print("a layer's four products (us), cuBLAS / ours: "
          + ", ".join(f"M={M} {total['cublas'][M]:.1f} / {total['skinny'][M]:.1f}" for M in rows), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
