"""What one profiled decode step with ``lookup_overlap`` says about its first Engram layer's wait.

The issue's batch-256 criterion on the host tier: the time the first consuming layer actually waited
(*exposed*) must stay within 1.1 x max(0, the lookup time of that layer - the time of the embedding and
the layers before it). In a CUDA-graph replay no Python runs and events inside a capture cannot be timed,
so this reads the three times off the step's kernels (``device_time.cuda_kernels`` of a profile):

* the **lookup lane** is the stream the Engram gathers ran on, the **main lane** every other stream;
* the replay starts at the earlier of the first gather and the first main-lane kernel (in a replay the
  driver runs the graph's lookup branch on the launching stream, where the eager patch of pending row ids
  ran before it, and the main branch on streams of its own; so this reads graph replays, not eager steps,
  whose waits the engine times with events);
* ``lookup_us``: from the first gather's start to the end of the last lookup-lane kernel before the
  second gather (layer 1's gather, its projection when it runs ahead, its tag copy); the whole lane when
  there is one gather;
* ``before_us``: from the replay's start to the end of the last main-lane kernel before the first
  consumer kernel (the embedding and the layers before the first Engram layer);
* ``exposed_us``: the gap in front of the first consumer kernel, less the median gap between consecutive
  main-lane kernels of the step (what a replay costs between any two kernels);
* ``bound_us``: 1.1 x max(0, lookup_us - before_us); ``main_busy_us``: the union of main-lane kernel time;
  ``main_start_us``: when the main lane's first kernel started, from the first gather's start (about 0
  when the graph's two branches start together; the length of the lookups if the main branch waited).

A step without a gather or a consumer kernel raises ValueError naming what is missing.

A profiler changes what it watches here: under it the replay's main branch started 0.6-1.5 ms after the
lookup branch (docs/benchmarks.md). ``clock_timeline`` reads the same quantities from a step's
``GraphClock`` stamps (benchmarks/graph_clock.py; ``graph_clock.install``), taken without a profiler:
``main_start_us`` = main_start - fork; ``lookup_us`` = lookup_done_L - fork and ``before_us`` =
wait_begin_L - fork for the first Engram layer L (one origin, so a main branch that starts late shows in
``before_us`` and ``main_start_us``, not as a shorter lookup); ``exposed_us`` = the first layer's
wait_end - wait_begin less the last layer's (whose lookup ended long before its consumer: what a stamp
pair costs when nothing is waited for); ``span_us`` = joined - fork; ``main_busy_us`` is None.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

GATHER = "gather_rows"  # the Triton gather of packed rows (store/kernels/triton_gather.py)
CONSUMER = "engram_gate"  # the fused v41 gate, the first kernel that reads a layer's projected rows


@dataclass(frozen=True)
class StepTimeline:
    span_us: float  # replay start to the last kernel's end
    main_start_us: float  # the main lane's first kernel, from the first gather's start (~0: the branches fork together)
    main_busy_us: float | None  # None from clock stamps (they do not see kernels)
    lookup_us: float
    before_us: float
    exposed_us: float
    bound_us: float

    def as_dict(self) -> dict:
        return asdict(self)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def step_timeline(kernels: list[tuple[float, float, int, str]], gather: str = GATHER,
                  consumer: str = CONSUMER) -> StepTimeline:
    """``kernels``: (start, end, stream, name) of one decode step, times in µs (any origin)."""
    gathers = sorted(k for k in kernels if gather in k[3])
    if not gathers:
        raise ValueError(f"no kernel named like {gather!r} in the step: nothing was gathered")
    side = gathers[0][2]
    g0 = gathers[0][0]
    main = sorted(k for k in kernels if k[2] != side)
    consumers = [k for k in main if consumer in k[3]]
    if not consumers:
        raise ValueError(f"no kernel named like {consumer!r} on the main lane: no Engram layer consumed rows")
    first = consumers[0]
    start = min(g0, main[0][0])
    lookup = sorted(k for k in kernels if k[2] == side and k[0] >= g0)
    stop = gathers[1][0] if len(gathers) > 1 and gathers[1][2] == side else float("inf")
    lookup_end = max(k[1] for k in lookup if k[0] < stop)
    prior = [k for k in main if k[1] <= first[0]]
    before_end = max(k[1] for k in prior) if prior else start
    gaps = [b[0] - a[1] for a, b in zip(main, main[1:]) if b[0] >= a[1]]
    typical = statistics.median(gaps) if gaps else 0.0
    lookup_us = lookup_end - g0
    before_us = before_end - start
    exposed = max(0.0, first[0] - before_end - typical)
    return StepTimeline(
        span_us=max(k[1] for k in kernels if k[0] >= start) - start, main_start_us=main[0][0] - g0,
        main_busy_us=_union([(k[0], k[1]) for k in main]),
        lookup_us=lookup_us, before_us=before_us, exposed_us=exposed,
        bound_us=1.1 * max(0.0, lookup_us - before_us))


def clock_timeline(stamps: dict[str, int], layer_ids: list[int]) -> StepTimeline:
    """``stamps``: one step's ``GraphClock.read()`` (ns); ``layer_ids``: the Engram layers, first to last."""
    need = ["fork", "main_start", "joined"] + [f"{k}_{lid}" for lid in (layer_ids[0], layer_ids[-1])
                                               for k in ("lookup_done", "wait_begin", "wait_end")]
    missing = [n for n in need if not stamps.get(n)]
    if missing:
        raise ValueError(f"clock stamps missing {missing}: was graph_clock.install(clock) called before the capture?")
    us = {n: (v - stamps["fork"]) / 1e3 for n, v in stamps.items()}
    first, last = layer_ids[0], layer_ids[-1]
    wait = {lid: us[f"wait_end_{lid}"] - us[f"wait_begin_{lid}"] for lid in (first, last)}
    lookup_us, before_us = us[f"lookup_done_{first}"], us[f"wait_begin_{first}"]
    return StepTimeline(span_us=us["joined"], main_start_us=us["main_start"], main_busy_us=None,
                        lookup_us=lookup_us, before_us=before_us,
                        exposed_us=max(0.0, wait[first] - wait[last]) if first != last else wait[first],
                        bound_us=1.1 * max(0.0, lookup_us - before_us))


STAMP_RESOLUTION_US = 1.0  # %globaltimer steps and a stamp kernel's own jitter: ~0.2-0.6 us measured at rest


def meets_exposure_bound(exposed_us: float, bound_us: float) -> bool:
    """The issue's criterion, exposed <= bound, read to the clock's resolution: with a bound of 0 (the lookup
    ends before its consumer is reached) an exposed wait of a fraction of a microsecond is a stamp pair's
    noise, not a wait (a float difference of 1e-13 us once failed a plain ``<=``)."""
    return exposed_us <= bound_us + STAMP_RESOLUTION_US


def median_timeline(steps: list[StepTimeline]) -> dict:
    """Each field's median over ``steps`` (at least one); None where the steps have none."""
    if not steps:
        raise ValueError("no steps to summarise")
    out = {}
    for f in StepTimeline.__dataclass_fields__:
        values = [getattr(s, f) for s in steps if getattr(s, f) is not None]
        out[f] = statistics.median(values) if values else None
    return out
