"""Batch-1 projections without cuBLAS's split-K reduce kernel: a diagnosis benchmark (CUDA only).

    python scripts/bench_split_gemv.py [--model 4b-like] [--rows 1,2,4] [--layers 36] [--splits 2,4,8]
        [--replays 50]

cuBLAS runs the 4b-like o and down projections at one row as split-K GEMMs plus a reduce kernel
(docs/benchmarks.md). This times, per shape and row count, inside one CUDA graph over ``--layers`` distinct
weights (so nothing stays in L2): ``F.linear`` in bf16 (today's path, reduce included) against a strided-
batched GEMM over K slices that writes float32 partials (``torch.bmm(..., out_dtype=torch.float32)``), which
a fused residual add + RMSNorm would sum; also the partials' sum as its own kernel, for reference. The
packed qkv and gate/up projections, which cuBLAS runs without split-K, are timed the same way: whether
slices alone (more thread blocks over the weight) would be faster. Prints a
table and a JSON line: microseconds per projection and the fraction of the copy bandwidth (weights' bytes
over the time, against ``--copy-tbs``).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F



def shapes(model: str) -> dict[str, tuple[int, int]]:
    """(N out, K in) of a preset's projections (4b-like: o 2560 x 4096, down 2560 x 9728, and the packed
    qkv 6144 x 2560 and gate/up 19456 x 2560, which cuBLAS runs without split-K; their partials would have to
    be summed by the rope and SwiGLU kernels that follow them)."""
    from engram.model.presets import preset_config

    cfg = preset_config(model)
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"o": (h, q), "down": (h, cfg.intermediate_size), "qkv": (q + 2 * kv, h),
            "gate_up": (2 * cfg.intermediate_size, h)}


def timed_graph(fn, replays: int) -> float:
    """Mean ms per replay of a graph that runs ``fn`` once (after a warm-up outside the graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / replays


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="4b-like", help="the preset whose o and down shapes are timed")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--splits", default="2,4,8")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--copy-tbs", type=float, default=4.3, help="the copy bandwidth to compare with, TB/s")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for name, (n, k) in shapes(args.model).items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(args.layers)]
        wbytes = n * k * 2
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]

            def linear():
                for w, o in zip(ws, outs):
                    torch.matmul(x, w.t(), out=o)

            ref = F.linear(x, ws[0]).float()
            row = {"shape": name, "n": n, "k": k, "rows": m}
            row["linear_us"] = timed_graph(linear, args.replays) * 1e3 / args.layers
            for sp in map(int, args.splits.split(",")):
                if k % sp:
                    continue
                ks = k // sp
                xs = x.view(m, sp, ks).transpose(0, 1)  # [sp, m, ks]
                wts = [w.view(n, sp, ks).permute(1, 2, 0) for w in ws]  # [sp, ks, n], no copy
                parts = [torch.empty(sp, m, n, device="cuda", dtype=torch.float32) for _ in ws]
                try:
                    torch.bmm(xs, wts[0], out_dtype=torch.float32)
                except (TypeError, RuntimeError) as e:
                    row[f"split{sp}_error"] = str(e)[:200]
                    continue

                def split():
                    for wt, p in zip(wts, parts):
                        p.copy_(torch.bmm(xs, wt, out_dtype=torch.float32))

                def split_out():
                    for wt, p in zip(wts, parts):
                        torch.bmm(xs, wt, out_dtype=torch.float32, out=p)

                try:
                    row[f"split{sp}_us"] = timed_graph(split_out, args.replays) * 1e3 / args.layers
                except (TypeError, RuntimeError):
                    row[f"split{sp}_us_with_copy"] = timed_graph(split, args.replays) * 1e3 / args.layers
                sums = [torch.empty(m, n, device="cuda", dtype=torch.float32) for _ in ws]

                def summed():
                    for p, o in zip(parts, sums):
                        torch.sum(p, 0, out=o)

                row[f"split{sp}_sum_us"] = timed_graph(summed, args.replays) * 1e3 / args.layers
                err = (torch.bmm(xs, wts[0], out_dtype=torch.float32).sum(0) - ref).abs().max().item()
                row[f"split{sp}_max_abs_diff"] = err
            for key in [c for c in row if c.endswith("_us") or c.endswith("_with_copy")]:
                row[key.replace("_us", "_of_copy")] = wbytes / (row[key] * 1e-6) / (args.copy_tbs * 1e12)
            results.append(row)
            print(json.dumps(row))
    print(f"{'shape':6s} {'rows':>4s} {'linear us':>10s} " + " ".join(f"{'split' + s + ' us':>11s}"
                                                                    for s in args.splits.split(",")))
    for r in results:
        cells = " ".join(f"{r.get(f'split{s}_us', float('nan')):11.2f}" for s in args.splits.split(","))
        print(f"{r['shape']:6s} {r['rows']:4d} {r['linear_us']:10.2f} {cells}")
    print(json.dumps({"split_gemv": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
