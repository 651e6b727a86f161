"""The decode step's projections at a few rows: the Triton GEMV over launch configurations against cuBLAS
(``F.linear``) and the copy bandwidth (CUDA only).

    python scripts/bench_gemv.py [--model 4b-like] [--rows 1,2,4] [--block-n 4,8,16] [--block-k 256,512,1024]
        [--warps 2,4,8] [--dtype bfloat16]

The shapes are one layer's projections of the preset (packed q/k/v, o, packed gate/up, down) and its LM
head. For each (shape, rows): cuBLAS, then every configuration of the kernel: the median time
(``triton.testing.do_bench``, L2 flushed between runs), the weight bytes read, GB/s, the ratio to the
device-to-device copy measured in the same run, and the largest difference from the float64 product
relative to the largest |output|. Prints a JSON line per point, then per (shape, rows) cuBLAS, the
engine's configuration (gemv_triton.DEFAULT) and the best one, and the step's sum over the model's layers.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F


def shapes(cfg) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, calls per decode step) of the preset's projections."""
    h, hd = cfg.hidden_size, cfg.head_dim
    layers = cfg.num_layers
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h, layers),
            "o": (h, cfg.num_heads * hd, layers),
            "gate_up": (2 * cfg.intermediate_size, h, layers),
            "down": (h, cfg.intermediate_size, layers),
            "lm_head": (cfg.padded_vocab_size, h, 1)}


def main() -> None:
    import triton

    from engram.bench.roofline import measure_ceilings
    from engram.model.layers import gemv_triton as gt
    from engram.model.presets import preset_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="4b-like")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--block-n", default="4,8,16")
    ap.add_argument("--block-k", default="256,512,1024")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    cfg = preset_config(args.model)
    copy_gbps = measure_ceilings(dev, dtype).memory_GBps
    configs = [gt.GemvConfig(n, k, w) for n, k, w in itertools.product(
        *(tuple(int(v) for v in s.split(",")) for s in (args.block_n, args.block_k, args.warps)))]
    if gt.DEFAULT not in configs:
        configs.append(gt.DEFAULT)
    rows_out, summary = [], []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k, calls) in shapes(cfg).items():
        w = (torch.randn(n, k, device=dev, generator=g) * k ** -0.5).to(dtype)
        nbytes = n * k * dtype.itemsize
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, generator=g).to(dtype)
            want = x.double() @ w.double().T
            scale = want.abs().max().item()

            def point(label, fn, conf=None):
                out = fn()
                ms = triton.testing.do_bench(fn, warmup=25, rep=200)
                row = {"shape": name, "N": n, "K": k, "rows": m, "kernel": label,
                       "config": None if conf is None else [conf.block_n, conf.block_k, conf.num_warps],
                       "us": ms * 1e3, "GBps": nbytes / ms / 1e6, "of_copy": nbytes / ms / 1e6 / copy_gbps,
                       "rel_err": (out.double() - want).abs().max().item() / scale, "calls": calls}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
                return row

            base = point("cublas", lambda: F.linear(x, w))
            tried = []
            for conf in configs:
                try:
                    tried.append(point("triton", lambda: gt.gemv(x, w, config=conf), conf))
                except Exception as e:  # a configuration Triton cannot compile (registers, shared memory)
                    print(json.dumps({"shape": name, "rows": m, "config": [conf.block_n, conf.block_k, conf.num_warps],
                                      "error": f"{type(e).__name__}: {e}"[:200]}), flush=True)
            default = next(r for r in tried if r["config"] == [gt.DEFAULT.block_n, gt.DEFAULT.block_k,
                                                               gt.DEFAULT.num_warps])
            best = min(tried, key=lambda r: r["us"])
            summary.append((name, m, calls, base, default, best))
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; {args.model}, {args.dtype}")
    print(f"{'shape':>8} {'rows':>4} {'cuBLAS us':>9} {'of copy':>7} {'default us':>10} {'of copy':>7} "
          f"{'best us':>8} {'of copy':>7} {'best config':>14} {'rel err':>8}")
    for name, m, _, base, default, best in summary:
        print(f"{name:>8} {m:>4} {base['us']:9.1f} {base['of_copy']:7.2f} {default['us']:10.1f} "
              f"{default['of_copy']:7.2f} {best['us']:8.1f} {best['of_copy']:7.2f} {str(best['config']):>14} "
              f"{best['rel_err']:8.1e}")
    for m in sorted({s[1] for s in summary}):
        per = [s for s in summary if s[1] == m]
        tot = {label: sum(s[2] * s[i]["us"] for s in per) for label, i in (("cublas", 3), ("default", 4), ("best", 5))}
        print(f"rows {m}: one decode step's projections: cuBLAS {tot['cublas']:.0f} us, Triton default "
              f"{tot['default']:.0f} us, best per shape {tot['best']:.0f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_GBps": copy_gbps, "model": args.model, "dtype": args.dtype, "points": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
