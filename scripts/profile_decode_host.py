"""Where the host time of a decode step goes, per tier: wall time per step, and ``cProfile`` of the engine's
thread plus a profiler summary of the CPU ops of every thread (the disk tier reads on its own threads).

    python scripts/profile_decode_host.py [--model 4b-like] [--tier disk] [--batch 1] [--context 512]
        [--engram-config JSON] [--cache-dir DIR] [--steps 50] [--enforce-eager] [--async-scheduling | --no-...]
        [--top 30] [--warm-cache] [--gpu-gaps] [--max-num-seqs N] [--callees REGEX]
        [--switch-ab JSON ... [--repeats 10] [--out FILE]]

Builds the engine, decodes ``--batch`` sequences of ``--context`` prompt tokens until every one decodes,
times ``--steps`` decode steps (wall ms per step, mean and median, and the tables' disk reads per step and
cache hit rate over them); on the disk tier the same number again with host timestamps around the reads (where
each step's period goes: the tail from the step before's last read to the row ids, the plan, each table's
reads and the hand-offs between them: engram/bench/read_cycle.py), then the same number with the step's
phases timed (launch, collect, the lookups' staging, the graph replay or eager forward), then again under
``cProfile`` (the calling thread: the engine, the Worker, the graph replay and every wait) and prints the
``--top`` functions by cumulative time (and, with ``--callees``, what the functions whose name matches the
regular expression spent in each function they called, builtins included: where a call blocks), then once
more under torch.profiler (CPU activity, every thread), printing the ops by self CPU time. ``--gpu-gaps``
profiles the same number of steps with CUDA activity too and prints where the GPU sat idle: its busy time
per step against the wall time, and the idle gaps summed by the kernels around them (which kernel the GPU
waited to start); then each kernel's share of the busy time (the part of its interval that extends the union
of those before it, so PDL overlap is not counted twice).
``--warm-cache`` first decodes the same prompts once (greedy: the same tokens, so the same Engram rows), so
that a hot-row cache hits on every row as in ``engram bench placement``'s rounds. A diagnosis tool: the numbers
under a profiler are not benchmark numbers.

``--switch-ab '{"together_when_deep": false}'`` replaces the passes after the timed steps by an interleaved A/B in
this one engine (engram/bench/read_cycle.py ``switch_ab``): A as built, B with those per-step kernel switches, an
A/A control, ``--repeats`` recorded samples of ``--steps`` steps per arm; it prints the verdict, the B/A and
A'/A intervals and each arm's read cycle, and writes them to ``--out`` (JSON) when given. Given more than
once, one A/B per switch set, one after the other in the same engine.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import time


ENGINE_PHASES = ("step", "launch", "  lookup._host_ids (waits for the sampled tokens)",
                 "  graphs.begin (inputs, the pieces before the first Engram layer)", "  lookup.submit",
                 "    the row ids' wait (waits for the sampled tokens)", "  graphs.run",
                 "    graph replays (host side of the launches)", "  runner.run", "collect")
# a table's lookup and its parts, timed on whichever thread runs them (the first Engram layer's on the
# engine's thread, inside lookup.submit, or over the disk tier inside graphs.run / runner.run when the model
# reaches its layer; the later layers' on their tables' threads)
TABLE_PHASES = ("lookup", "  one-read lookup", "    plan, read, check (into the slab)", "      reads",
                "    decode from the slab", "  dedupe", "  hot-row cache (tags, hits, the misses' reads)",
                "  page fetch", "  rows to the device", "  decode",
                "finish (dtype, shape)", "projection (run-ahead)")


def timed_phases(engine, steps: int) -> dict[str, tuple[float, float]]:
    """Mean wall ms per step of the step and its phases, timed by wrapping them, as (on the engine's thread,
    on other threads): the whole step, the executor's launch and collect, inside launch the lookups' staging
    (``LookupExecutor.submit``) and the decode graph's replay (``DecodeGraphs.run``, which copies each
    piece's rows in and, piecewise, waits for later layers' reads) or the eager forward
    (``ModelRunner.run``); with async scheduling over host-read tables the wait for the sampled tokens
    (``LookupExecutor._host_ids``; ``HostIds.wait`` inside it, or inside ``lookup.submit`` when the decode
    graph queued its first pieces first: ``DecodeGraphs.begin``). Then, summed over the tables, a lookup
    (``table.gather`` on the engine's thread, ``table._lookup`` on a table's) and its parts: the disk tier's
    one-read lookup (its reads and its decode from the slab), or dedupe, page fetch (and its reads), the
    packed rows' copy to the device, the decode (``kernels.gather_rows``); the executor's finish and the
    run-ahead projection; inside the graph replay the host side of the graph launches."""
    import threading

    import torch

    import engram.engine.lookup as lookup_mod
    import engram.store.base as base
    from engram.bench.call_patches import CallPatches
    from engram.store import kernels

    worker = engine.executor.worker
    spent: dict[tuple[str, bool], float] = {}
    mutex = threading.Lock()  # the tables' threads add to ``spent`` too
    patches = CallPatches()
    engine_thread = threading.get_ident()

    def wrap(obj, name, label: str) -> None:  # obj: an object, a module, or a dict (name: its key)
        def make(real):
            def timed(*a, **k):
                t = time.perf_counter()
                try:
                    return real(*a, **k)
                finally:
                    key = (label, threading.get_ident() == engine_thread)
                    with mutex:
                        spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
            return timed

        patches.wrap(obj, name, make)

    wrap(engine, "step", "step")
    wrap(engine.executor, "launch", "launch")
    wrap(engine.executor, "collect", "collect")
    wrap(worker.lookup, "submit", "  lookup.submit")
    if worker.graphs is not None:
        wrap(worker.graphs, "run", "  graphs.run")
        wrap(worker.graphs, "begin", "  graphs.begin (inputs, the pieces before the first Engram layer)")
        wrap(torch.cuda.CUDAGraph, "replay", "    graph replays (host side of the launches)")
    wrap(worker.runner, "run", "  runner.run")
    wrap(worker.lookup, "_host_ids", "  lookup._host_ids (waits for the sampled tokens)")
    wrap(lookup_mod.HostIds, "wait", "    the row ids' wait (waits for the sampled tokens)")
    wrap(worker.lookup, "_finish", "finish (dtype, shape)")
    for lid in list(worker.lookup.projectors or {}):
        wrap(worker.lookup.projectors, lid, "projection (run-ahead)")
    wrap(base, "to_device", "  rows to the device")
    wrap(kernels, "gather_rows", "  decode")
    for table in (worker.tables or {}).values():
        wrap(table, "gather", "lookup")
        if hasattr(table, "_lookup"):  # the disk tier: submitted lookups (the later layers') on its thread
            wrap(table, "_lookup", "lookup")
        if hasattr(table, "_gather_direct"):  # the disk tier's one-read lookups (page_slabs.py)
            wrap(table, "_gather_direct", "  one-read lookup")
            wrap(table, "_read_into", "    plan, read, check (into the slab)")
            wrap(table, "_decode_slab", "    decode from the slab")
            wrap(table, "read_slab", "lookup")  # into a decode graph's slab (DISK_DECODE_IN_GRAPH)
        wrap(table, "_dedupe", "  dedupe")
        if getattr(table, "cache", None) is not None:
            wrap(table.cache, "fetch", "  hot-row cache (tags, hits, the misses' reads)")
            wrap(table.cache, "slots_np", "  hot-row cache (tags, hits, the misses' reads)")  # decode graphs
        if hasattr(table, "_fetch"):
            wrap(table, "_fetch", "  page fetch")
        if hasattr(table, "reader"):
            wrap(table.reader, "read", "      reads")
    with patches:
        for _ in range(steps):
            engine.step()
    out = {}
    for k in ENGINE_PHASES + TABLE_PHASES:
        on, off = spent.get((k, True), 0.0), spent.get((k, False), 0.0)
        if on or off:
            out[k] = (on / steps * 1e3, off / steps * 1e3)
    return out


def gpu_gaps(engine, steps: int, top: int) -> None:
    """Profile ``steps`` engine steps with CUDA activity and print the GPU's busy time per step and its idle
    gaps (over 2 us) summed by (the kernel before, the kernel after), largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engram.bench.device_time import busy_intervals_ns, cuda_kernels, union_length

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = prof.profiler.kineto_results.events()
    busy = sorted(busy_intervals_ns(events, "cuda"))
    kernels = cuda_kernels(events)
    print(f"GPU under the profiler: {wall / steps * 1e3:.3f} ms wall per step, "
          f"{union_length(busy) / steps / 1e6:.3f} ms busy")
    gaps: dict[tuple[str, str], list[float]] = {}
    reach, before = None, "(start)"
    for start, end, _, name in kernels:
        if reach is not None and start - reach > 2000:
            gaps.setdefault((before[:60], name[:60]), []).append((start - reach) / 1e3)
        if reach is None or end > reach:
            reach, before = end, name
    rows = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]
    print(f"  {'idle us/step':>12s} {'gaps/step':>9s} {'median us':>9s}  kernel before -> kernel after")
    for (a, b), us in rows:
        print(f"  {sum(us) / steps:12.1f} {len(us) / steps:9.2f} {statistics.median(us):9.1f}  {a} -> {b}")
    # which kernels the busy time is spent in: each kernel is charged the part of its interval that extends the
    # union so far (with PDL a kernel resident before its wait overlaps the one in front; the overlap is charged
    # to the earlier kernel), so the column sums to the busy time
    shares: dict[str, list[float]] = {}
    reach = None
    for start, end, _, name in kernels:
        gained = end - start if reach is None else max(0, end - max(reach, start))
        shares.setdefault(name[:70], []).append(gained / 1e3)
        reach = end if reach is None else max(reach, end)
    print(f"  {'busy us/step':>12s} {'launches/step':>13s} {'us each':>8s}  kernel (its share of the busy union)")
    for name, us in sorted(shares.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(us) / steps:12.1f} {len(us) / steps:13.1f} {sum(us) / len(us):8.2f}  {name}")


def _reads(before: dict, after: dict, steps: int) -> str:
    """The tables' disk reads and hot-row cache hit rate over ``steps`` steps (engine.stats()["tables"]
    snapshots): what a pass's step time has to be read against (a disk step's bound counts its reads)."""
    from engram.bench.disk_bound import counter_deltas, hit_rate

    d = counter_deltas(before, after)
    rate = hit_rate(d, any("hits" in t for t in after.values()))
    return (f"{d['read_ops'] / steps:.0f} read ops/step over the tables, hit rate "
            f"{'-' if rate is None else f'{rate:.3f}'}")


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import engram
    from engram.bench.engine_steps import prompt_ids
    from engram.bench.stats import ABConfig
    from engram.engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="4b-like")
    ap.add_argument("--tier", default="disk", choices=("gpu", "host", "disk"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--engram-config", default="{}", help="engram_config keys (table options, lookup_overlap)")
    ap.add_argument("--cache-dir", default=None, help="where the preset's table files are generated / read")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.async_scheduling (default: the engine's auto choice)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--warm-cache", action="store_true", help="decode the same prompts once first")
    ap.add_argument("--gpu-gaps", action="store_true", help="also where the GPU sat idle (CUDA only)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="sequences the engine is built for (default: --batch; at least that)")
    ap.add_argument("--callees", default=None, metavar="REGEX",
                    help="also print the callees of the profiled functions whose name matches (pstats)")
    ap.add_argument("--switch-ab", action="append", default=None, metavar="JSON",
                    help="per-step kernel switches of a B arm: an interleaved A/B in this engine instead of the "
                         "profile passes (repeatable: one A/B each)")
    ap.add_argument("--repeats", type=int, default=10, help="recorded samples per arm of --switch-ab (even)")
    ap.add_argument("--out", default=None, help="--switch-ab's result JSON")
    args = ap.parse_args()
    switch_sets = [json.loads(text) for text in args.switch_ab or ()]
    cfg = ABConfig(repeats=args.repeats) if switch_sets else None
    # decode steps every sequence must have tokens for: warm-up, timed, read cycle, phases, cProfile, torch
    # profiler (5 passes); or the A/Bs' samples (three labels each, warm-ups included)
    passes = 5 if cfg is None else 1 + 3 * (cfg.repeats + cfg.warmup) * len(switch_sets)
    if args.max_num_seqs is not None and args.max_num_seqs < args.batch:
        ap.error(f"--max-num-seqs={args.max_num_seqs} must be at least --batch={args.batch}")
    llm = engram.LLM(args.model, tier=args.tier, engram_config=json.loads(args.engram_config),
                     cache_dir=args.cache_dir, enforce_eager=args.enforce_eager,
                     async_scheduling=args.async_scheduling,
                     max_num_seqs=max(args.batch, args.max_num_seqs or 1),
                     max_model_len=args.context + passes * args.steps + 96,
                     max_num_batched_tokens=max(2048, args.context))
    engine = llm.engine
    vocab = llm.loaded.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=passes * args.steps + 64, ignore_eos=True)
    prompts = prompt_ids(args.batch, args.context, vocab, seed=1)
    if args.warm_cache:  # greedy: the same tokens again, so the same Engram rows
        for i, p in enumerate(prompts):
            engine.add_request(f"w{i}", p, SamplingParams(temperature=0.0, max_tokens=passes * args.steps + 64,
                                                          ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < len(s.prompt_token_ids)
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    times = []
    before = engine.stats()["tables"]
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    sync()
    reads = _reads(before, engine.stats()["tables"], args.steps)
    print(f"{args.model} tier {args.tier} batch {args.batch} (async scheduling {engine._async()}): "
          f"{statistics.fmean(times):.3f} ms/step mean, "
          f"{statistics.median(times):.3f} median, {max(times):.3f} max ({args.steps} steps, "
          f"graph replays so far {engine.stats().get('graph_replays')})")
    deciles = statistics.quantiles(times, n=10)
    print("  step ms by decile (10 % ... 90 %): " + " ".join(f"{q:.2f}" for q in deciles))
    print(f"  {reads}")
    if switch_sets:
        config = {"model": args.model, "tier": args.tier, "batch": args.batch, "context": args.context,
                  "engram_config": json.loads(args.engram_config), "max_num_seqs": args.max_num_seqs,
                  "steps": args.steps, "ab": dataclasses.asdict(cfg)}
        return _switch_ab(engine, switch_sets, args.steps, cfg, args.out, config)
    if args.tier == "disk":  # the disk's clock: what each step spends around its reads
        from engram.bench.read_cycle import format_summary, record_cycles, summarize

        print(format_summary(summarize(record_cycles(engine, args.steps))))
    before = engine.stats()["tables"]
    phases = timed_phases(engine, args.steps)
    print(f"phases pass: {_reads(before, engine.stats()['tables'], args.steps)}")
    print("phases, ms per step (wall time, summed over the tables; indented phases run inside the one above)")
    print(f"  {'phase':50s} {'engine thread':>14s} {'other threads':>14s}")
    for name, (on, off) in phases.items():
        print(f"  {name:50s} {on:14.3f} {off:14.3f}")
    prof = cProfile.Profile()  # Python >= 3.12: calls on the tables' threads show up here too
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    sync()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("cumulative")
    stats.print_stats(args.top)
    if args.callees:
        stats.print_callees(args.callees)
    print(out.getvalue())
    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        for _ in range(args.steps):
            engine.step()
        sync()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.gpu_gaps and torch.cuda.is_available():
        gpu_gaps(engine, args.steps, args.top)
    return 0


def _switch_ab(engine, switch_sets: list[dict], steps: int, cfg, out: str | None, config: dict) -> int:
    """``--switch-ab``: the interleaved A/Bs, one per switch set, printed (and written to ``out`` with the
    run's ``config``, commit and machine, as every bench result: report.write_result)."""
    from engram.bench import report
    from engram.bench.read_cycle import format_summary, switch_ab

    def progress(run) -> None:
        print(f"  [{run.index:3d}] {run.arm:2s} {'warm-up' if run.round < 0 else f'round {run.round}'}  "
              f"{run.value:.3f} ms/step", flush=True)

    done = []
    for switches in switch_sets:
        print(f"A/B: as built against {switches}, {cfg.repeats} samples of {steps} steps per arm", flush=True)
        result, cycles = switch_ab(engine, switches, steps, cfg, on_run=progress)
        print(result.table())
        for label, summary in cycles.items():
            print(f"{label} ({result.arms[label]}): {format_summary(summary)}")
        done.append({"switches": switches, "steps": steps, "ab": result.to_dict(), "read_cycles": cycles})
        if out:  # after each A/B: a run cut short keeps what it finished
            report.write_result("switch-ab", config, {"comparisons": done}, out=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
