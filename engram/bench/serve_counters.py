"""The engine's counters over a measured window, from the server's ``GET /engram/steps`` (engine/step_trace.py):
``fetch_steps`` reads the step records after a step id and the engine's stats snapshot (None from a server without the
endpoint), ``window_counters`` sums the window's records and the stats' counters' growth, ``speculative_window`` the
acceptance of speculative decoding over it."""
from __future__ import annotations

from collections import Counter

from engram.engine.step_trace import StepRecord, StepTrace

KINDS = ("decode", "mixed", "prefill")
STAT_COUNTERS = ("graph_replays", "mixed_graph_replays", "lookup_exposed_s", "preemptions", "steps")


def fetch_steps(url: str, since: int = -1, timeout: float = 120.0) -> tuple[list[StepRecord], dict] | None:
    """(records after step ``since``, stats) from ``url``; None when the server has no ``/engram/steps`` (404/405).
    Other failures raise, naming the URL."""
    import httpx

    r = httpx.get(url.rstrip("/") + "/engram/steps", params={"since": since}, timeout=timeout)
    if r.status_code in (404, 405):
        return None
    if r.status_code != 200:
        raise RuntimeError(f"GET {url}/engram/steps?since={since}: HTTP {r.status_code}: {r.text[:200]}")
    body = r.json()
    return StepTrace.from_json(body), body.get("stats", {})


def window_counters(records: list[StepRecord], before: dict, after: dict, wall: float) -> dict:
    """Steps by route and kind, eager steps (and the fewest tokens an eager step of each kind had), the device's busy
    and idle seconds (None on the CPU) and idle's share of ``wall``, and the growth of the stats counters between the
    ``before`` and ``after`` snapshots (``steps_delta``: steps launched, which exceeds the records when a step failed
    or the trace dropped old records), and the steps' lookup counters, per kind and in all (``lookup_counters``).
    The window's first step's ``idle_s`` is left out: it spans the pause between the warm-up and the window."""
    by_kind = {k: [r for r in records if r.kind == k] for k in KINDS}
    timed = any(r.gpu_s is not None for r in records)  # CUDA; a step without a device clock adds nothing
    idle = [r.idle_s for r in records[1:] if r.idle_s is not None]
    out = {"steps": len(records), "steps_by_route": dict(Counter(r.route for r in records)),
           "steps_by_kind": {k: len(v) for k, v in by_kind.items()},
           "eager_steps": sum(1 for r in records if r.route == "eager"),
           "eager_steps_by_kind": {k: sum(1 for r in v if r.route == "eager") for k, v in by_kind.items()},
           # above the largest graph bucket eager is by design; an eager step at or below it fell back
           "eager_min_tokens_by_kind": {k: min((r.num_tokens for r in v if r.route == "eager"), default=None)
                                        for k, v in by_kind.items()},
           "tokens_by_kind": {k: sum(r.num_tokens for r in v) for k, v in by_kind.items()},
           "gpu_busy_s": _busy(records) if timed else None,
           "gpu_busy_s_by_kind": {k: _busy(v) for k, v in by_kind.items()} if timed else None,
           "gpu_idle_s": sum(idle) if timed else None,
           "gpu_idle_share": sum(idle) / wall if timed and wall > 0 else None,
           "host_gap_p50_s": _pct(idle, 50) if timed else None, "host_gap_p99_s": _pct(idle, 99) if timed else None,
           **lookup_counters(records, by_kind), "hot_cache": cache_window(before, after)}
    for key in STAT_COUNTERS:
        if key in after and key in before:
            out[f"{key}_delta"] = after[key] - before[key]
    return out


def speculative_window(before: dict, after: dict) -> dict | None:
    """Speculative decoding over the window (the stats' ``speculative`` growth): verifying sequence-steps, drafts,
    accepted drafts, the acceptance rate and length (1 + accepted per verifying step); None when the server does not
    speculate."""
    a, b = after.get("speculative"), before.get("speculative")
    if a is None or b is None:
        return None
    steps, drafts, accepted = (a[k] - b[k] for k in ("spec_steps", "draft_tokens", "accepted_tokens"))
    return {"method": a["method"], "num_speculative_tokens": a["num_speculative_tokens"], "spec_steps": steps,
            "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "acceptance_length": 1.0 + accepted / steps if steps else 0.0}


def _busy(records: list[StepRecord]) -> float:
    return sum(r.gpu_s for r in records if r.gpu_s is not None)


def _pct(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def lookup_counters(records: list[StepRecord], by_kind: dict[str, list[StepRecord]]) -> dict:
    """Per step kind and in all: the steps' waits for their rows (``lookup_exposed_s``; replayed graphs measure none,
    counted in ``lookup_unmeasured_steps``), the engine's host gaps, their tables' time by tier, and the Engram ids
    planned and distinct per layer with their ratio (ids / distinct: what deduplication saves)."""
    def part(recs: list[StepRecord]) -> dict:
        gather: Counter[str] = Counter()
        for r in recs:
            gather.update(r.gather_s)
        ids = [sum(col) for col in zip(*(r.ids for r in recs if r.ids))]
        unique = [sum(col) for col in zip(*(r.unique_ids for r in recs if r.unique_ids))]
        return {"lookup_exposed_s": sum(r.lookup_exposed_s or 0.0 for r in recs),
                "lookup_unmeasured_steps": sum(1 for r in recs if r.lookup_exposed_s is None),
                "host_gap_s": sum(r.host_gap_s for r in recs), "gather_s": dict(gather),
                "ids": ids, "unique_ids": unique, "dedup_ratio": [i / u if u else None for i, u in zip(ids, unique)]}

    total = part(records)
    kinds = {k: part(v) for k, v in by_kind.items()}
    return {"lookups": total, "lookups_by_kind": kinds}


def cache_window(before: dict, after: dict) -> dict:
    """The hot-row caches' hits and misses in the window (the growth of the tables' counters), their hit rate (None
    without a cache lookup) and the caches' bytes."""
    def total(stats: dict, key: str) -> int:
        return sum(t.get(key, 0) for t in stats.get("tables", {}).values())

    hits, misses = (total(after, k) - total(before, k) for k in ("hits", "misses"))
    return {"bytes": after.get("hot_cache", {}).get("bytes", 0), "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None}
