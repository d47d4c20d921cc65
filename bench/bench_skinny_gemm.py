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

Rows above 64 run in tiles of 64 rows (the kernel takes up to ``skinny_gemm.MAX_ROWS``; the engine
uses it up to ``PREFERRED_ROWS``): a verify of 32 slots has 96.

``--gated``: the MLP's gate/up product with silu(gate) · up in its epilogue
(:func:`~splitrl.rollout.skinny_gemm.skinny_linear_silu_mul`) against cuBLAS's gate/up product and the
compiled ``silu_mul`` (the engine's two launches before), µs each at each M, and at the
``--gated-sweep`` rows its alternative tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).

``--attention R1,R2``: one layer's decode attention (:mod:`splitrl.rollout.decode_attention`) of R
rows with ``--attention-queries`` queries a row (1; 1 + drafts in a verify), with the kernel's tiles
and each alternative (BLOCK_N, stages, warps): µs averaged over the ``--context`` entries a row
(by default every 16th step of a 128 + 128 decode, so that rows of 3 and of 4 tiles of 64 entries
count as they do in the engine; a single length hides the last tile's cost), in caches of the
engine's layout and of ``--cache-len`` entries (the engine's for 128 + 128); 8 layers' caches used in
turn, as the products' weights are.

``--silu R1,R2``: silu(gate) · up of a cuBLAS gate/up product's [R, 2F] output, where the engine
forms it apart from the product (prefills: R = their tokens; decode steps above the gated kernel's
rows): the compiled ``fused.silu_mul`` on the product's two halves (what the engine ran before; the
baseline) against :func:`splitrl.rollout.silu_mul.silu_mul`, µs each, the bytes read and written
over the time, and whether the two outputs are equal bit for bit.

``--fused``: also the decode layer's fused pieces against the launches they replace, µs each at
each M (and at ``--rope-rows`` for the rotary one): o_proj and down_proj with their add + RMSNorm
(:func:`~splitrl.rollout.skinny_gemm.skinny_linear_add_rms_norm` vs ``skinny_linear`` and the
compiled ``add_rms_norm``), and q/k norm + rotary + cache write
(:func:`splitrl.rollout.rope_write.norm_rope_write` vs the compiled ``qkv_norm_rope`` and
``StaticKVCache.write_kv``).
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
from shapes import QWEN3_SHAPES, check_switches  # noqa: E402

check_switches()  # a bad SPLITRL_* value (SPLITRL_GATED_TILES=1,2): one line and exit 2, not a traceback

from splitrl.rollout import cuda_props, skinny_gemm  # noqa: E402


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


def sweep(configs: list[tuple], fn) -> None:
    """Time ``fn(i, cfg)`` for each tile set of ``configs`` and print the fastest (µs, tiles)."""
    best = None
    for cfg in configs:
        try:
            t = time_us(lambda i, cfg=cfg: fn(i, cfg), replays=5)
        except Exception as e:  # noqa: BLE001 - a tile set the compiler refuses
            print(f"    {cfg}: {type(e).__name__}", flush=True)
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is not None:
        print(f"    best of the sweep: {best[0]:.2f} us {best[1]}", flush=True)


def contexts(text: str) -> list[int]:
    """``--context``: "N" or "FIRST-LAST:STEP" (FIRST, FIRST + STEP, ... up to LAST)."""
    try:
        if "-" not in text:
            values = [int(text)]
        else:
            span, _, step = text.partition(":")
            first, last = (int(v) for v in span.split("-"))
            values = list(range(first, last + 1, int(step or 1)))
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"--context takes N or FIRST-LAST:STEP with 1 <= FIRST <= LAST and STEP >= 1; got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + " Needs a CUDA device and Triton; the module docstring explains each table."
    )
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(QWEN3_SHAPES))
    ap.add_argument("--rows", default="1,3,8,32,64", help="comma list of row counts M (each <= 256)")
    ap.add_argument("--gated", action="store_true", help="also time gate/up + silu · mul in one launch (docstring)")
    ap.add_argument("--gated-sweep", default="", help="comma list of rows at which --gated times alternative tiles")
    ap.add_argument("--attention", default="", help="comma list of rows at which decode attention tiles are timed")
    ap.add_argument("--context", default="137-256:16", help="entries a row for --attention: N, or FIRST-LAST[:STEP] "
                    "(STEP 1 if left out; default 137-256:16, every 16th step of a 128 + 128 decode)")  # fmt: skip
    ap.add_argument("--attention-queries", default="1,3", help="queries a row for --attention (1 + drafts a verify)")
    ap.add_argument("--cache-len", type=int, default=320, help="entries a row's cache holds, for --attention (default: "
                    "the engine's for 128 + 128 tokens, the multiple of 64 above prompt + new + 3)")  # fmt: skip
    ap.add_argument("--sweep", default="", help="comma list of row counts at which alternative tiles are timed too")
    ap.add_argument("--silu", default="", help="comma list of rows at which silu(gate) · up after a cuBLAS product is "
                    "timed, compiled vs our kernel (e.g. 256,32768: a decode step, a prefill of 256 x 128)")  # fmt: skip
    ap.add_argument("--fused", action="store_true", help="also time the fused pieces of a decode layer (docstring)")
    ap.add_argument("--rope-rows", default="1,32,256", help="rows at which the rotary + cache write piece is timed")
    args = ap.parse_args(argv)
    given = [f"--{k.replace('_', '-')}" for k in ("context", "attention_queries", "cache_len")
             if getattr(args, k) != ap.get_default(k)]  # fmt: skip
    if given and not args.attention:
        ap.error(f"{', '.join(given)}: read only with --attention ROWS (e.g. --attention 32,256), whose table they shape")
    if args.gated_sweep and not args.gated:
        ap.error("--gated-sweep is read only with --gated, whose table it extends")
    if args.rope_rows != ap.get_default("rope_rows") and not args.fused:
        ap.error("--rope-rows is read only with --fused, whose table it shapes")
    try:  # the attention's lists before any device work, so that a typo costs no run
        ctxs = contexts(args.context)
    except ValueError as e:
        ap.error(str(e))
    if args.cache_len < max(ctxs):
        default = " (the default)" if args.cache_len == ap.get_default("cache_len") else ""
        ap.error(f"--cache-len ({args.cache_len}{default}) must hold the longest --context ({max(ctxs)}); raise it")
    lists = {}
    for flag, text, most in (("--rows", args.rows, skinny_gemm.MAX_ROWS), ("--sweep", args.sweep, skinny_gemm.MAX_ROWS),
                             ("--gated-sweep", args.gated_sweep, skinny_gemm.MAX_ROWS),
                             ("--rope-rows", args.rope_rows, None), ("--attention", args.attention, None),
                             ("--silu", args.silu, None),
                             ("--attention-queries", args.attention_queries, None)):  # fmt: skip
        try:
            values = [int(v) for v in text.split(",")] if text else []
        except ValueError:
            values = [0]
        if any(v < 1 or (most and v > most) for v in values):
            ap.error(f"{flag} takes a comma list of positive integers{f' each <= {most}' if most else ''}; got {text!r}")
        if len(set(values)) != len(values):
            ap.error(f"{flag} lists a value twice ({text!r}); list each once")
        lists[flag] = values
    rows, queries, att_rows = lists["--rows"], lists["--attention-queries"], lists["--attention"]
    if not rows or not queries:
        ap.error("--rows and --attention-queries take at least one value")
    for flag in ("--sweep", "--gated-sweep"):  # swept only where a row count of the tables is
        if set(lists[flag]) - set(rows):
            ap.error(f"{flag} rows must be among --rows ({args.rows}); got {sorted(set(lists[flag]) - set(rows))}")
    print(
        "command: python bench/bench_skinny_gemm.py " + shlex.join(sys.argv[1:] if argv is None else argv), flush=True
    )
    missing = [what for what, ok in (("a CUDA device", torch.cuda.is_available()), ("Triton", skinny_gemm.AVAILABLE)) if not ok]
    if missing:
        raise SystemExit(f"bench_skinny_gemm needs a CUDA device and Triton; missing here: {' and '.join(missing)}")
    c = QWEN3_SHAPES[args.preset]
    H, F, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nq, nk = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"qkv": (nq + 2 * nk, H), "o": (H, nq), "gate_up": (2 * F, H), "down": (H, F)}
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
            if M in lists["--sweep"]:
                bm0 = skinny_gemm.plan(M, N, K)[0]
                configs = [
                    (bm, bn, bk, split, warps, stages)
                    for bm, bn, bk, split, warps, stages in itertools.product(
                        sorted({bm0, 64}), (16, 32), (128, 256), (1, 2, 4, 8), (4,), (3, 4, 5)
                    )
                    if not K % (split * bk) and (bm * bk + bn * bk) * 2 * stages <= 200 * 1024
                ]
                sweep(configs, lambda i, cfg, x=x: skinny_gemm.skinny_linear(x, ws[i], config=cfg))
    print("a layer's four products (us), cuBLAS / ours: "
          + ", ".join(f"M={M} {total['cublas'][M]:.1f} / {total['skinny'][M]:.1f}" for M in rows), flush=True)  # fmt: skip
    if args.gated:
        gated_product(c, rows, set(lists["--gated-sweep"]))
    if args.attention:
        attention_tiles(c, att_rows, ctxs, queries, args.cache_len)
    if args.silu:
        silu_table(c, lists["--silu"])
    if args.fused:
        fused_pieces(c, rows, lists["--rope-rows"])


def silu_table(c: dict, rows: list[int]) -> None:
    """The --silu table (module docstring)."""
    from splitrl.rollout import silu_mul
    from splitrl.rollout.fused import Kernels

    k = Kernels(True, torch.device("cuda"), torch.bfloat16)
    F = c["intermediate_size"]
    print(f"{'silu(gate) * up':<16} {'rows':>6} {'compiled us':>11} {'ours us':>8} {'ratio':>6} {'compiled TB/s':>13} "
          f"{'ours TB/s':>9}  equal", flush=True)  # fmt: skip
    for R in rows:
        xs = [torch.randn(R, 2 * F, device="cuda", dtype=torch.bfloat16) for _ in range(4)]  # 4 copies: past the L2
        t_c = time_us(lambda i: k.silu_mul(*xs[i].chunk(2, dim=-1)), copies=4)
        t_o = time_us(lambda i: silu_mul.silu_mul(xs[i]), copies=4)
        equal = torch.equal(k.silu_mul(*xs[0].chunk(2, dim=-1)), silu_mul.silu_mul(xs[0]))
        mb = R * F * 3 * 2 / 1e6  # gate and up read, the output written
        print(f"{'':<16} {R:>6} {t_c:11.2f} {t_o:8.2f} {t_c / t_o:6.2f} {mb / t_c:13.2f} {mb / t_o:9.2f}  {equal}", flush=True)


def gated_product(c: dict, rows: list[int], sweep_rows: set[int]) -> None:
    """The --gated table (module docstring)."""
    from splitrl.rollout.fused import Kernels

    k = Kernels(True, torch.device("cuda"), torch.bfloat16)
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, F = c["hidden_size"], c["intermediate_size"]
    ws = [torch.randn(2 * F, H, device=dev, dtype=dt) / H**0.5 for _ in range(8)]
    print(f"{'gate/up + silu*mul':<20} {'M':>4} {'cuBLAS+silu us':>14} {'fused us':>9} {'ratio':>6} "
          f"{'err torch':>9} {'err fused':>9}  plan (BM, BN, BK, warps, stages)", flush=True)  # fmt: skip
    for M in rows:
        x = torch.randn(M, H, device=dev, dtype=dt)
        plan = skinny_gemm.gated_tiles(x, M, F, H)  # the kernel's own
        g, u = (x.float() @ ws[0].float().T).chunk(2, dim=-1)
        ref = torch.nn.functional.silu(g) * u
        errs = []
        for y in (k.silu_mul(*torch.nn.functional.linear(x, ws[0]).chunk(2, dim=-1)),
                  skinny_gemm.skinny_linear_silu_mul(x, ws[0])):  # fmt: skip
            errs.append(((y.float() - ref).norm() / ref.norm()).item())
        t_t = time_us(lambda i, x=x: k.silu_mul(*torch.nn.functional.linear(x, ws[i]).chunk(2, dim=-1)))
        t_f = time_us(lambda i, x=x: skinny_gemm.skinny_linear_silu_mul(x, ws[i]))
        print(f"{'':<20} {M:>4} {t_t:14.2f} {t_f:9.2f} {t_t / t_f:6.2f} {errs[0]:9.2e} {errs[1]:9.2e}  "
              f"{plan}", flush=True)  # fmt: skip
        if M in sweep_rows:
            bm0 = skinny_gemm.gated_plan(M, F, H)[0]  # the old tiles' rows, against 64
            configs = [
                cfg
                for cfg in itertools.product(sorted({bm0, 64}), (16, 32), (64, 128, 256), (4, 8), (3, 4, 5, 6))
                if (cfg[0] * cfg[2] + 2 * cfg[1] * cfg[2]) * 2 * cfg[4] <= 200 * 1024  # the stages' tiles in shared memory
            ]
            sweep(configs, lambda i, cfg, x=x: skinny_gemm.skinny_linear_silu_mul(x, ws[i], config=cfg))


def attention_tiles(c: dict, rows: list[int], contexts: list[int], queries: list[int], M: int) -> None:
    """The --attention table (module docstring)."""
    from splitrl.rollout import decode_attention as da

    dev, dt = torch.device("cuda"), torch.bfloat16
    H, Hk, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    configs = [None] + [(64, 2, 4), (64, 3, 4), (64, 4, 4), (32, 3, 4), (32, 4, 4), (128, 2, 8), (128, 2, 4), (16, 4, 4)]
    mean_bytes = 2 * statistics.mean(contexts) * Hk * d * 2  # keys and values a row reads, bytes
    for R in rows:
        caches = [torch.randn(2, R, M, Hk, d, device=dev, dtype=dt) for _ in range(8)]
        for Q in queries:
            q = torch.randn(R, Q, H, d, device=dev, dtype=dt)
            cells = []
            for cfg in configs:
                try:
                    per = []
                    for n in contexts:
                        used = torch.full((R,), n, dtype=torch.int32, device=dev)
                        per.append(time_us(lambda i, cfg=cfg, used=used: da.decode_attention(
                            q, caches[i][0], caches[i][1], used, d**-0.5, config=cfg), replays=5 if cfg else 20))  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a tile set the compiler refuses (shared memory)
                    print(f"    {cfg}: {type(e).__name__}", flush=True)
                    continue
                cells.append((statistics.mean(per), cfg, per))
            if not cells or cells[0][1] is not None:
                print(f"attention rows {R:>4} Q={Q}: the kernel's own tiles failed (above); no table", flush=True)
                continue
            default, _, per0 = cells[0]
            rule = da.tiles(d, R * Hk, cuda_props.shared_memory_optin(dev))
            best = sorted(cells[1:], key=lambda cell: cell[0])[:5] or [cells[0]]
            gbs = R * mean_bytes / (default * 1e-6) / 1e9
            print(f"attention rows {R:>4} Q={Q} entries {contexts[0]}..{contexts[-1]} (mean of {len(contexts)}): "
                  f"default {rule} {default:.2f} us ({gbs:.0f} GB/s); best "
                  + ", ".join(f"{cfg} {t:.2f}" for t, cfg, _ in best), flush=True)  # fmt: skip
            print(f"    per context, default: {' '.join(f'{t:.1f}' for t in per0)}; best: "
                  f"{' '.join(f'{t:.1f}' for t in best[0][2])}", flush=True)  # fmt: skip


def fused_pieces(c: dict, rows: list[int], rope_rows: list[int]) -> None:
    """The --fused table (module docstring)."""
    from splitrl.rollout import rope_write
    from splitrl.rollout.fused import Kernels
    from splitrl.rollout.kv import StaticKVCache

    k = Kernels(True, torch.device("cuda"), torch.bfloat16)
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, F, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    hq, hk = c["num_attention_heads"], c["num_key_value_heads"]
    nq, nk = hq * d, hk * d
    nw = torch.ones(H, device=dev, dtype=dt)
    print(f"{'piece':<22} {'M':>4} {'torch path us':>13} {'fused us':>9} {'ratio':>6}", flush=True)
    for name, (N, K) in (("o_proj + add_norm", (H, nq)), ("down_proj + add_norm", (H, F))):
        ws = [torch.randn(N, K, device=dev, dtype=dt) / K**0.5 for _ in range(8)]
        for M in rows:
            if skinny_gemm.plan(M, N, K)[3] == 1:
                continue
            x = torch.randn(M, K, device=dev, dtype=dt)
            r = torch.randn(M, N, device=dev, dtype=dt)
            t_t = time_us(lambda i, x=x, r=r: k.add_rms_norm(skinny_gemm.skinny_linear(x, ws[i]), r, nw, 1e-6))
            t_f = time_us(lambda i, x=x, r=r: skinny_gemm.skinny_linear_add_rms_norm(x, ws[i], r, nw, 1e-6))
            print(f"{name:<22} {M:>4} {t_t:13.2f} {t_f:9.2f} {t_t / t_f:6.2f}", flush=True)
    qw = torch.ones(d, device=dev, dtype=dt)
    for M in rope_rows:
        cache = StaticKVCache(1, M, hk, 512, d, dt, dev, flash=True)
        qkv = torch.randn(M, 1, nq + 2 * nk, device=dev, dtype=dt)
        pos = torch.randint(0, 500, (M, 1), device=dev)
        table = torch.randn(512, 2, d, device=dev, dtype=dt)
        cos, sin = table[pos].unbind(2)
        plan = cache.plan(pos, pos, pos, 512, causal=True, kernels=k)

        def torch_rope(i):
            q, kv = k.qkv_norm_rope(qkv, nq, nk, d, qw, qw, 1e-6, cos, sin)
            cache.write_kv(0, plan, kv)
            return q

        t_t = time_us(torch_rope)
        t_f = time_us(
            lambda i: rope_write.norm_rope_write(
                qkv, nq, nk, d, qw, qw, 1e-6, cos, sin, cache.kv[:, 0], plan.flat_index
            )
        )
        print(f"{'qk norm+rope+kv write':<22} {M:>4} {t_t:13.2f} {t_f:9.2f} {t_t / t_f:6.2f}", flush=True)


if __name__ == "__main__":
    main()
