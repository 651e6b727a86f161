"""The disk arms of `engram bench placement`: their tables' counters per sample, the disk's raw random read
rate, and the bound a disk step is held to.

Counters: ``measure_decode`` returns the tables' counters right before and right after the timed steps
(``DecodeTimes.tables``), and ``counter_deltas`` sums what the tables' counters
(``engine.stats()["tables"]``) gained between them over the arm's tables: ``COUNTER_KEYS`` = hits,
misses, read_ops, disk_rows, bytes_read, rows. ``hit_rate`` is hits / (hits + misses) of the hot-row
cache, None without a cache (or without a lookup through it).

Raw reads: right before each comparison that involves a disk arm, ``measure_raw_reads`` measures the
disk's random 4 KiB read rate for a given number of seconds (``engram.bench.lookup.raw_cell``: uniformly
random page reads of the arm's first table's values.bin through a ``PageReader`` with the arm's io mode
in effect and the depth its step reads at (``read_depth``: the reader's queue depth, times the arm's tables
when their lookups read side by side at that batch, ``lookup.reads_together``, with O_DIRECT: each table's
thread then keeps its own queue full, so a step keeps that many reads in flight and the disk's rate is taken
there too), a given number of pages per call, one unrecorded call first; with buffered io the file is dropped
from the page cache before every call, O_DIRECT has none). The rate drifts within a
run (on the H200 machine a disk arm's rounds ranged 1165–1737 tok/s while the host tier's agreed within
1 %), so the same reads also run for a shorter time right before each sample of a disk arm that reads
with O_DIRECT (``sample_rate``, the sample's ``raw_read_ops_per_s``; None for other arms or when turned off:
with buffered io the measurement drops the file from the page cache, so the arm's sample would start cold),
and again right after the sample's timed steps (``raw_read_ops_per_s_after``). On the H200 machine the rate
before a sample explained little of the rate the sample's own reads ran at (correlation 0.24 over one run's
ten batch-64 samples, docs/benchmarks.md), so the bound is also taken against both measurements.

Per disk arm and comparison (``disk_summary``): the hit rate of its first warm-up sample and of its first
recorded sample (cold; the hot-row cache lives as long as its tables, so only an arm's first comparison
starts from an empty cache: ``fresh_tables``), the median over its recorded samples (warm), the median
read ops per step and step ms, the median of the samples' median steps and how many of their steps took
over twice their sample's median (``slow_steps``: stalls, which a mean step hides), and the raw read rate.
Every sample of a batch size decodes the same windows, so after an arm's first sample a hot-row cache that
holds their rows serves them all again: the warm hit rate is that of text seen before, the cold ones that
of new text.

The bound (``add_bounds``), against a host-tier arm at the same batch (the other arm of the disk arm's own
comparison when that is on the host tier, else the first B on the host tier at that batch):
bound_ms = host step ms (median) + read ops per step (median) / raw read ops/s x 1000, ratio = disk step
ms / bound_ms and target_met = ratio <= ``BOUND_FACTOR`` (1.1). Without a host-tier arm the fields stay
None and ``bound_note`` is ``NO_HOST_ARM``. With per-sample rates, ratio_paired = the median over the
arm's recorded samples of step ms / (host step ms + the sample's read ops per step / the rate measured right
before it x 1000): the same bound, each sample held to the disk as it was when the sample ran; with the
bootstrap interval of that median (``stats.median_ci``, the run's A/B settings) ``paired_target`` is "met"
when the interval lies at or below ``BOUND_FACTOR``, "missed" when above it, else "undecided". With the
rates after the samples too, ratio_bracketed = the same with the sample's reads charged the mean of their
time at the rate before and at the rate after (the harmonic mean of the two rates: the sample ran between
them), with ``ratio_bracketed_ci`` and ``bracketed_target`` alike.
``disk_rows`` makes the second printed table (``DISK_COLUMNS``), one row per disk arm per comparison.

The latency floor beside the bound: the bound charges a step's reads at the disk's rate with a deep queue,
but the first Engram layer's reads can start only once the step's tokens are sampled, and the layer needs
them after embedding and one layer (~0.1 ms on 4b-like). However well the rest overlaps, a step takes at
least the host step plus one call of that lookup's reads. ``measure_lookup_reads``, after each comparison,
times raw calls of that many random pages (read ops per step / the arm's tables, the pages one lookup
reads) at the arm's io and queue depth; ``add_bounds`` adds floor_ms = host step ms + that call's median
ms and floor_ratio = disk step ms / floor_ms. At batch 1 one call of a few dozen pages waits for the
disk's latency (~0.8 ms on the H200 machine's virtual disk at depth 64 by Little's law), not its rate, so
the floor lies above the bound there; at large batches the two meet.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Callable

from engram.bench import stats
from engram.bench.placement_arms import ARM_LABELS, ArmSpec

DISK_COLUMNS = ["batch", "disk arm", "step ms", "step p50 ms", "slow steps", "host step ms", "read ops/step",
                "raw reads/s", "bound ms", "ratio", "raw reads/s, samples", "paired ratio", "paired CI",
                "paired target", "raw reads/s, after", "bracketed ratio", "bracketed CI", "bracketed target",
                "lookup reads ms", "floor ms", "floor ratio", "hit warm-up", "hit cold",
                "hit warm"]
COUNTER_KEYS = ("hits", "misses", "read_ops", "disk_rows", "bytes_read", "rows")  # summed over an arm's tables
BOUND_FACTOR = 1.1  # the issue's target: disk step ms <= 1.1 x (host step ms + misses' reads at the raw rate)
NO_HOST_ARM = "bound not computed: no host-tier arm in the run"


def counter_deltas(before: dict, after: dict) -> dict:
    """``COUNTER_KEYS`` of the tables' counters (engine.stats()["tables"]) gained between two snapshots,
    summed over the tables."""
    return {k: sum(after[lid].get(k, 0) - before[lid].get(k, 0) for lid in after) for k in COUNTER_KEYS}


def hit_rate(counts: dict, cached: bool) -> float | None:
    """hits / (hits + misses) of the hot-row cache; None without a cache or without a lookup through it."""
    looked = counts["hits"] + counts["misses"]
    return counts["hits"] / looked if cached and looked else None


def read_depth(tables: dict, together: bool) -> int:
    """The reads a disk arm's step keeps in flight: its first table's reader's queue depth, times its tables
    when their lookups read side by side (``together``: ``lookup.reads_together``, kernel switches
    ``first_lookup_alone`` and ``together_when_deep``) each on a queue of its own
    (``reader.queue_per_thread``: O_DIRECT through each table thread's AIO context); else that depth (one
    table's reads at a time, or one pool shared)."""
    from engram.store.reader import queue_per_thread

    reader = tables[min(tables)].reader
    return reader.queue_depth * (len(tables) if together and queue_per_thread(reader.io) else 1)


def _raw_calls(tables: dict, pages: int, seconds: float, seed: int, depth: int | None = None) -> tuple:
    """``engram.bench.lookup.raw_cell`` calls of ``pages`` random pages of the first Engram layer's
    values.bin, with the io mode that table's reader has in effect, at queue depth ``depth`` (default the
    reader's; cold, the file dropped from the page cache before every call, when that io is buffered): one
    unrecorded call (the pool's threads, the buffer's first touch), then calls for ``seconds``. Returns
    (layer, reader, cell, cell.result())."""
    from engram.bench.lookup import raw_cell

    lid = min(tables)
    reader = tables[lid].reader
    cell = raw_cell(Path(reader.path), {"io": reader.io, "queue_depth": depth or reader.queue_depth}, pages, seed,
                    reader.io == "buffered")
    cell.step()
    cell.run(seconds)
    return lid, reader, cell, cell.result()


def measure_raw_reads(tables: dict, seconds: float, pages: int, seed: int, depth: int | None = None) -> dict:
    """The disk's random 4 KiB read rate, now: ``_raw_calls`` of ``pages`` pages a call for ``seconds``, at
    queue depth ``depth`` (default the first table's reader's)."""
    lid, reader, cell, r = _raw_calls(tables, pages, seconds, seed, depth)
    return {"layer": lid, "io": reader.io, "io_requested": reader.io_requested, "queue_depth": cell.key["queue_depth"],
            "cold": reader.io == "buffered", "pages_per_call": pages, "calls": r["batches"],
            "seconds": sum(cell.times), "read_ops_per_s": r["read_ops_per_s"], "disk_MB_per_s": r["disk_MB_per_s"],
            "us_per_call_p50": r["us_per_batch_p50"]}


def sample_rate(tables: dict, seconds: float, pages: int, seed: int,
                depth: int | None = None) -> Callable[[], float]:
    """A measure of the disk's read rate (ops/s) to take right before each of an arm's samples:
    ``measure_raw_reads`` for ``seconds`` at queue depth ``depth``, each call at pages of its own (the seed
    advances)."""
    calls = itertools.count(1)

    def rate() -> float:
        return measure_raw_reads(tables, seconds, pages, seed + next(calls), depth)["read_ops_per_s"]
    return rate


def measure_lookup_reads(tables: dict, read_ops_per_step: float | None, seconds: float, seed: int) -> dict | None:
    """How long one lookup's reads take as a raw call: ``_raw_calls`` of ceil(read ops per step / number of
    tables) pages a call for ``seconds``; None when a step read nothing (every row a cache hit)."""
    import math

    if not read_ops_per_step:
        return None
    pages = math.ceil(read_ops_per_step / len(tables))
    _, _, _, r = _raw_calls(tables, pages, seconds, seed)
    return {"pages": pages, "calls": r["batches"], "us_per_call_p50": r["us_per_batch_p50"]}


def _median(xs: list):
    import statistics

    return None if not xs or any(x is None for x in xs) else statistics.median(xs)


def disk_summary(arm: ArmSpec, records: list[dict], labels: tuple, raw: dict, fresh: bool, placement: str) -> dict:
    """What a disk arm did in one comparison: hit rates cold (first warm-up sample, first recorded sample)
    and warm (median of the recorded samples), median read ops per step and step ms, and the raw read rate
    measured before the comparison; the bound fields are filled in by ``add_bounds``."""
    mine = [r for r in records if r["label"] in labels]
    warmups = [r for r in mine if r["round"] < 0]
    recorded = [r for r in mine if r["round"] >= 0]
    return {"arm": arm.to_dict(), "placement": placement, "fresh_tables": fresh,
            "raw_read_ops_per_s": raw["read_ops_per_s"],
            "hit_rate_cold_warmup": warmups[0]["hit_rate"] if warmups else None,
            "hit_rate_cold": recorded[0]["hit_rate"],
            "hit_rate_warm": _median([r["hit_rate"] for r in recorded]),
            "read_ops_per_step_median": _median([r["read_ops_per_step"] for r in recorded]),
            "step_ms_median": _median([r["step_ms"] for r in recorded]),
            "raw_read_ops_per_s_samples_median": _median([r["raw_read_ops_per_s"] for r in recorded]),
            "raw_read_ops_per_s_after_median": _median([r["raw_read_ops_per_s_after"] for r in recorded]),
            "step_ms_p50_median": _median([r["step_ms_p50"] for r in recorded]),
            "slow_steps": sum(r["slow_steps"] for r in recorded),
            "host_arm": None, "host_source": None, "host_step_ms_median": None, "bound_ms": None, "ratio": None,
            "target_met": None, "ratio_paired": None, "ratio_paired_ci": None, "paired_target": None,
            "ratio_bracketed": None, "ratio_bracketed_ci": None, "bracketed_target": None,
            "bound_note": NO_HOST_ARM, "lookup_reads": None, "floor_ms": None,
            "floor_ratio": None}


def add_bounds(comparisons: list[dict], ab_cfg: stats.ABConfig | None = None) -> None:
    """For every disk arm of every comparison, the bound against a host-tier arm at the same batch: the other
    arm of its own comparison when that is on the host tier (interleaved with it), else the first B on the
    host tier at that batch (its comparison's B samples). bound_ms = host step ms + disk read ops per step /
    raw read ops/s x 1000 (medians), ratio = disk step ms / bound_ms, target_met = ratio <= BOUND_FACTOR.
    Without a host-tier arm at that batch the fields stay None and ``bound_note`` says so."""
    for c in comparisons:
        for label, d in c.get("disk", {}).items():
            other = "B" if label == "A" else "A"
            if c[other.lower()]["tier"] == "host":
                host, source, samples = c[other.lower()], "same comparison", c["samples"]
                labels = ARM_LABELS[other]
            else:
                hc = next((h for h in comparisons if h["batch"] == c["batch"] and h["b"]["tier"] == "host"), None)
                if hc is None:
                    continue
                host, source, samples, labels = hc["b"], f"b{hc['b_index']}", hc["samples"], ARM_LABELS["B"]
            host_ms = _median([r["step_ms"] for r in samples if r["label"] in labels and r["round"] >= 0])
            bound = host_ms + d["read_ops_per_step_median"] / d["raw_read_ops_per_s"] * 1e3
            ratio = d["step_ms_median"] / bound
            d.update(host_arm=host, host_source=source, host_step_ms_median=host_ms, bound_ms=bound, ratio=ratio,
                     target_met=ratio <= BOUND_FACTOR, bound_note=None)
            mine = [r for r in c["samples"] if r["label"] in ARM_LABELS[label] and r["round"] >= 0]
            if d["raw_read_ops_per_s_samples_median"] is not None:  # each sample against the rate right before it
                d.update(zip(("ratio_paired", "ratio_paired_ci", "paired_target"), _held_to(
                    [r["step_ms"] / (host_ms + r["read_ops_per_step"] / r["raw_read_ops_per_s"] * 1e3)
                     for r in mine], ab_cfg)))
            if d["raw_read_ops_per_s_after_median"] is not None:  # and to the rates on both sides of it
                d.update(zip(("ratio_bracketed", "ratio_bracketed_ci", "bracketed_target"), _held_to(
                    [r["step_ms"] / (host_ms + r["read_ops_per_step"] * 1e3 / 2
                                     * (1 / r["raw_read_ops_per_s"] + 1 / r["raw_read_ops_per_s_after"]))
                     for r in mine], ab_cfg)))
            if d.get("lookup_reads"):
                floor = host_ms + d["lookup_reads"]["us_per_call_p50"] / 1e3
                d.update(floor_ms=floor, floor_ratio=d["step_ms_median"] / floor)


def _held_to(ratios: list[float], ab_cfg: stats.ABConfig | None) -> tuple[float, list[float], str]:
    """Samples' step ÷ bound ratios -> their median, its bootstrap interval (``stats.median_ci``) and the
    verdict: "met" when the interval lies at or below ``BOUND_FACTOR``, "missed" above it, else "undecided"."""
    lo, hi = stats.median_ci(ratios, ab_cfg or stats.ABConfig())
    return _median(ratios), [lo, hi], "met" if hi <= BOUND_FACTOR else "missed" if lo > BOUND_FACTOR else "undecided"


def disk_rows(comparisons: list[dict]) -> list[dict]:
    """The second table: one row per disk arm per comparison."""
    return [{"batch": c["batch"], "disk arm": f"{label} {json.dumps(d['arm'])}", "step ms": d["step_ms_median"],
             "step p50 ms": d["step_ms_p50_median"], "slow steps": d["slow_steps"],
             "host step ms": d["host_step_ms_median"], "read ops/step": d["read_ops_per_step_median"],
             "raw reads/s": d["raw_read_ops_per_s"], "bound ms": d["bound_ms"], "ratio": d["ratio"],
             "raw reads/s, samples": d["raw_read_ops_per_s_samples_median"], "paired ratio": d["ratio_paired"],
             "paired CI": "{:.4f}…{:.4f}".format(*d["ratio_paired_ci"]) if d["ratio_paired_ci"] else None,
             "paired target": d["paired_target"], "raw reads/s, after": d["raw_read_ops_per_s_after_median"],
             "bracketed ratio": d["ratio_bracketed"],
             "bracketed CI": "{:.4f}…{:.4f}".format(*d["ratio_bracketed_ci"]) if d["ratio_bracketed_ci"] else None,
             "bracketed target": d["bracketed_target"],
             "lookup reads ms": d["lookup_reads"]["us_per_call_p50"] / 1e3 if d.get("lookup_reads") else None,
             "floor ms": d["floor_ms"], "floor ratio": d["floor_ratio"], "hit warm-up": d["hit_rate_cold_warmup"],
             "hit cold": d["hit_rate_cold"], "hit warm": d["hit_rate_warm"]}
            for c in comparisons for label, d in c.get("disk", {}).items()]
