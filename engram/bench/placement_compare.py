"""One comparison of ``engram bench placement``: arm A against one arm B at one batch size, interleaved by
``stats.run_interleaved``. Each arm's measure (``arm_measure``) is a ``measure_decode`` over the batch's forced windows
whose outputs must be the forced ids and whose timed steps must all replay a graph where the engine has them
(``GraphFallback``); each sample records its step spread and table counter gains, disk arms their raw read rates."""
from __future__ import annotations

import json
import statistics
import sys
from typing import Callable

from engram.bench.disk_bound import ARM_LABELS, disk_summary
from engram.bench.forced_windows import Windows, check_forced
from engram.bench.placement_arms import ArmSpec

SLOW_FACTOR = 2.0  # a timed step over this many times its sample's median step is counted as slow
COUNTER_KEYS = ("hits", "misses", "read_ops", "disk_rows", "bytes_read", "rows")  # summed over an arm's tables


class GraphFallback(RuntimeError):
    """Timed decode steps that did not replay a CUDA graph where they should have."""


def counter_deltas(before: dict, after: dict) -> dict:
    """``COUNTER_KEYS`` gained between two ``engine.stats()["tables"]`` snapshots, summed over the tables."""
    return {k: sum(after[lid].get(k, 0) - before[lid].get(k, 0) for lid in after) for k in COUNTER_KEYS}


def hit_rate(counts: dict, cached: bool) -> float | None:
    """hits / (hits + misses) of the hot-row cache; None without a cache or without a lookup through it."""
    looked = counts["hits"] + counts["misses"]
    return counts["hits"] / looked if cached and looked else None


def step_spread(wall_s: list[float]) -> dict:
    """A sample's timed steps: median and longest (ms), how many took over ``SLOW_FACTOR`` x the median, all of them."""
    p50 = statistics.median(wall_s) * 1e3
    return {"step_ms_p50": p50, "step_ms_max": max(wall_s) * 1e3,
            "slow_steps": sum(w * 1e3 > SLOW_FACTOR * p50 for w in wall_s),
            "steps_ms": [round(w * 1e3, 3) for w in wall_s]}


def _summary(samples: list[dict]) -> dict:
    def median(key):
        values = [s[key] for s in samples]
        return None if None in values else statistics.median(values)

    return {"n": len(samples), "tok_s_median": median("tok_s"),
            "tok_s_mean": statistics.fmean(s["tok_s"] for s in samples),
            "step_ms_median": median("step_ms"), "step_ms_p50_median": median("step_ms_p50"),
            "slow_steps": sum(s["slow_steps"] for s in samples),
            "lookup_exposed_ms_per_step_mean": statistics.fmean(s["lookup_exposed_s"] / s["steps"] * 1e3
                                                                for s in samples),
            "hit_rate_median": median("hit_rate"), "read_ops_per_step_median": median("read_ops_per_step"),
            "graph_replays": sum(s["graph_replays"] for s in samples), "steps": sum(s["steps"] for s in samples)}


def arm_measure(engine, arm: ArmSpec, win: Windows, batch: int, s, records: list[dict], graphs: bool,
                cached: bool, raw_rate: Callable[[], float] | None = None):
    """The ``measure`` of ``arm`` at ``batch``: one checked ``measure_decode`` over the windows (forced ids; graph
    replays when ``graphs``), its record appended -> tok/s. ``raw_rate``: the disk's rate around the sample."""
    from engram.bench.engine_steps import measure_decode

    def measure() -> float:
        raw = raw_rate() if raw_rate is not None else None
        t = measure_decode(engine, win.prompts, s.decode_steps, s.warmup_tokens, tag=f"placement-{batch}",
                           forced=win.forced)
        after = raw_rate() if raw_rate is not None else None
        checked = check_forced(t, win, s.warmup_tokens + s.decode_steps, arm.name)
        expected = s.decode_steps if graphs else 0
        if t.graph_steps != expected:
            raise GraphFallback(f"arm {arm.name}, batch {batch}: {t.graph_steps} of {s.decode_steps} timed steps "
                                f"replayed a CUDA graph, expected {expected}")
        counts = counter_deltas(*t.tables)
        value = batch * s.decode_steps / sum(t.wall_s)
        records.append({"arm": arm.name, "tok_s": value, "wall_s": sum(t.wall_s), "steps": s.decode_steps,
                        "step_ms": sum(t.wall_s) / s.decode_steps * 1e3, **step_spread(t.wall_s),
                        "lookup_exposed_s": t.lookup_exposed_s, "graph_replays": t.graph_steps,
                        "tokens_checked": checked, "tables": counts, "hit_rate": hit_rate(counts, cached),
                        "read_ops_per_step": counts["read_ops"] / s.decode_steps, "raw_read_ops_per_s": raw,
                        "raw_read_ops_per_s_after": after})
        return value
    return measure


def run_comparison(engines: dict, arm_a: ArmSpec, arm_b: ArmSpec, k: int, batch: int, win: Windows, s, ab_cfg,
                   quiet: bool, graphs: dict, cached: dict, disk: dict | None = None, rates: dict | None = None):
    """A against the k-th B at ``batch``, interleaved -> (ABResult, the comparison's JSON record)."""
    from engram.bench import stats

    records: list[dict] = []
    rates = rates or {}

    def progress(r: stats.Run) -> None:
        records[-1].update(index=r.index, label=r.arm, round=r.round)  # the record the run just appended
        if not quiet:
            what = "warm-up" if r.round < 0 else f"round {r.round}"
            print(f"[batch {batch} b{k} {r.index + 1:4d}] {r.arm:2s} {what:9s} {r.value:.6g} tok/s",
                  file=sys.stderr, flush=True)

    result = stats.run_interleaved(
        *(stats.Arm(f"{label}: {arm.name}", arm_measure(engines[arm], arm, win, batch, s, records, graphs[arm],
                                                          cached[arm], rates.get(label)))
          for label, arm in (("A", arm_a), ("B", arm_b))),
        ab_cfg, on_run=progress)
    recorded = {label: [r for r in records if r["label"] == label and r["round"] >= 0] for label in result.arms}
    comparison = {"batch": batch, "b_index": k, "a": arm_a.to_dict(), "b": arm_b.to_dict(),
                  "ab": result.to_dict(), "samples": records,
                  "arm_stats": {label: _summary(x) for label, x in recorded.items()}}
    if disk:
        arm_of = {"A": arm_a, "B": arm_b}
        comparison["raw_reads"] = {label: raw for label, (raw, _, _) in disk.items()}
        comparison["disk"] = {label: disk_summary(arm_of[label], records, ARM_LABELS[label], raw, fresh, placement)
                              for label, (raw, fresh, placement) in disk.items()}
    return result, comparison


def table_row(result, comparison: dict) -> dict:
    from engram.bench.stats import AA_LABEL

    ab, aa = result.comparisons["B/A"], result.comparisons.get(f"{AA_LABEL}/A")

    def ci(c) -> str:
        return f"{1 + c.ci_lo:.4f}…{1 + c.ci_hi:.4f}"

    b = comparison["arm_stats"]["B"]
    return {"batch": comparison["batch"], "arm B": json.dumps(comparison["b"]), "tok/s A": result.stats["A"].median,
            "tok/s B": result.stats["B"].median, "B/A": 1 + ab.estimate, "B/A CI": ci(ab),
            "A/A CI": ci(aa) if aa is not None else "", "verdict": result.verdict,
            "B hit rate": b["hit_rate_median"], "B reads/step": b["read_ops_per_step_median"]}
