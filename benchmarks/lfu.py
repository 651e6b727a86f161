"""Exact simulation of a fully associative LFU row cache over a step trace, vectorized per step: the ideal
LFU beside `engram bench hit-rate`'s LRU curve and the engine's own RowCache.

    python -m benchmarks.lfu --corpus bench/corpus/natural-v1.jsonl [--case 4b-like=builtin] [--sizes 0.1,1,10]
        [--requests N] [--out FILE.json]

Its cases, sizes, --concurrency, --warmup and --requests mean what `engram bench hit-rate`'s do, so the LFU
rates of a run line up with hit-rate's LRU and RowCache rates of the same options.

Policy (textbook in-cache LFU): a row enters with count 1 and gains 1 per step that reads it while cached;
when a step's misses need room, the cached rows with the smallest (count, last step used, row id) are
evicted, never a row the current step read; misses are admitted in ascending id order while there is room,
the rest are served but not cached (a step with more distinct rows than the cache). A row's count is lost
when it is evicted. No aging (the engine's ``RowCache`` halves counts over time and is set associative;
``engram bench hit-rate --rowcache lfu`` simulates that one directly, more slowly).

How: rows are renumbered densely; per-row state is three arrays (cached, count, last step). Eviction order
needs no sorted structure: every row enters the bucket of its count at the step it reaches that count, so
the bucket of count c, appended to in step order, is already sorted by (last step, row id) and works as a
FIFO with lazy deletion (an entry is live while its row is cached with that count and step). Counts up to
``FIFO_COUNTS`` have FIFOs; higher counts share one pool that is sorted only when a victim must come from
it (rare: it holds the hottest rows). ``lfu_reference`` is the same policy as a plain Python loop.
"""
from __future__ import annotations

import argparse
import heapq
import json

import numpy as np

FIFO_COUNTS = 32
POOL_SLACK = 65536  # the pool is deduplicated once it holds this many more entries than 4 x the capacity


class _Fifo:
    """Append-only (row, step) queue with a head pointer; appends within a step are in ascending row order."""

    def __init__(self) -> None:
        self.rows = np.empty(1024, dtype=np.int64)
        self.steps = np.empty(1024, dtype=np.int64)
        self.head = self.tail = 0

    def append(self, rows: np.ndarray, step: int) -> None:
        n = rows.size
        if self.tail + n > self.rows.size:
            live = self.tail - self.head
            size = max(2 * (live + n), 1024)
            for name in ("rows", "steps"):
                old = getattr(self, name)
                new = np.empty(size, dtype=np.int64)
                new[:live] = old[self.head:self.tail]
                setattr(self, name, new)
            self.head, self.tail = 0, live
        self.rows[self.tail:self.tail + n] = rows
        self.steps[self.tail:self.tail + n] = step
        self.tail += n


class LfuCache:
    """State of one simulated cache of ``capacity`` rows over dense row ids [0, num_rows)."""

    def __init__(self, capacity: int, num_rows: int) -> None:
        if capacity < 1:
            raise ValueError(f"LFU capacity={capacity}: must be >= 1")
        self.capacity = capacity
        self.cached = np.zeros(num_rows, dtype=bool)
        self.count = np.zeros(num_rows, dtype=np.int64)
        self.last = np.full(num_rows, -1, dtype=np.int64)
        self.size = 0
        self.fifos: dict[int, _Fifo] = {}
        self.live_counts: list[int] = []  # heap of counts whose FIFO may hold live entries
        self.pool = [np.empty(0, dtype=np.int64)]  # rows that reached a count > FIFO_COUNTS (may repeat)
        self.pool_len = 0

    def _enter(self, rows: np.ndarray, counts: np.ndarray, step: int) -> None:
        """Record that ``rows`` (ascending) reached ``counts`` at ``step``."""
        high = counts > FIFO_COUNTS
        if high.any():
            self.pool.append(rows[high])
            self.pool_len += int(high.sum())
            if self.pool_len > 4 * self.capacity + POOL_SLACK:  # hot rows re-enter every step
                self._compact_pool()
            rows, counts = rows[~high], counts[~high]
        if rows.size == 0:
            return
        order = np.argsort(counts, kind="stable")  # group by count, rows stay ascending inside a group
        rows, counts = rows[order], counts[order]
        starts = np.flatnonzero(np.concatenate([[True], counts[1:] != counts[:-1]]))
        for i, s in enumerate(starts):
            c = int(counts[s])
            fifo = self.fifos.get(c)
            if fifo is None:
                fifo = self.fifos[c] = _Fifo()
            if fifo.head == fifo.tail:
                heapq.heappush(self.live_counts, c)
            fifo.append(rows[s: starts[i + 1] if i + 1 < starts.size else rows.size], step)

    def _victims(self, k: int, step: int) -> tuple[np.ndarray, list[int]]:
        """Up to ``k`` cached rows not used at ``step``, smallest (count, last step, row id) first; and the
        counts whose FIFO was set aside because only this step's entries are left in it."""
        out: list[np.ndarray] = []
        deferred: list[int] = []
        while k > 0 and self.live_counts:
            c = self.live_counts[0]
            fifo = self.fifos[c]
            blocked = False
            while k > 0 and fifo.head < fifo.tail:
                end = min(fifo.tail, fifo.head + max(2 * k, 256))
                r, st = fifo.rows[fifo.head:end], fifo.steps[fifo.head:end]
                now = np.flatnonzero(st == step)  # this step's entries close the FIFO and are untouchable
                limit = int(now[0]) if now.size else r.size
                r, st = r[:limit], st[:limit]
                live = np.flatnonzero(self.cached[r] & (self.count[r] == c) & (self.last[r] == st))
                take = live[:k]
                out.append(r[take])
                k -= take.size
                fifo.head += int(take[-1]) + 1 if k == 0 and take.size else limit
                if now.size:
                    blocked = True
                    break
            if fifo.head == fifo.tail or blocked:
                heapq.heappop(self.live_counts)
                if blocked:
                    deferred.append(c)
        if k > 0:
            out.append(self._pool_victims(k, step))
        return (np.concatenate(out) if out else np.empty(0, dtype=np.int64)), deferred

    def _compact_pool(self) -> np.ndarray:
        """The pool as one array of distinct rows still cached with a count above ``FIFO_COUNTS``."""
        rows = np.unique(np.concatenate(self.pool))
        rows = rows[self.cached[rows] & (self.count[rows] > FIFO_COUNTS)]
        self.pool, self.pool_len = [rows], rows.size
        return rows

    def _pool_victims(self, k: int, step: int) -> np.ndarray:
        rows = self._compact_pool()
        cand = rows[self.last[rows] < step]
        return cand[np.lexsort((cand, self.last[cand], self.count[cand]))[:k]]

    def step(self, rows: np.ndarray, step: int) -> np.ndarray:
        """Serve one step's distinct, ascending dense ``rows``; returns their hit flags."""
        hit = self.cached[rows]
        hits = rows[hit]
        self.count[hits] += 1
        self.last[hits] = step
        self._enter(hits, self.count[hits], step)
        miss = rows[~hit]
        need = miss.size - (self.capacity - self.size)
        if need > 0:
            victims, deferred = self._victims(need, step)
            self.cached[victims] = False
            self.size -= victims.size
            miss = miss[: self.capacity - self.size]
            for c in deferred:
                heapq.heappush(self.live_counts, c)
        self.cached[miss] = True
        self.count[miss] = 1
        self.last[miss] = step
        self.size += miss.size
        self._enter(miss, self.count[miss], step)
        return hit


def lfu_hits(dense: np.ndarray, step_bounds: np.ndarray, capacity: int) -> np.ndarray:
    """Hit flags of the LFU cache above (``capacity`` rows, started empty) over a trace of dense row ids
    (``reuse_index``; ascending ids stay ascending) whose step s is ``dense[step_bounds[s]:step_bounds[s+1]]``
    (distinct, ascending within a step)."""
    cache = LfuCache(capacity, int(dense.max(initial=-1)) + 1)
    hits = np.zeros(dense.size, dtype=bool)
    for s in range(step_bounds.size - 1):
        a, b = int(step_bounds[s]), int(step_bounds[s + 1])
        if a < b:
            hits[a:b] = cache.step(dense[a:b], s)
    return hits


def lfu_reference(rows: np.ndarray, step_bounds: np.ndarray, capacity: int) -> np.ndarray:
    """The same policy, one row at a time in plain Python (for tests; slow)."""
    cache: dict[int, tuple[int, int]] = {}  # row -> (count, last step)
    hits = np.zeros(len(rows), dtype=bool)
    for s in range(len(step_bounds) - 1):
        a, b = int(step_bounds[s]), int(step_bounds[s + 1])
        step_rows = [int(x) for x in rows[a:b]]
        for i, r in enumerate(step_rows):
            if r in cache:
                hits[a + i] = True
                cache[r] = (cache[r][0] + 1, s)
        for i, r in enumerate(step_rows):
            if hits[a + i]:
                continue
            if len(cache) >= capacity:
                cands = [(c, last, row) for row, (c, last) in cache.items() if last < s]
                if not cands:
                    continue
                del cache[min(cands)[2]]
            cache[r] = (1, s)
    return hits


def main(argv: list[str] | None = None) -> int:
    """LFU hit rates cold and warm per cache size, per Engram layer of each case, over a corpus served as
    `engram bench hit-rate` serves it."""
    from engram.bench.corpus import load_corpus
    from engram.bench.hit_rate import SIZES_PCT, case_traces, cold_warm, warm_start_of
    from engram.bench.report import format_table, write_result
    from engram.bench.stack_distance import reuse_index

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", required=True, help="corpus file from `engram bench corpus`")
    p.add_argument("--case", action="append", default=None, metavar="LAYOUT=TOKENIZER",
                   help="as engram bench hit-rate's (default: 4b-like=builtin)")
    p.add_argument("--sizes", default=",".join(f"{x:g}" for x in SIZES_PCT), help="cache sizes, %% of table rows")
    p.add_argument("--concurrency", type=int, default=64, help="requests served at once")
    p.add_argument("--warmup", type=float, default=0.5, help="share of the accesses before warm statistics start")
    p.add_argument("--requests", type=int, default=None, help="use the corpus's first N requests (default all)")
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file in a temporary directory)")
    args = p.parse_args(argv)
    corpus = load_corpus(args.corpus)
    corpus.requests = corpus.requests[:args.requests]
    sizes = [float(x) for x in args.sizes.split(",") if x.strip()]
    rows = []
    for spec in args.case or ["4b-like=builtin"]:
        layout, _, tokenizer = spec.partition("=")
        for trace in case_traces(corpus, layout, tokenizer, concurrency=args.concurrency).traces:
            dense, warm = reuse_index(trace.rows)[1], warm_start_of(trace, args.warmup)
            for pct in sizes:
                cap = max(1, int(round(pct / 100 * trace.table_rows)))
                rates = cold_warm(lfu_hits(dense, trace.step_bounds, cap), trace.order, warm)
                rows.append({"case": spec, "layer": trace.layer_id, "size %": pct, "rows": cap,
                             "LFU cold": rates["cold"]["rate"], "LFU warm": rates["warm"]["rate"]})
                print(json.dumps(rows[-1]), flush=True)
    path = write_result("lfu", vars(args), {"corpus_sha256": corpus.sha256, "rows": rows}, out=args.out)
    print(format_table(rows, floatfmt="{:.3f}"))
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
