"""Where the host time of a decode step goes, per tier: wall time per step, and ``cProfile`` of the engine's
thread plus a profiler summary of the CPU ops of every thread (the disk tier reads on its own threads).

    python scripts/profile_decode_host.py [--model 4b-like] [--tier disk] [--batch 1] [--context 512]
        [--engram-config JSON] [--cache-dir DIR] [--steps 50] [--enforce-eager] [--async-scheduling | --no-...]
        [--top 30]

Builds the engine, decodes ``--batch`` sequences of ``--context`` prompt tokens until every one decodes,
times ``--steps`` decode steps (wall ms per step, mean and median), then the same number with the step's
phases timed (launch, collect, the lookups' staging, the graph replay or eager forward), then again under
``cProfile`` (the calling thread: the engine, the Worker, the graph replay and every wait) and prints the
``--top`` functions by cumulative time, then once more under torch.profiler (CPU activity, every thread),
printing the ops by self CPU time. A diagnosis tool: the numbers under a profiler are not benchmark numbers.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time


LOOKUPS, FETCH, READS = "tables: submitted lookups", "tables:   page fetches", "tables:     reads"


def timed_phases(engine, steps: int) -> dict[str, float]:
    """Mean wall ms per step of the step and its phases on the engine's thread, timed by wrapping them:
    the whole step, the executor's launch and collect, and inside launch the lookups' staging
    (``LookupExecutor.submit``: for the disk tier, its reads of the first Engram layer) and the decode
    graph's replay (``DecodeGraphs.run``, which copies each piece's rows in and, piecewise, waits for later
    layers' reads) or the eager forward (``ModelRunner.run``); with async scheduling over host-read tables
    the wait for the sampled tokens (``LookupExecutor._host_ids``). Per table, summed over the tables, per
    step: the submitted lookups on the tables' own threads (the first Engram layer's runs on the engine's
    thread, inside ``lookup.submit``), every page fetch and, inside those, the reads."""
    import threading

    worker = engine.executor.worker
    spent: dict[str, float] = {}
    mutex = threading.Lock()  # the tables' threads add to ``spent`` too
    wrapped: list[tuple[object, str]] = []

    def wrap(obj, name: str, label: str) -> None:
        real = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                with mutex:
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)
        wrapped.append((obj, name))

    wrap(engine, "step", "step")
    wrap(engine.executor, "launch", "launch")
    wrap(engine.executor, "collect", "collect")
    wrap(worker.lookup, "submit", "  lookup.submit")
    if worker.graphs is not None:
        wrap(worker.graphs, "run", "  graphs.run")
    wrap(worker.runner, "run", "  runner.run")
    wrap(worker.lookup, "_host_ids", "  lookup._host_ids (waits for the sampled tokens)")
    for table in (worker.tables or {}).values():
        if hasattr(table, "_lookup"):  # the disk tier: submitted lookups (the later layers') on its thread
            wrap(table, "_lookup", LOOKUPS)
        if hasattr(table, "_fetch"):
            wrap(table, "_fetch", FETCH)
        if hasattr(table, "reader"):
            wrap(table.reader, "read", READS)
    for _ in range(steps):
        engine.step()
    for obj, name in wrapped:
        obj.__dict__.pop(name, None)  # the class's method again
    order = ["step", "launch", "  lookup._host_ids (waits for the sampled tokens)", "  lookup.submit",
             "  graphs.run", "  runner.run", "collect", LOOKUPS, FETCH, READS]
    return {k: spent[k] / steps * 1e3 for k in order if k in spent}


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import engram
    from engram.bench.engine_steps import prompt_ids
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
    args = ap.parse_args()
    llm = engram.LLM(args.model, tier=args.tier, engram_config=json.loads(args.engram_config),
                     cache_dir=args.cache_dir, enforce_eager=args.enforce_eager,
                     async_scheduling=args.async_scheduling,
                     max_num_seqs=max(args.batch, 1), max_model_len=args.context + 4 * args.steps + 64,
                     max_num_batched_tokens=max(2048, args.context))
    engine = llm.engine
    vocab = llm.loaded.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 32, ignore_eos=True)
    for i, p in enumerate(prompt_ids(args.batch, args.context, vocab, seed=1)):
        engine.add_request(f"p{i}", p, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < len(s.prompt_token_ids)
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    sync()
    print(f"{args.model} tier {args.tier} batch {args.batch} (async scheduling {engine._async()}): "
          f"{statistics.fmean(times):.3f} ms/step mean, "
          f"{statistics.median(times):.3f} median, {max(times):.3f} max ({args.steps} steps, "
          f"graph replays so far {engine.stats().get('graph_replays')})")
    phases = timed_phases(engine, args.steps)
    print("phases, ms per step (wall on the engine's thread; nested phases are inside launch / collect):")
    for name, ms in phases.items():
        print(f"  {name:16s} {ms:8.3f}")
    prof = cProfile.Profile()  # Python >= 3.12: calls on the tables' threads show up here too
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())
    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        for _ in range(args.steps):
            engine.step()
        sync()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
