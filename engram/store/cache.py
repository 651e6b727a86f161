"""Vectorized hot-row cache in front of a slow tier (host, disk): set-associative, LRU or LFU with aging.

The bookkeeping lives on the host (numpy views, a fixed number of operations per lookup), so hits, misses and
victims never wait for a GPU; only the bytes live on ``device``. Rows touched by the current lookup are never
evicted by it; misses beyond a set's ways are served but not cached; the cache never changes what a lookup
returns::

    tags   [n_sets, ways] int64     set s = ((id * 0x9E3779B97F4A7C15) >> 32) mod n_sets; -1 empty
    stamp  [n_sets, ways] int64     lookup call that last touched the slot (LRU key, LFU tie-break)
    freq   [n_sets, ways] int64     uses since insert, halved every `capacity` lookups (LFU aging)
    values [n_sets * ways, value_bytes] uint8     slot = set * ways + way"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from engram.store.ids import as_ids
from engram.store.kernels.cache_probe import HASH_MUL
from engram.transfer import to_device

POLICIES = ("lru", "lfu")
_HASH_MUL = np.int64(HASH_MUL)  # 0x9E3779B97F4A7C15 as a signed int64 (Fibonacci hashing)
SLOT_OVERHEAD_BYTES = 24  # tag + stamp + freq per slot (host memory)

STAGING_RING = 4  # pinned buffers of _insert's uploads a cache keeps (RowCache._upload)
Fetch = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


class RowCache:
    """Hot rows of one table: bytes on ``device``, bookkeeping on the host; ``capacity_rows`` rounds down to sets."""

    def __init__(self, capacity_rows: int, value_bytes: int, scale_cols: int = 0, *, policy: str = "lru",
                 ways: int = 8, device: torch.device | str = "cpu") -> None:
        if capacity_rows < 1:
            raise ValueError(f"cache capacity_rows={capacity_rows} must be >= 1")
        if policy not in POLICIES:
            raise ValueError(f"cache_policy={policy!r} must be one of {POLICIES}")
        if ways < 1:
            raise ValueError(f"cache ways={ways} must be >= 1")
        if value_bytes < 1 or scale_cols < 0:
            raise ValueError(f"value_bytes={value_bytes} / scale_cols={scale_cols} are invalid")
        self.ways = min(ways, capacity_rows)
        self.n_sets = capacity_rows // self.ways
        self.capacity = self.n_sets * self.ways
        self.policy, self.value_bytes, self.scale_cols = policy, value_bytes, scale_cols
        self.device = torch.device(device)
        kw = dict(dtype=torch.int64)  # the bookkeeping: on the host, whatever the device
        self.tags = torch.full((self.n_sets, self.ways), -1, **kw)
        self.stamp = torch.zeros((self.n_sets, self.ways), **kw)
        self.freq = torch.zeros((self.n_sets, self.ways), **kw)
        # numpy views of the same memory (never reallocated: clear() fills in place): what the lookups use
        self._tags, self._stamp, self._freq = self.tags.numpy(), self.stamp.numpy(), self.freq.numpy()
        self.values = torch.zeros((self.capacity, value_bytes), dtype=torch.uint8, device=self.device)
        self.scales = (torch.zeros((self.capacity, scale_cols), dtype=torch.uint8, device=self.device)
                       if scale_cols else None)
        self._values, self._scales = self.values, self.scales  # + overflow rows (reserve_overflow), for slots()
        self.overflow_rows = 0
        self._handed_out = False
        self.reads: dict[int, "torch.cuda.Event"] = {}  # stream -> an event after its last read of the storage
        # _insert's placements go to the device through pinned buffers kept between calls (_upload): a ring of
        # [buffer, event after its last copy out]
        self._staging: list[list] = [[None, None] for _ in range(STAGING_RING)]
        self._staging_turn = 0
        self.dev_tags: torch.Tensor | None = None  # the tags mirrored on ``device`` (mirror_tags), for device probes
        self.clock = 0  # lookup calls so far; stamps are 1-based so 0 means "never touched"
        self._since_aging = 0
        self.reset_counters()

    @classmethod
    def rows_for_bytes(cls, nbytes: int, value_bytes: int, scale_cols: int = 0) -> int:
        """How many rows a cache of ``nbytes`` (data plus per-slot bookkeeping) holds."""
        return int(nbytes) // (value_bytes + scale_cols + SLOT_OVERHEAD_BYTES)

    @staticmethod
    def bytes_for_rows(rows: int, value_bytes: int, scale_cols: int = 0) -> int:
        return int(rows) * (value_bytes + scale_cols + SLOT_OVERHEAD_BYTES)

    @property
    def nbytes(self) -> int:
        return self.bytes_for_rows(self.capacity, self.value_bytes, self.scale_cols)

    @property
    def evictions(self) -> int:
        """Cached rows replaced by others."""
        return self._evictions

    def counters(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions}

    def reset_counters(self) -> None:
        self.hits = self.misses = 0
        self._evictions = 0

    def clear(self) -> None:
        """Forget every row (counters are kept)."""
        self.tags.fill_(-1)
        self.stamp.zero_()
        self.freq.zero_()
        if self.dev_tags is not None:
            self._wait_readers()
            self.dev_tags.fill_(-1)

    def mirror_tags(self) -> torch.Tensor:
        """The tags [n_sets, ways] mirrored on the cache's device from now on; each insert writes them after the rows'
        bytes, on the current stream, so a tag found there means its row is in place."""
        if self.dev_tags is None:
            self.dev_tags = self.tags.to(self.device, copy=True)
        return self.dev_tags

    def __len__(self) -> int:
        """Rows currently cached."""
        return int((self.tags >= 0).sum())

    def __repr__(self) -> str:
        return (f"RowCache(capacity={self.capacity}, sets={self.n_sets}, ways={self.ways}, policy={self.policy!r}, "
                f"device={self.device})")

    def set_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Set index of each id: int64 [N] in [0, n_sets)."""
        return torch.from_numpy(self._set_of(_host_ids(ids)))

    def _set_of(self, ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            h = ((ids * _HASH_MUL) >> 32) & 0x7FFFFFFF  # int64 multiply wraps: a 64-bit Fibonacci hash
        return h % self.n_sets

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id (int64 [N] on the host, -1 when not cached); pure, touches nothing."""
        return torch.from_numpy(self._lookup(_host_ids(ids)))

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        sets = self._set_of(ids)
        match = self._tags[sets] == ids[:, None]  # [N, ways]
        return np.where(match.any(axis=1), sets * self.ways + match.argmax(axis=1), -1)

    def fetch(self, ids: torch.Tensor, fetch: Fetch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of distinct ``ids`` [U] on the cache device: hits, and ``fetch(miss_ids)``'s rows (any device), then
        cached -> (values [U, value_bytes], scales [U, scale_cols] | None)."""
        ids = _host_ids(ids)
        u = len(ids)
        hit_pos, hit_slots, miss_pos = self._hits(ids)
        vals = torch.empty((u, self.value_bytes), dtype=torch.uint8, device=self.device)
        scales = torch.empty((u, self.scale_cols), dtype=torch.uint8, device=self.device) if self.scale_cols else None
        if len(hit_pos):
            dev_pos, dev_slots = to_device(torch.from_numpy(np.stack([hit_pos, hit_slots])),
                                           self.device).unbind(0)  # one upload
            vals.index_copy_(0, dev_pos, self.values.index_select(0, dev_slots))
            if scales is not None:
                scales.index_copy_(0, dev_pos, self.scales.index_select(0, dev_slots))
            self.note_read()
        if len(miss_pos):
            miss_ids, mv, ms = self._fetch_misses(ids, miss_pos, fetch)
            dev_miss = to_device(torch.from_numpy(miss_pos), self.device)
            vals.index_copy_(0, dev_miss, mv)
            if scales is not None:
                scales.index_copy_(0, dev_miss, ms)
            self._insert(miss_ids, mv, ms)
        self._finish_call(u, len(miss_pos))
        return vals, scales

    def slots(self, ids: torch.Tensor, fetch: Fetch) -> torch.Tensor:
        """Slots int64 [U] (host, rows of ``storage()``) of distinct ``ids``: hits, misses fetched and cached, or past a
        full set the overflow rows (``reserve_overflow``), rewritten by the next call; written on the current stream."""
        return torch.from_numpy(self.slots_np(_host_ids(ids), fetch))

    def slots_np(self, ids: np.ndarray, fetch: Fetch) -> np.ndarray:
        """``slots`` of host ids int64 [U] as numpy (the disk tier's decode-graph reads call it per step)."""
        u = len(ids)
        if u > self.overflow_rows:
            raise ValueError(f"{u} ids in one call, but the cache reserved {self.overflow_rows} overflow rows "
                             "(reserve_overflow)")
        hit_pos, hit_slots, miss_pos = self._hits(ids)
        if not len(miss_pos):  # a decode step's usual case
            self._finish_call(u, 0)
            return hit_slots
        slots = np.empty(u, dtype=np.int64)
        slots[hit_pos] = hit_slots
        miss_ids, mv, ms = self._fetch_misses(ids, miss_pos, fetch)
        placed = self._insert(miss_ids, mv, ms)  # [M] slot, -1 where the set could not take the row
        spill = np.flatnonzero(placed < 0)  # [K]
        if len(spill):
            over = self.capacity + np.arange(len(spill))
            placed[spill] = over
            dev_over, dev_spill = to_device(torch.from_numpy(np.stack([over, spill])), self.device).unbind(0)
            self._write(self._values, self._scales, dev_over, mv, ms, dev_spill)
        slots[miss_pos] = placed
        self._finish_call(u, len(miss_pos))
        return slots

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """First half of a call whose caller reads the misses (a probed slab) -> (hit positions, their slots, miss
        positions); ``admit`` ends the call."""
        return self._hits(ids)

    def admit(self, miss_ids: np.ndarray, vals: torch.Tensor | None, scales: torch.Tensor | None, looked_up: int,
              missed: int | None = None, recheck: bool = False) -> None:
        """Second half: cache ``miss_ids`` [M] with their rows on the current stream and count the call. ``recheck``
        skips ids cached since the split (late caching); without it nothing may have been inserted."""
        missed = len(miss_ids) if missed is None else missed
        if len(miss_ids):
            new = np.flatnonzero(self._lookup(miss_ids) < 0) if recheck else np.arange(len(miss_ids))
            if len(new) < len(miss_ids):
                keep = to_device(torch.from_numpy(new), vals.device)
                miss_ids, vals = miss_ids[new], vals.index_select(0, keep)
                scales = scales.index_select(0, keep) if scales is not None else None
            if len(miss_ids):
                self._insert(miss_ids, *self._on_device(vals, scales))
        self._finish_call(looked_up, missed)

    def reserve_overflow(self, rows: int) -> None:
        """Let ``slots`` place up to ``rows`` ids a call (rows after ``capacity`` in ``storage()``); keeps the cache."""
        if rows <= self.overflow_rows:
            return
        if self._handed_out:
            raise RuntimeError(f"the cache's storage was handed out (storage()) with {self.overflow_rows} overflow "
                               f"rows; growing it to {rows} would move it under its readers")
        grown = torch.zeros((self.capacity + rows, self.value_bytes), dtype=torch.uint8, device=self.device)
        grown[:self.capacity].copy_(self.values)
        self._values, self.values = grown, grown[:self.capacity]
        if self._scales is not None:
            grown = torch.zeros((self.capacity + rows, self.scale_cols), dtype=torch.uint8, device=self.device)
            grown[:self.capacity].copy_(self.scales)
            self._scales, self.scales = grown, grown[:self.capacity]
        self.overflow_rows = rows

    def storage(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values uint8 [capacity + overflow, value_bytes], scales | None), never moved (graphs hold them)."""
        self._handed_out = True
        return self._values, self._scales

    def _hits(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A call's start: tick, touch the hits -> (hit positions [H], slots [H], miss positions [M]) in ``ids``."""
        self.clock += 1
        slots = self._lookup(ids)  # [U]
        hit = slots >= 0
        if hit.all():
            hit_pos, hit_slots, miss_pos = np.arange(len(ids)), slots, np.empty(0, dtype=np.int64)
        else:
            hit_pos, miss_pos = np.flatnonzero(hit), np.flatnonzero(~hit)  # [H], [M] positions in ids
            hit_slots = slots[hit_pos]
        self._stamp.reshape(-1)[hit_slots] = self.clock
        self._freq.reshape(-1)[hit_slots] += 1  # ids distinct: slots distinct
        return hit_pos, hit_slots, miss_pos

    def _fetch_misses(self, ids: np.ndarray, miss_pos: np.ndarray,
                      fetch: Fetch) -> tuple[np.ndarray, torch.Tensor, torch.Tensor | None]:
        """(miss ids [M] on the host, their values [M, value_bytes] and scales on the cache's device)."""
        miss_ids = ids[miss_pos]
        mv, ms = fetch(torch.from_numpy(miss_ids))  # backing tiers (host RAM, disk) index with CPU ids
        return miss_ids, *self._on_device(mv, ms)

    def _on_device(self, vals: torch.Tensor, scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows to cache (any device) -> values [M, value_bytes] and scales on the cache's device (via pinned)."""
        mv = to_device(vals[:, : self.value_bytes], self.device)
        return mv, to_device(scales, self.device) if scales is not None and self.scale_cols else None

    def _finish_call(self, looked_up: int, missed: int) -> None:
        self.hits += looked_up - missed
        self.misses += missed
        self._age(looked_up)

    def _insert(self, ids: np.ndarray, vals: torch.Tensor, scales: torch.Tensor | None) -> np.ndarray:
        """Place missed ``ids`` [M], evicting each set's lowest-key way untouched this call -> slots [M], -1: full."""
        m = len(ids)
        sets = self._set_of(ids)
        order = np.argsort(sets, kind="stable")  # [M] misses grouped by set
        s_sorted = sets[order]
        pos = np.arange(m)
        first = np.ones(m, dtype=bool)
        first[1:] = s_sorted[1:] != s_sorted[:-1]
        rank = pos - np.maximum.accumulate(np.where(first, pos, 0))  # [M] rank within its set
        tags = self._tags[s_sorted]  # [M, ways]
        stamp = self._stamp[s_sorted]
        key = stamp if self.policy == "lru" else (self._freq[s_sorted] << 40) | stamp
        key = np.where(tags < 0, -1, key)  # empty ways go first
        victims = np.argsort(key, axis=1, kind="stable")  # [M, ways] eviction order of each miss's set
        way = np.take_along_axis(victims, np.minimum(rank, self.ways - 1)[:, None], axis=1)[:, 0]  # [M]
        victim_stamp = np.take_along_axis(stamp, way[:, None], axis=1)[:, 0]
        victim_tag = np.take_along_axis(tags, way[:, None], axis=1)[:, 0]
        sel = np.flatnonzero((rank < self.ways) & (victim_stamp != self.clock))  # never evict what this call touched
        slot = s_sorted[sel] * self.ways + way[sel]  # [K] distinct slots
        src = order[sel]  # [K] positions in ids / vals
        self._evictions += int((victim_tag[sel] >= 0).sum())
        self._tags.reshape(-1)[slot] = ids[src]
        self._stamp.reshape(-1)[slot] = self.clock
        self._freq.reshape(-1)[slot] = 1
        placed = np.full(m, -1, dtype=np.int64)
        if not len(slot):
            return placed
        placed[src] = slot
        dev_slot, dev_src, dev_ids = self._upload(slot, src, ids[src]).unbind(0)  # one upload
        self._write(self.values, self.scales, dev_slot, vals, scales, dev_src)
        if self.dev_tags is not None:  # after the bytes (mirror_tags)
            self.dev_tags.view(-1).index_copy_(0, dev_slot, dev_ids)
        return placed

    def _upload(self, *rows: np.ndarray) -> torch.Tensor:
        """Host int64 arrays of one length K -> one [len(rows), K] device tensor in one copy, through a ring of
        STAGING_RING pinned buffers reused once their copy ran (else ``to_device``): never a host wait."""
        if self.device.type != "cuda":
            return torch.from_numpy(np.stack(rows)).to(self.device)
        n = len(rows) * len(rows[0])
        slot = self._staging[self._staging_turn]
        if slot[1] is not None and not slot[1].query():  # the device lags this far behind: a fresh buffer
            return to_device(torch.from_numpy(np.stack(rows)), self.device)
        self._staging_turn = (self._staging_turn + 1) % STAGING_RING
        if slot[0] is None or slot[0].numel() < n:
            slot[0] = torch.empty(max(n, 2 * (0 if slot[0] is None else slot[0].numel())), dtype=torch.int64,
                                  pin_memory=True)
        staged = slot[0][:n]
        np.stack(rows, out=staged.numpy().reshape(len(rows), -1))
        dev = staged.view(len(rows), -1).to(self.device, non_blocking=True)
        slot[1] = torch.cuda.Event()
        slot[1].record(torch.cuda.current_stream(self.device))
        return dev

    def _write(self, values: torch.Tensor, scales: torch.Tensor | None, dst: torch.Tensor, vals: torch.Tensor,
               vscales: torch.Tensor | None, src: torch.Tensor) -> None:
        """Rows ``src`` of ``vals`` / ``vscales`` into storage rows ``dst`` on the current stream, after its readers."""
        self._wait_readers()
        values.index_copy_(0, dst, vals.index_select(0, src))
        if scales is not None:
            scales.index_copy_(0, dst, vscales.index_select(0, src))

    def _wait_readers(self) -> None:
        """Make the current stream wait for every stream's last read of the storage (a graph's gather may be queued)."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for event in list(self.reads.values()):
                stream.wait_event(event)

    def note_read(self, event: "torch.cuda.Event | None" = None) -> None:
        """The storage was just read on the current stream (``event``: one already recorded after the read)."""
        if self.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(self.device)
        if event is None:
            event = torch.cuda.Event()
            event.record(stream)
        self.reads[stream.stream_id] = event

    def _age(self, looked_up: int) -> None:
        """LFU aging: halve every count once per ``capacity`` rows looked up, so old heat fades."""
        if self.policy != "lfu":
            return
        self._since_aging += looked_up
        if self._since_aging >= self.capacity:
            self.freq.bitwise_right_shift_(1)
            self._since_aging = 0


def _host_ids(ids: torch.Tensor) -> np.ndarray:
    """Row ids (any integer tensor, any device) as host int64 numpy (store/ids.py ``as_ids``, then a view)."""
    return as_ids(ids).cpu().numpy()
