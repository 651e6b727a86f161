"""The disk arms of ``engram bench placement``: the disk's raw random 4 KiB read rate (``measure_raw_reads``, at the
step's depth, around the samples since it drifts) and the bound a disk step is held to (``add_bounds``): host-tier step
ms + read ops per step / raw read ops/s x 1000, target ratio <= ``BOUND_FACTOR``."""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Callable

from engram.bench import stats
from engram.bench.placement_arms import ArmSpec

DISK_COLUMNS = ["batch", "disk arm", "step ms", "step p50 ms", "slow steps", "host step ms", "read ops/step",
                "raw reads/s", "bound ms", "ratio", "raw reads/s, samples", "paired ratio", "paired CI",
                "paired target", "raw reads/s, after", "bracketed ratio", "bracketed CI", "bracketed target",
                "lookup reads ms", "floor ms", "floor ratio", "hit warm-up", "hit cold",
                "hit warm"]
BOUND_FACTOR = 1.1  # the issue's target: disk step ms <= 1.1 x (host step ms + misses' reads at the raw rate)
NO_HOST_ARM = "bound not computed: no host-tier arm in the run"
ARM_LABELS = {"A": ("A", "A'"), "B": ("B",)}  # the samples of an arm's engine in a comparison, by label


def read_depth(tables: dict, together: bool) -> int:
    """Reads a disk arm's step keeps in flight: the queue depth, times the tables when they read side by side each on a
    queue of its own (``reader.queue_per_thread``)."""
    from engram.store.reader import queue_per_thread

    reader = tables[min(tables)].reader
    return reader.queue_depth * (len(tables) if together and queue_per_thread(reader.io) else 1)


def _raw_calls(tables: dict, pages: int, seconds: float, seed: int, depth: int | None = None) -> tuple:
    """One unrecorded, then ``seconds`` of ``lookup.raw_cell`` calls of ``pages`` random pages of the first table's
    values.bin (its io mode, ``depth``) -> (layer, reader, cell, cell.result())."""
    lid = min(tables)
    reader = tables[lid].reader
    cell = _file_calls(Path(reader.path), reader.io, depth or reader.queue_depth, pages, seconds, seed)
    return lid, reader, cell, cell.result()


def _file_calls(path: Path, io: str, depth: int, pages: int, seconds: float, seed: int):
    """One unrecorded, then ``seconds`` of ``lookup.raw_cell`` calls of ``pages`` random pages of ``path`` (``io``,
    ``depth``; buffered reads drop the file's cached pages before each call) -> the cell."""
    from engram.bench.lookup import raw_cell

    cell = raw_cell(path, {"io": io, "queue_depth": depth}, pages, seed, io == "buffered")
    cell.step()
    cell.run(seconds)
    return cell


def _rate_fields(cell, pages: int) -> dict:
    r = cell.result()
    return {"queue_depth": cell.key["queue_depth"], "pages_per_call": pages, "calls": r["batches"],
            "seconds": sum(cell.times), "read_ops_per_s": r["read_ops_per_s"], "disk_MB_per_s": r["disk_MB_per_s"],
            "us_per_call_p50": r["us_per_batch_p50"]}


def measure_raw_reads(tables: dict, seconds: float, pages: int, seed: int, depth: int | None = None) -> dict:
    """The disk's random 4 KiB read rate now: ``_raw_calls`` for ``seconds`` at ``depth``."""
    lid, reader, cell, _ = _raw_calls(tables, pages, seconds, seed, depth)
    return {"layer": lid, "io": reader.io, "io_requested": reader.io_requested, "cold": reader.io == "buffered",
            **_rate_fields(cell, pages)}


def measure_file_reads(path: str | Path, io: str, depth: int, seconds: float, pages: int, seed: int) -> dict:
    """``measure_raw_reads`` of a table file by path (no table opened): ``io`` as the table read it."""
    cell = _file_calls(Path(path), io, depth, pages, seconds, seed)
    return {"values": str(path), "io": io, "cold": io == "buffered", **_rate_fields(cell, pages)}


def sample_rate(tables: dict, seconds: float, pages: int, seed: int,
                depth: int | None = None) -> Callable[[], float]:
    """The disk's read rate (ops/s) right before one sample: ``measure_raw_reads`` at pages of its own."""
    calls = itertools.count(1)

    def rate() -> float:
        return measure_raw_reads(tables, seconds, pages, seed + next(calls), depth)["read_ops_per_s"]
    return rate


def measure_lookup_reads(tables: dict, read_ops_per_step: float | None, seconds: float, seed: int) -> dict | None:
    """One lookup's reads as a raw call (ceil(read ops per step / tables) pages); None when a step read nothing."""
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
    """A disk arm in one comparison: hit rates cold and warm, read ops, step ms, the raw rate (bounds: add_bounds)."""
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
    """For every disk arm, the bound against a host-tier arm at the same batch (its comparison's other one, else the
    first host-tier B): bound_ms = host step ms + read ops per step / raw read ops/s x 1000, ratio = disk step ms /
    bound_ms, target_met = ratio <= BOUND_FACTOR; without one the fields stay None (``bound_note`` says why)."""
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
    """Step ÷ bound ratios -> median, bootstrap interval, and "met" / "missed" / "undecided" vs ``BOUND_FACTOR``."""
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
