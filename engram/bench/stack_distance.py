"""LRU stack distances of an access trace in one pass (Mattson et al., 1970), O(N log N), vectorized numpy: access t to
row x has distance d[t] = the distinct other rows accessed since x's previous access p (-1 for a first), so an LRU cache
of C rows hits t exactly when 0 <= d[t] < C. d[t] = #{j < t: prev[j] < p} - (p + 1), a prefix count below a bound
answered for all t at once by a wavelet matrix over prev + 1."""
from __future__ import annotations

import numpy as np


def reuse_index(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(previous access index or -1, id renumbered 0..D-1 ascending), int64 [N]; ValueError naming a negative id."""
    trace = np.asarray(trace, dtype=np.int64)
    n = trace.size
    prev = np.full(n, -1, dtype=np.int64)
    dense = np.zeros(n, dtype=np.int64)
    if n == 0:
        return prev, dense
    lo, hi = int(trace.min()), int(trace.max())
    if lo < 0:
        raise ValueError(f"trace id {lo}: row ids must be non-negative")
    if hi < (np.iinfo(np.int64).max - n) // n:
        keys = trace * n + np.arange(n, dtype=np.int64)  # sorted by (id, time); unique, so any sort is stable
        keys.sort()
        ids, idx = np.divmod(keys, n)
    else:
        idx = np.argsort(trace, kind="stable")
        ids = trace[idx]
    same = ids[1:] == ids[:-1]
    prev[idx[1:][same]] = idx[:-1][same]
    dense[idx[1:]] = np.cumsum(~same)
    return prev, dense


def previous_access(trace: np.ndarray) -> np.ndarray:
    """``reuse_index(trace)[0]``."""
    return reuse_index(trace)[0]


def _count_below_in_prefix(values: np.ndarray, ends: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """``out[k] = #{j < ends[k]: values[j] < bounds[k]}`` for non-negative ``values``: a wavelet matrix walked by all
    queries at once, most significant bit first."""
    n = values.size
    dt = np.int32 if n < 2**30 else np.int64  # sums like zeros + position stay below 2**31
    cur = values.astype(dt)
    bounds = bounds.astype(dt)
    r = ends.astype(dt)
    l = np.zeros_like(r)
    out = np.zeros_like(r)
    rank0 = np.zeros(n + 1, dtype=dt)  # rank0[i]: zeros among the first i elements of this level
    pos = np.arange(n, dtype=dt)
    nxt = np.empty_like(cur)
    for level in range(int(max(int(values.max(initial=0)), int(bounds.max(initial=0)))).bit_length() - 1, -1, -1):
        bit = (cur >> level) & 1
        np.cumsum(bit ^ 1, out=rank0[1:])
        zeros = rank0[n]
        qbit = (bounds >> level) & 1
        r0 = rank0[r]
        l0 = rank0[l]
        out += qbit * (r0 - l0)
        r = np.where(qbit == 1, zeros + r - r0, r0)
        l = np.where(qbit == 1, zeros + l - l0, l0)
        # stable partition: zeros keep their order at the front, ones after them
        below = rank0[:-1]
        nxt[np.where(bit == 1, zeros + pos - below, below)] = cur
        cur, nxt = nxt, cur
    return out.astype(np.int64)


def stack_distances(trace: np.ndarray, prev: np.ndarray | None = None) -> np.ndarray:
    """LRU stack distance of every access (int64 [N], -1 first); ``prev``: ``previous_access(trace)`` if known."""
    if prev is None:
        prev = previous_access(trace)
    dist = np.full(prev.size, -1, dtype=np.int64)
    reuse = np.flatnonzero(prev >= 0)
    if reuse.size:
        p = prev[reuse]
        dist[reuse] = _count_below_in_prefix(prev + 1, reuse, p + 1) - (p + 1)
    return dist


def lru_hits(dist: np.ndarray, capacity: int) -> np.ndarray:
    """Hit flags of an LRU cache of ``capacity`` rows, started empty, from ``stack_distances``."""
    return (dist >= 0) & (dist < capacity)
