"""Decode attention (Triton split-KV) against its bandwidth limit, over launch configurations (CUDA only).

    python -m benchmarks.decode_attention [--batch-sizes 1,64,256] [--context 530] [--max-len 2064]
        [--block-n 32,64,128] [--programs 1024,4096,8192] [--warps 4,8] [--stages default,2,3]

One layer of the 4b-like shape by default (32 query heads, 8 KV heads, head dim 128, bf16, 16-token
blocks scattered at random). Every sequence holds ``--context`` keys; ``--max-len`` is what a CUDA graph
would size the launch for. For each configuration: the median time of the split + combine kernels
(``triton.testing.do_bench``, L2 flushed), the K/V bytes they must read, GB/s, the ratio to the
device-to-device copy measured in the same run, and the largest difference from the torch reference.
Prints a JSON line per point, then a table; the engine's configuration is marked with '*'.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random

import torch


def main() -> None:
    import triton

    from engram.bench.roofline import measure_ceilings
    from engram.model.kv_cache import KVCache
    from engram.model.layers import paged_attention as pa
    from engram.model.layers import paged_attention_triton as pat
    from engram.model.layers.attention import AttentionMetadata

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--context", type=int, default=530)
    ap.add_argument("--max-len", type=int, default=2064)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--programs", default="1024,4096,8192")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="default,2,3")
    args = ap.parse_args()
    dev, dtype, bs = torch.device("cuda"), torch.bfloat16, 16
    copy_gbps = measure_ceilings(dev, dtype).memory_GBps
    default = (pat.DECODE_BLOCK_N, pat.DECODE_PROGRAMS, 4, None)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        need = -(-args.context // bs)
        blocks = list(range(batch * need + 1))
        random.Random(batch).shuffle(blocks)
        kv = KVCache(len(blocks), bs, [0], args.kv_heads, args.head_dim, dtype, dev)
        kv.k[0].normal_()
        kv.v[0].normal_()
        tables = torch.tensor([blocks[i * need:(i + 1) * need] for i in range(batch)], device=dev)
        q = torch.randn(batch, args.heads, args.head_dim, device=dev).to(dtype)
        seqs = torch.arange(batch, device=dev)
        lens = torch.full((batch,), args.context, device=dev)
        scale = args.head_dim ** -0.5
        cu = torch.arange(batch + 1, device=dev)
        slots = tables[:, (args.context - 1) // bs] * bs + (args.context - 1) % bs
        meta = AttentionMetadata.from_step(cu, lens, tables, slots)
        kv32 = KVCache(len(blocks), bs, [0], args.kv_heads, args.head_dim, torch.float32, dev)
        kv32.k[0].copy_(kv.k[0])
        kv32.v[0].copy_(kv.v[0])
        want = pa.paged_attention_reference(q.float(), kv32, 0, meta, scale)
        del kv32
        kv_bytes = 2 * batch * args.context * args.kv_heads * args.head_dim * dtype.itemsize
        configs = itertools.product((int(x) for x in args.block_n.split(",")),
                                    (int(x) for x in args.programs.split(",")),
                                    (int(x) for x in args.warps.split(",")),
                                    (None if x == "default" else int(x) for x in args.stages.split(",")))
        for block_n, programs, warps, stages in (list(configs) + [default]):
            out = torch.empty_like(q)

            def call():
                pat.decode(q, kv.k[0], kv.v[0], tables, seqs, seqs, lens, args.max_len, out, scale, block_n=block_n,
                           target_programs=programs, num_warps=warps, num_stages=stages)

            try:
                call()
                ms = triton.testing.do_bench(call, warmup=25, rep=200)
            except Exception as e:  # a configuration Triton cannot compile (shared memory, registers)
                print(json.dumps({"batch": batch, "block_n": block_n, "programs": programs, "warps": warps,
                                  "stages": stages, "error": f"{type(e).__name__}: {e}"[:200]}), flush=True)
                continue
            row = {"batch": batch, "context": args.context, "max_len": args.max_len, "block_n": block_n,
                   "programs": programs, "warps": warps, "stages": stages, "us": ms * 1e3,
                   "kv_bytes": kv_bytes, "GBps": kv_bytes / ms / 1e6, "of_copy": kv_bytes / ms / 1e6 / copy_gbps,
                   "max_abs_err": (out.float() - want).abs().max().item(),
                   "engine_default": (block_n, programs, warps, stages) == default}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    print(f"{'batch':>5} {'block_n':>7} {'programs':>8} {'warps':>5} {'stages':>6} {'us':>9} {'GB/s':>7} "
          f"{'of copy':>7} {'max err':>8}")
    seen = set()
    for r in sorted(rows, key=lambda r: (r["batch"], r["us"])):
        key = (r["batch"], r["block_n"], r["programs"], r["warps"], r["stages"])
        if key in seen:
            continue
        seen.add(key)
        mark = "*" if r["engine_default"] else " "
        print(f"{r['batch']:>5} {r['block_n']:>7} {r['programs']:>8} {r['warps']:>5} {str(r['stages']):>6} "
              f"{r['us']:9.1f} {r['GBps']:7.0f} {r['of_copy']:7.2f} {r['max_abs_err']:8.1e}{mark}")


if __name__ == "__main__":
    main()
