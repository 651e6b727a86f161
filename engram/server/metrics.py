"""Prometheus metrics of the server (``engram_*``, own registry). Engine gauges and table counters come from
the ``engine.stats()`` snapshot taken after each step, so a scrape never touches the engine.
"""
from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
TABLE_COUNTERS = ("lookups", "rows", "unique_rows", "hits", "misses", "evictions", "bytes_read", "read_ops",
                  "corrupt_pages")


class ServerMetrics:
    def __init__(self, model_name: str, tier: str):
        self.registry = CollectorRegistry()
        self.model_name, self.tier = model_name, tier
        r = self.registry
        self.requests = Counter("engram_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("engram_requests_rejected", "Requests refused before running", ["reason"], registry=r)
        self.prompt_tokens = Counter("engram_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("engram_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("engram_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("engram_time_per_output_token_seconds", "Mean time between output tokens of a request",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("engram_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0, "tables": {}}
        r.register(_SnapshotCollector(self))

    def update(self, snapshot: dict[str, Any]) -> None:
        """After each step (from the engine client's reader thread): keep the engine's ``stats()`` snapshot."""
        with self._lock:
            self._snapshot = snapshot

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._snapshot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def collect(self):
        snap = self.m.snapshot()
        yield GaugeMetricFamily("engram_num_requests_running", "Sequences in the running batch", value=snap["running"])
        yield GaugeMetricFamily("engram_num_requests_waiting", "Sequences waiting to be scheduled",
                                value=snap["waiting"])
        yield GaugeMetricFamily("engram_kv_cache_usage_ratio", "Fraction of KV blocks in use", value=snap["kv_usage"])
        yield CounterMetricFamily("engram_num_preemptions", "Sequences preempted by recompute",
                                  value=snap["preemptions"])
        yield CounterMetricFamily("engram_lookup_exposed_seconds",
                                  "Seconds Engram layers of eager steps waited for their lookups (lookup_overlap)",
                                  value=snap.get("lookup_exposed_s", 0.0))
        yield from _prefix_cache_families(snap.get("prefix_cache"))
        yield from _speculative_families(snap.get("speculative"))
        for key in TABLE_COUNTERS:
            fam = CounterMetricFamily(f"engram_table_{key}", f"Engram table {key} (cumulative)",
                                      labels=["layer", "tier"])
            for lid, stats in snap["tables"].items():
                fam.add_metric([str(lid), self.m.tier], float(stats.get(key, 0)))
            yield fam


PREFIX_CACHE_COUNTERS = {"queries": "Admissions that looked for a cached prefix",
                         "queried_blocks": "Full prompt blocks admissions could have reused",
                         "hit_blocks": "Blocks reused from the prefix cache",
                         "queried_tokens": "Tokens admissions had to compute without the cache",
                         "hit_tokens": "Tokens reused from the prefix cache instead of computed",
                         "resets": "Prefix-cache resets (POST /reset_prefix_cache)"}


def _prefix_cache_families(stats: dict | None):
    """``engram_prefix_cache_*`` from the snapshot's ``prefix_cache`` entry (nothing before the first step)."""
    if stats is None:
        return
    for key, doc in PREFIX_CACHE_COUNTERS.items():
        yield CounterMetricFamily(f"engram_prefix_cache_{key}", doc, value=stats[key])
    yield GaugeMetricFamily("engram_prefix_cache_cached_blocks", "KV blocks registered in the prefix cache",
                            value=stats["cached_blocks"])
    for unit in ("block", "token"):
        yield GaugeMetricFamily(f"engram_prefix_cache_{unit}_hit_rate", f"Share of queried {unit}s found cached",
                                value=stats[f"{unit}_hit_rate"])


SPECULATIVE_COUNTERS = {"spec_steps": ("num_drafts", "Sequence-steps that verified drafts"),
                        "draft_tokens": ("num_draft_tokens", "Draft tokens verified"),
                        "accepted_tokens": ("num_accepted_tokens", "Draft tokens accepted")}


def _speculative_families(stats: dict | None):
    """``engram_spec_decode_*`` (vLLM's names) from the snapshot's ``speculative`` entry (none without speculation)."""
    if stats is None:
        return
    for key, (name, doc) in SPECULATIVE_COUNTERS.items():
        yield CounterMetricFamily(f"engram_spec_decode_{name}", doc, value=stats[key])
    yield GaugeMetricFamily("engram_spec_decode_mean_acceptance_length", "1 + accepted drafts per verifying step",
                            value=stats["mean_acceptance_length"])
