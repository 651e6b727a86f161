"""Where a disk-tier decode step's time goes around its reads: host timestamps, one cycle a step.

The disk tier's bound (docs/benchmarks.md) charges a step its host-tier step plus its reads at the disk's raw
rate; what a step spends outside its reads is what the bound does not cover. ``record_cycles`` runs engine
steps with a few host functions wrapped to take timestamps (``time.perf_counter``, any thread):

* each table's ``reader.read`` (its disk reads: first begin and last end of the table's reads in a cycle);
* ``HostIds.wait`` returning (the step's row ids on the host: with async scheduling they wait for the step
  before's sampled tokens); without it (synchronous steps) a cycle starts at ``engine.step``;
* the Worker's ``BackgroundLookups.start``, ``DecodeGraphs.read_lookups`` returning and
  ``DecodeGraphs.finish_lookups`` (its start and its end) where they run.

A cycle runs from one step's row ids on the host to the next's; ``summarize`` gives, in ms (median and p90
over the cycles that read from every table), how the time from the step before's last read to this step's
last read splits:

* ``tail``: the step before's last read -> this step's row ids on the host (the device's layers after the
  last Engram layer, the sampler, the ids' copy, and whatever the host queued in front of them);
* ``plan``: the ids -> the first table's first read (hand-off to the lookup's thread, the cache's
  bookkeeping and the read plan);
* ``read[L]`` per table L in layer order, and ``between[L]`` from the table before's last read to L's first
  (the later layer's hand-off and plan);
* ``period``: their sum, the step's period on the disk's clock; ``reads``: the read intervals' sum.

Engine-side marks, from the step before's last read (negative: before it): ``done`` (the step before's
lookups returned, on whichever thread ran them), ``settle`` (the engine's thread began finishing them:
``finish_lookups``), ``finish`` (done finishing them: their rows cached), ``start`` (this step's lookups
started on the background thread). ``settle - done`` is the engine's thread getting to them, ``finish -
settle`` the host cost of caching their rows, of which ``admit(L)`` is table L's ``DiskTable.admit_probed``
(a duration, not a mark) and ``caching(L)`` its cache's ``RowCache.admit`` inside it (the set bookkeeping and
the writes' launches). With async scheduling ``asked`` marks this step's row ids asked for (``HostIds.wait``
called): ``tail - asked`` is the wait for the device's sampled tokens, ~0 when the next step waited for the
host instead. A diagnosis tool: the wrappers cost microseconds a call.

``switch_ab`` compares per-step kernel switches (``kernel_switches.PER_STEP``) in one engine: samples of a few
dozen steps each, the switches flipped between samples, interleaved with an A/A control (engram/bench/stats.py),
and each arm's read cycle over its samples. Samples that short keep both arms on the same disk minute; the
placement bench's arms are whole engines, whose samples take seconds each and drift with the disk's rate.
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from engram.bench.call_patches import CallPatches
from engram.bench.stats import ABConfig, ABResult, Arm, run_interleaved
from engram.model import kernel_switches


@dataclass
class Marks:
    """Timestamps (perf_counter seconds) of one recorded run."""
    reads: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # layer -> [(begin, end)]
    ids: list[float] = field(default_factory=list)  # row ids on the host (or a step's start)
    done: list[float] = field(default_factory=list)  # a step's lookups returned (read_lookups)
    settle: list[float] = field(default_factory=list)  # the engine began finishing a step's lookups
    finish: list[float] = field(default_factory=list)  # the engine done finishing a step's lookups
    start: list[float] = field(default_factory=list)  # a step's lookups started in the background
    asked: list[float] = field(default_factory=list)  # a step's row ids asked for (HostIds.wait called)
    admits: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # layer -> admit_probed spans
    caching: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # layer -> its cache's admit spans


def record_cycles(engine, steps: int) -> Marks:
    """Run ``steps`` engine steps with the wrappers in place (removed after) and return their marks."""
    import engram.engine.lookup as lookup_mod

    worker = engine.executor.worker
    marks = Marks()
    lock = threading.Lock()
    patches = CallPatches()

    def wrap(obj, name: str, on_begin=None, on_end=None) -> None:
        def make(real):
            def stamped(*a, **k):
                if on_begin is not None:
                    t = time.perf_counter()
                    with lock:
                        on_begin(t)
                try:
                    return real(*a, **k)
                finally:
                    if on_end is not None:
                        t = time.perf_counter()
                        with lock:
                            on_end(t)
            return stamped

        patches.wrap(obj, name, make)

    def wrap_spans(obj, name: str, spans: list) -> None:  # (begin, end) of each call, on any thread
        begun: dict[int, float] = {}  # thread -> begin of its call in flight

        def begin(t):
            begun[threading.get_ident()] = t

        def end(t):
            spans.append((begun.pop(threading.get_ident()), t))

        wrap(obj, name, begin, end)

    for lid, table in sorted((worker.tables or {}).items()):
        if hasattr(table, "reader"):
            wrap_spans(table.reader, "read", marks.reads.setdefault(lid, []))
        if hasattr(table, "admit_probed") and getattr(table, "cache", None) is not None:
            wrap_spans(table, "admit_probed", marks.admits.setdefault(lid, []))
            wrap_spans(table.cache, "admit", marks.caching.setdefault(lid, []))
    if engine._async():
        wrap(lookup_mod.HostIds, "wait", on_begin=marks.asked.append, on_end=marks.ids.append)
    else:
        wrap(engine, "step", on_begin=marks.ids.append)
    lookups = getattr(worker, "_lookups", None)
    if lookups is not None:
        wrap(lookups, "start", on_begin=marks.start.append)
    if getattr(worker, "graphs", None) is not None and hasattr(worker.graphs, "finish_lookups"):
        wrap(worker.graphs, "read_lookups", on_end=marks.done.append)
        wrap(worker.graphs, "finish_lookups", on_begin=marks.settle.append, on_end=marks.finish.append)
    with patches:
        for _ in range(steps):
            engine.step()
    for times in (marks.ids, marks.done, marks.settle, marks.finish, marks.start, marks.asked):
        times.sort()
    return marks


def cycle_rows(marks: Marks) -> list[dict[str, float]]:
    """One row of intervals (seconds, module docstring) per cycle that read from every table, as did the
    cycle before it."""
    layers = sorted(lid for lid, spans in marks.reads.items() if spans)
    if not layers:
        return []
    bounds = marks.ids + [float("inf")]
    cycles = []  # per cycle: its ids time and, per layer, (first read begin, last read end)
    for i in range(len(marks.ids)):
        lo, hi = bounds[i], bounds[i + 1]
        per = {}
        for lid in layers:
            inside = [(b, e) for b, e in marks.reads[lid] if lo <= b < hi]
            if inside:
                per[lid] = (min(b for b, _ in inside), max(e for _, e in inside))
        cycles.append((lo, per))
    rows = []
    for (_, before), (ids, per) in zip(cycles, cycles[1:]):
        if len(before) < len(layers) or len(per) < len(layers):
            continue
        last = max(e for _, e in before.values())
        row = {"tail": ids - last, "plan": per[layers[0]][0] - ids}
        for k, lid in enumerate(layers):
            if k:
                row[f"between[{lid}]"] = per[lid][0] - per[layers[k - 1]][1]
            row[f"read[{lid}]"] = per[lid][1] - per[lid][0]
        row["period"] = max(e for _, e in per.values()) - last
        row["reads"] = sum(row[f"read[{lid}]"] for lid in layers)
        window = (last - 0.5 * row["period"], ids + row["plan"])  # the step before's finishing
        for name, times in (("done", marks.done), ("settle", marks.settle), ("finish", marks.finish),
                            ("start", marks.start)):
            near = [t - last for t in times if window[0] <= t < window[1]]
            if near:
                row[name] = near[0]
        asked = [t for t in marks.asked if window[0] <= t <= ids]
        if asked:  # the wait that gave this step's ids
            row["asked"] = asked[-1] - last
        for name, per_layer in (("admit", marks.admits), ("caching", marks.caching)):
            for lid, spans in sorted(per_layer.items()):
                near = [e - b for b, e in sorted(spans) if window[0] <= b < window[1]]
                if near:
                    row[f"{name}({lid})"] = near[0]
        rows.append(row)
    return rows


def summarize(marks: Marks) -> dict:
    """``cycle_rows`` as ms, median and p90 per interval, and the number of cycles; {"cycles": 0} when none
    read from every table (every row cached, or no disk tables)."""
    return summarize_rows(cycle_rows(marks))


def summarize_rows(rows: list[dict[str, float]]) -> dict:
    """``summarize`` of cycle rows (those of several recorded runs together)."""
    if not rows:
        return {"cycles": 0}
    out: dict = {"cycles": len(rows)}
    for key in dict.fromkeys(k for row in rows for k in row):  # every interval, in order of appearance
        values = sorted(row[key] * 1e3 for row in rows if key in row)
        out[key] = {"median": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))],
                    "n": len(values)}
    return out


def format_summary(summary: dict) -> str:
    """A readable table of ``summarize``'s result."""
    if not summary.get("cycles"):
        return "read cycles: none read from every table (every row cached, or no disk tables)"
    lines = [f"read cycles ({summary['cycles']} steps that read from every table), ms from the step before's "
             "last read:", f"  {'interval':14s} {'median':>8s} {'p90':>8s}"]
    for key, v in summary.items():
        if key != "cycles":
            lines.append(f"  {key:14s} {v['median']:8.3f} {v['p90']:8.3f}" + (f"  ({v['n']} cycles)"
                                                                                if v["n"] != summary["cycles"]
                                                                                else ""))
    return "\n".join(lines)


def switch_ab(engine, switches: dict, steps: int, cfg: ABConfig,
              on_run=None) -> tuple[ABResult, dict[str, dict]]:
    """A/B of per-step kernel switches in one running engine: A is the engine as it is, B the same with
    ``switches`` applied (``kernel_switches.applied``; only names in ``kernel_switches.PER_STEP``: the others
    are captured into decode graphs, ValueError). Each sample is the mean wall ms of ``steps`` engine steps,
    recorded with ``record_cycles``; the arms (and the A/A control A') take turns as ``cfg`` says
    (``stats.run_interleaved``; ``cfg.higher_is_better`` must be False: samples are times). The engine must
    have enough work left for every sample. A switch flipped between samples may meet a step whose lookups
    still run in the background; that step's finish follows what its lookups did (graph_slabs.py).
    Returns the A/B result and each label's read cycle (``summarize_rows`` over its recorded samples)."""
    kernel_switches.check(switches)
    other = sorted(set(switches) - set(kernel_switches.PER_STEP))
    if other:
        raise ValueError(f"kernel switches {other} are captured into decode graphs, not read at every step: "
                         f"compare them with engram bench placement (per-step switches: "
                         f"{list(kernel_switches.PER_STEP)})")
    if cfg.higher_is_better:
        raise ValueError("switch_ab's samples are step times: ABConfig.higher_is_better must be False")
    if steps < 2:
        raise ValueError(f"steps={steps} must be at least 2 (a read cycle spans two steps)")
    rows: dict[str, list[dict[str, float]]] = {}
    taken: list[list[dict[str, float]]] = []  # the last sample's cycle rows, until on_run names its label

    def measure(applied: dict):
        def one() -> float:
            with kernel_switches.applied(applied):
                t = time.perf_counter()
                marks = record_cycles(engine, steps)
                ms = (time.perf_counter() - t) * 1e3 / steps
            taken.append(cycle_rows(marks))
            return ms
        return one

    def note(run) -> None:
        got = taken.pop()
        if run.round >= 0:
            rows.setdefault(run.arm, []).extend(got)
        if on_run is not None:
            on_run(run)

    now = {name: kernel_switches.SWITCHES[name][0]() for name in switches}
    result = run_interleaved(Arm(f"as built {now}", measure({})), Arm(f"switches {switches}", measure(switches)),
                             cfg, on_run=note)
    return result, {label: summarize_rows(r) for label, r in sorted(rows.items())}
