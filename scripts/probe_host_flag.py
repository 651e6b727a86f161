"""Can a replayed CUDA graph wait on the device for a flag the host writes, and how fast does it see it? (CUDA)

    python scripts/probe_host_flag.py [--trials 200] [--delay-us 300] [--kernels 150]

A design question of the disk tier's decode graphs (docs/benchmarks.md, the hot-row cache in the graph):
today the host launches the piece of an Engram layer only after that layer's lookup wrote the slab, so
every step pays the launch after the lookup. The alternative is to launch the piece first and let its first
kernel spin on a pinned host flag (read over UVA) that the host sets once the slab is written. This probe
measures both, on graphs of ``--kernels`` small kernels after the wait, ``--trials`` times each:

* flag: the graph is replayed first and spins; after ``--delay-us`` (the lookup) the host writes the flag;
  the time from that write to the graph's completion event, read on the host;
* launch: after the same delay the host replays a graph of the same kernels without the wait; the time from
  the replay call to the completion event.

It also checks that a flag value from a later trial is never taken for an earlier one (each replay waits
for its own trial number, written to a device input before the replay) and counts waits that timed out.
Prints a table and a JSON line (median and p90 microseconds of each, timeouts).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    import torch
    import triton
    import triton.language as tl

    from engram.store.kernels.triton_gather import HostPointer

    @triton.jit
    def wait_flag(FLAG, EXPECT, SPINS, MAX_SPINS: tl.constexpr):
        want = tl.load(EXPECT)
        seen = tl.load(FLAG, volatile=True)
        i = 0
        while (seen < want) & (i < MAX_SPINS):
            seen = tl.load(FLAG, volatile=True)
            i += 1
        tl.store(SPINS, i)

    @triton.jit
    def bump(X):
        tl.store(X, tl.load(X) + 1)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--delay-us", type=float, default=300.0)
    ap.add_argument("--kernels", type=int, default=150, help="small kernels after the wait (a piece's launches)")
    ap.add_argument("--max-spins", type=int, default=20_000_000, help="a wait gives up after this many reads")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    flag_np = flag.numpy()
    expect = torch.zeros(1, dtype=torch.int64, device=dev)
    spins = torch.zeros(1, dtype=torch.int64, device=dev)
    x = torch.zeros(1, dtype=torch.int64, device=dev)

    def body(with_wait: bool) -> None:
        if with_wait:
            wait_flag[(1,)](HostPointer(flag), expect, spins, MAX_SPINS=args.max_spins)
        for _ in range(args.kernels):
            bump[(1,)](x)

    graphs = {}
    for with_wait in (True, False):
        flag_np[0] = 1 << 62  # the warm-up and the capture run need not wait
        expect.fill_(0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body(with_wait)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body(with_wait)
        graphs[with_wait] = g
    torch.cuda.synchronize()
    flag_np[0] = 0
    done = torch.cuda.Event()

    def pause(us: float) -> None:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:  # spin: a sleep would wake up late by more than the delay
            continue

    flag_us, launch_us, timeouts, early = [], [], 0, 0
    for k in range(1, args.trials + 1):
        expect.fill_(k)  # this replay waits for trial k's flag
        graphs[True].replay()
        done.record()
        pause(args.delay_us)  # the lookup
        if done.query():
            early += 1  # went past the wait before the flag was written
        t0 = time.perf_counter()
        flag_np[0] = k
        done.synchronize()
        flag_us.append((time.perf_counter() - t0) * 1e6)
        timeouts += int(spins.item() >= args.max_spins)
        pause(args.delay_us)
        t0 = time.perf_counter()
        graphs[False].replay()
        done.record()
        done.synchronize()
        launch_us.append((time.perf_counter() - t0) * 1e6)

    def stats(v):
        q = statistics.quantiles(v, n=10)
        return {"median_us": statistics.median(v), "p90_us": q[-1]}

    out = {"kernels": args.kernels, "trials": args.trials, "delay_us": args.delay_us,
           "flag": stats(flag_us), "launch": stats(launch_us), "timeouts": timeouts, "early": early,
           "device": torch.cuda.get_device_name()}
    print(f"{'path':8s} {'median us':>10s} {'p90 us':>10s}   (graph of {args.kernels} kernels, {args.trials} trials)")
    for name in ("flag", "launch"):
        print(f"{name:8s} {out[name]['median_us']:10.1f} {out[name]['p90_us']:10.1f}")
    print(f"timeouts {timeouts}, replays past their wait before the flag was written {early}")
    print(json.dumps(out))
    return 0 if timeouts == 0 and early == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
