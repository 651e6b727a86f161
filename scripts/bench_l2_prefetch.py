"""Would prefetching a projection's weight into L2, while a latency-bound kernel runs, speed up a batch-1
decode step? An experiment for the H200 (CUDA only), before any engine change.

    python scripts/bench_l2_prefetch.py [--shapes o,qkv,down] [--busy-us 10] [--repeats 200]

At batch 1 each 4b-like layer's attention and norms (~10 µs) leave the memory bus mostly idle, and the
next GEMV (o: 21 MB, qkv: 31.5 MB; the H200's L2 holds 50 MB) then streams its weight from HBM at 62-66 %
of the copy bandwidth (docs/benchmarks.md). For each shape this times, as CUDA-graph replays of one
sequence (so launch gaps are those of a decode graph), with L2 flushed before each:

* ``cold``: a ``--busy-us`` spin (standing in for attention), then ``F.linear`` (cuBLAS) on one row;
* ``prefetched``: the same, with a prefetch of the weight into L2 on a second stream during the spin,
  joined before the GEMV; variants: the engine's ``prefetch.global.L2::evict_last`` per 128-B line
  (model/layers/l2_prefetch.py, ``ENGRAM_L2_PREFETCH``), or loads with ``evict_last`` whose sum is stored;
* ``gemv_alone`` / ``gemv_after_prefetch``: the GEMV's own time, cold and right after a prefetch.

Prints a JSON line per point and a table: µs per replay, and the saving per step over the model's layers.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def prefetch_kernels():
    """The engine's prefetch (``lines``: l2_prefetch.prefetch) and, to compare, loads with ``evict_last``
    whose sum is stored (``loads``: what a kernel without inline PTX could do)."""
    import triton
    import triton.language as tl

    from engram.model.layers import l2_prefetch

    @triton.jit
    def load_evict_last(W, n, SINK, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(W + offs, mask=offs < n, other=0, eviction_policy="evict_last")
        tl.store(SINK + tl.program_id(0), tl.sum(v.to(tl.int32), 0))

    def lines(w: torch.Tensor, sink: torch.Tensor) -> None:
        l2_prefetch.prefetch(w)

    def loads(w: torch.Tensor, sink: torch.Tensor) -> None:
        flat = w.view(torch.int32).reshape(-1)
        block = 4096
        load_evict_last[(triton.cdiv(flat.numel(), block),)](flat, flat.numel(), sink, BLOCK=block, num_warps=8)

    return {"lines": lines, "loads": loads}


def spin_cycles_per_us() -> float:
    """``torch.cuda._sleep`` cycles per µs on this GPU, timed once (a long spin, so launch costs vanish)."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def main() -> None:
    from engram.model.presets import preset_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="4b-like")
    ap.add_argument("--shapes", default="o,qkv,down")
    ap.add_argument("--busy-us", type=float, default=10.0, help="the latency-bound kernel's length (a spin)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg = preset_config(args.model)
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), "o": (h, cfg.num_heads * hd),
              "down": (h, cfg.intermediate_size)}
    spin = int(args.busy_us * spin_cycles_per_us())
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    sink = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    kinds = prefetch_kernels()
    side = torch.cuda.Stream()
    rows = []
    for name in args.shapes.split(","):
        n, k = shapes[name]
        w = (torch.randn(n, k, device=dev) * k ** -0.5).to(dtype)
        x = torch.randn(1, k, device=dev).to(dtype)
        out = torch.empty(1, n, device=dev, dtype=dtype)

        def body(prefetch, gemv_only: bool):
            if not gemv_only:
                torch.cuda._sleep(spin)
            if prefetch is not None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    prefetch(w, sink)
                torch.cuda.current_stream().wait_stream(side)
            torch.mm(x, w.T, out=out)

        def replay_us(prefetch, gemv_only: bool = False, time_gemv_only: bool = False) -> float:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                body(prefetch, gemv_only)  # warm-up outside the capture (Triton compiles, cuBLAS picks)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body(prefetch, gemv_only)
            times = []
            for _ in range(args.repeats):
                flush.zero_()  # L2 holds nothing of w
                if time_gemv_only and prefetch is not None:
                    prefetch(w, sink)  # outside the timed region
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                if time_gemv_only:
                    torch.mm(x, w.T, out=out)
                else:
                    g.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            return statistics.median(times)

        point = {"shape": name, "N": n, "K": k, "MB": n * k * 2 / 1e6, "busy_us": args.busy_us,
                 "cold": replay_us(None), "gemv_alone": replay_us(None, gemv_only=True)}
        for kind, fn in kinds.items():
            point[f"prefetched_{kind}"] = replay_us(fn)
            point[f"gemv_after_prefetch_{kind}"] = replay_us(fn, time_gemv_only=True)
        assert torch.allclose(out.float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-2)
        rows.append(point)
        print(json.dumps(point), flush=True)
    print(f"{'shape':>6} {'MB':>5} {'cold':>7} {'lines':>7} {'loads':>7} {'gemv':>6} {'after lines':>11} "
          f"{'after loads':>11} {'saving/step (lines)':>20}")
    for p in rows:
        saving = (p["cold"] - p["prefetched_lines"]) * cfg.num_layers
        print(f"{p['shape']:>6} {p['MB']:5.1f} {p['cold']:7.1f} {p['prefetched_lines']:7.1f} "
              f"{p['prefetched_loads']:7.1f} {p['gemv_alone']:6.1f} {p['gemv_after_prefetch_lines']:11.1f} "
              f"{p['gemv_after_prefetch_loads']:11.1f} {saving:17.0f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "points": rows}, f, indent=1)


if __name__ == "__main__":
    main()
