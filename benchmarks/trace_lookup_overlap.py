"""A profiler timeline of one decode step with ``lookup_overlap``: which kernels ran on which stream, when (CUDA).

    python -m benchmarks.trace_lookup_overlap [--model 4b-like] [--tier host] [--batch 64] [--context 512]
        [--engram-config JSON] [--enforce-eager] [--out FILE.json] [--plot FILE.png] [--window-us 400]
        [--steps N [--batches 64,256] [--profiled]]

Builds the engine with ``lookup_overlap`` on, decodes ``--batch`` sequences of ``--context`` prompt tokens
until every one decodes, then profiles one more decode step (a CUDA-graph replay unless
``--enforce-eager``). The lookup stream is the stream the Engram gathers ran on; every other stream is the
main stream. Writes the step's kernels (start/end in µs from the step's first kernel, stream, name) as JSON,
prints when the lookup stream's work ran against the main stream's, and with ``--plot`` draws the first
``--window-us`` of the step as two lanes (the figure in docs/engine.md).

``--steps N`` (graph replays) times N more decode steps and prints, per step and as medians over the steps
after the first, when the graph's main branch started, the first Engram layer's lookup and its exposed
wait against the bound (benchmarks/replay_timeline.py: the issue's batch-256 criterion): from
``GraphClock`` stamps inside the replays, in the engine's own rhythm, or with ``--profiled`` from a
profile of each step alone (which changes how the branches are launched); ``--batches`` does so for
several batch sizes with one engine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def kernels_of(prof) -> list[dict]:
    """Every CUDA kernel of a profile: start/end (ns), stream, name."""
    from engram.bench.device_time import cuda_kernels

    return [{"start": s, "end": e, "stream": stream, "name": name}
            for s, e, stream, name in cuda_kernels(prof.profiler.kineto_results.events())]


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import engram
    from engram.bench.engine_steps import prompt_ids
    from engram.engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="4b-like")
    ap.add_argument("--tier", default="host", choices=("gpu", "host"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--engram-config", default="{}", help="more engram_config keys (lookup_overlap is set on)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--window-us", type=float, default=400.0)
    ap.add_argument("--steps", type=int, default=0, help="time this many more decode steps for the exposure timeline")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes for --steps (default --batch)")
    ap.add_argument("--profiled", action="store_true", help="--steps: read each step from a profile, not the clock")
    args = ap.parse_args()
    if args.steps:
        return exposure(args)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: the lookup stream is a CUDA stream")
    options = {**json.loads(args.engram_config), "lookup_overlap": True}
    llm = engram.LLM(args.model, tier=args.tier, engram_config=options, enforce_eager=args.enforce_eager,
                     max_num_seqs=max(args.batch, 1), max_model_len=args.context + 64,
                     max_num_batched_tokens=max(2048, args.context))
    engine = llm.engine
    vocab = llm.loaded.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for i, p in enumerate(prompt_ids(args.batch, args.context, vocab, seed=1)):
        engine.add_request(f"t{i}", p, params)
    decoding = 0
    for _ in range(200):  # prefill everything, then a few decode steps
        outs = engine.step()
        decoding = decoding + 1 if len(outs) == args.batch else 0
        if decoding >= 4:
            break
    replays = engine.stats()["graph_replays"]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    replayed = engine.stats()["graph_replays"] - replays
    kernels = kernels_of(prof)
    gathers = [k for k in kernels if "gather" in k["name"].lower()]
    if not gathers:
        raise SystemExit("no gather kernel in the profiled step")
    side = gathers[0]["stream"]
    t0 = kernels[0]["start"]
    for k in kernels:
        k["start_us"], k["end_us"] = (k.pop("start") - t0) / 1e3, (k.pop("end") - t0) / 1e3
        k["lane"] = "lookup" if k["stream"] == side else "main"
    lookup = [k for k in kernels if k["lane"] == "lookup"]
    main_k = [k for k in kernels if k["lane"] == "main"]
    lookup_end = max(k["end_us"] for k in lookup)
    main_during = [k for k in main_k if k["start_us"] < lookup_end]
    summary = {"model": args.model, "tier": args.tier, "batch": args.batch, "context": args.context,
               "graph_replay": bool(replayed), "step_us": max(k["end_us"] for k in kernels),
               "lookup_kernels": len(lookup), "lookup_busy_us": sum(k["end_us"] - k["start_us"] for k in lookup),
               "lookup_end_us": lookup_end, "main_kernels_before_lookup_end": len(main_during)}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "kernels": kernels}, f, indent=1)
    if args.plot:
        plot(kernels, summary, args.plot, args.window_us)
    return 0


def exposure(args) -> int:
    """``--steps``: per batch size, decode until every sequence decodes, then time ``args.steps`` steps and
    print each step's timeline and the medians over all but the first: from GraphClock stamps taken in the
    engine's own rhythm (the default), or, with ``--profiled``, from a profile of each step alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import engram
    from engram.bench.device_time import cuda_kernels
    from engram.bench.engine_steps import prompt_ids
    from benchmarks.replay_timeline import clock_timeline, median_timeline, meets_exposure_bound, step_timeline
    from benchmarks.graph_clock import GraphClock, install
    from engram.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    batches = [int(b) for b in (args.batches or str(args.batch)).split(",")]
    options = {**json.loads(args.engram_config), "lookup_overlap": True}
    clock = None if args.profiled else GraphClock("cuda")
    if clock is not None:
        install(clock)  # before the capture: the stamps are part of every replay
    chunk = max(2048, args.context)
    # every sequence must still be decoding when the last prompt's prefill ends: a sequence's budget covers
    # the steps that prefill the whole batch (chunked at `chunk` tokens a step), the warm steps, the timed ones
    decode_budget = {b: -(-b * args.context // chunk) + 16 + args.steps for b in batches}
    llm = engram.LLM(args.model, tier=args.tier, engram_config=options, max_num_seqs=max(batches),
                     max_model_len=args.context + max(decode_budget.values()) + 8, max_num_batched_tokens=chunk)
    engine = llm.engine
    vocab = llm.loaded.model_config.vocab_size
    layer_ids = sorted(llm.loaded.engram_config.layer_ids)
    results = []
    how = "profiling" if args.profiled else "stamping"
    print(f"[{time.perf_counter() - t0:.0f} s] engine built; {how} {args.steps} steps at batch sizes {batches}",
          file=sys.stderr, flush=True)
    for batch in batches:
        params = SamplingParams(temperature=0.0, max_tokens=decode_budget[batch], ignore_eos=True)
        for i, p in enumerate(prompt_ids(batch, args.context, vocab, seed=batch)):
            engine.add_request(f"b{batch}-{i}", p, params)
        decoding = 0
        while decoding < 4:
            if not engine.has_unfinished():
                raise SystemExit(f"batch {batch}: the requests finished before all {batch} decoded together "
                                 "(KV cache too small for the batch?)")
            decoding = decoding + 1 if len(engine.step()) == batch else 0
        print(f"[{time.perf_counter() - t0:.0f} s] batch {batch}: every sequence decodes", file=sys.stderr, flush=True)
        replays = engine.stats()["graph_replays"]
        steps = []
        if clock is not None:
            clock.read_snapshots()
            for _ in range(args.steps):
                engine.step()  # launches the next replay (async scheduling) or runs one
                clock.snapshot()
            steps = [clock_timeline(stamps, layer_ids) for stamps in clock.read_snapshots()]
        else:
            for _ in range(args.steps):
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    engine.step()
                    torch.cuda.synchronize()
                events = prof.profiler.kineto_results.events()
                kernels = [(s / 1e3, e / 1e3, st, n) for s, e, st, n in cuda_kernels(events)]
                steps.append(step_timeline(kernels))
        if engine.stats()["graph_replays"] - replays < args.steps:
            raise SystemExit(f"batch {batch}: {engine.stats()['graph_replays'] - replays} of {args.steps} steps "
                             "replayed a graph")
        for i, t in enumerate(steps):
            print(json.dumps({"batch": batch, "step": i, **{k: (round(v, 1) if v is not None else None)
                                                            for k, v in t.as_dict().items()}}), flush=True)
        while engine.has_unfinished():
            engine.step()
        summary = {"model": args.model, "tier": args.tier, "batch": batch, "context": args.context, "read": how,
                   "steps": len(steps) - 1, **median_timeline(steps[1:] or steps)}
        summary["met"] = meets_exposure_bound(summary["exposed_us"], summary["bound_us"])
        print(json.dumps(summary), flush=True)
        results.append(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def plot(kernels: list[dict], summary: dict, path: str, window_us: float) -> None:
    """One lane per CUDA stream (in a graph replay the driver maps the graph's branches onto streams of its
    own; the branch that holds the gathers may share its stream with the eager kernels around the replay)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({k["stream"] for k in kernels}, key=lambda s: min(k["start_us"] for k in kernels
                                                                       if k["stream"] == s))
    lane = {s: i for i, s in enumerate(reversed(streams))}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.6 * len(streams)))
    for k in kernels:
        if k["start_us"] > window_us:
            continue
        name = k["name"].lower()
        color = ("tab:orange" if "gather_rows" in name else "tab:red" if k["lane"] == "lookup" and "nvjet" in name
                 else "tab:gray" if k["lane"] == "lookup" else "tab:blue")
        ax.broken_barh([(k["start_us"], max(k["end_us"] - k["start_us"], 0.3))], (lane[k["stream"]] - 0.35, 0.7),
                       color=color)
    ax.set_yticks(list(lane.values()), [f"stream {s}" + (" (gathers)" if any(k["stream"] == s and k["lane"] == "lookup"
                                                                             for k in kernels) else "")
                                        for s in lane])
    ax.set_xlabel("µs from the step's first kernel")
    ax.set_xlim(0, window_us)
    mode = "graph replay" if summary["graph_replay"] else "eager"
    ax.set_title(f"{summary['model']}, tier {summary['tier']}, batch {summary['batch']}, {mode}: Engram gathers "
                 "(orange), projections (red), other kernels (gray/blue)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
