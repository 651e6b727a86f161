"""``merge_stats``: one ``engine.stats()`` snapshot of M data-parallel replicas, as metrics read one engine's. Counts
and seconds add up (queues, KV blocks, preemptions, steps, every table's counters by layer, prefix-cache counts);
ratios are recomputed from the sums (KV usage, prefix-cache hit rates, speculative acceptance); ``replicas`` lists each one's pid, queues
and KV usage. A replica that has not stepped yet counts its KV blocks from its ready report."""
from __future__ import annotations

from typing import Any

RATIOS = ("kv_usage", "block_hit_rate", "token_hit_rate")


def _add(a: Any, b: Any) -> Any:
    """a + b for numbers, key by key for dicts, all() for flags; other values keep the first."""
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) and bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a + b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
    return a


def merge_stats(snapshots: list[dict | None], infos: list) -> dict[str, Any]:
    """``snapshots``: each replica's latest engine.stats() (None before its first step); ``infos``: their
    dp_replica.ReplicaInfo."""
    merged: dict[str, Any] = {}
    for snap, info in zip(snapshots, infos):
        snap = snap if snap is not None else {"running": 0, "waiting": 0, "kv_blocks_total": info.num_kv_blocks,
                                              "kv_blocks_free": info.num_kv_blocks, "tables": {}}
        own = {k: v for k, v in snap.items() if k not in RATIOS}
        merged = _add(merged, own) if merged else own
    total = merged.get("kv_blocks_total", 0)
    merged["kv_usage"] = 1.0 - merged.get("kv_blocks_free", 0) / total if total else 0.0
    prefix = merged.get("prefix_cache")
    if isinstance(prefix, dict):
        prefix["block_hit_rate"] = prefix["hit_blocks"] / prefix["queried_blocks"] if prefix.get("queried_blocks") \
            else 0.0
        prefix["token_hit_rate"] = prefix["hit_tokens"] / prefix["queried_tokens"] if prefix.get("queried_tokens") \
            else 0.0
    spec = merged.get("speculative")
    if isinstance(spec, dict):  # speculative decoding: the same config on every replica, counts added
        firsts = [snap["speculative"] for snap in snapshots if snap is not None and "speculative" in snap]
        spec["num_speculative_tokens"] = firsts[0]["num_speculative_tokens"]
        spec["accepted_at"] = [sum(col) for col in zip(*(f["accepted_at"] for f in firsts))]
        spec["acceptance_rate"] = spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else 0.0
        spec["mean_acceptance_length"] = 1.0 + spec["accepted_tokens"] / spec["spec_steps"] if spec["spec_steps"] \
            else 0.0
    merged["replicas"] = [{"index": info.index, "pid": info.pid,
                           **({k: snap.get(k) for k in ("running", "waiting", "kv_usage")} if snap else
                              {"running": 0, "waiting": 0, "kv_usage": 0.0})}
                          for snap, info in zip(snapshots, infos)]
    return merged
