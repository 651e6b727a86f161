"""Tables read side by side, the one the model needs first leading: one budget of reads in flight, shared.

A step that reads its Engram tables together (engine/lookup.py, ``reads_together``) reads each table on a
thread of its own; with O_DIRECT each thread has its own Linux AIO context (reader.queue_per_thread), so the
tables' reads share the disk's queue evenly and end about together, and the first Engram layer, which the
model reaches first, waits for nearly all of them. ``SharedReads(budget, tables)`` orders them instead: the
first table's reads *lead* (its context has ``budget - FOLLOW_FLOOR * (tables - 1)`` slots) and the others
*follow* (each keeps ``FOLLOW_FLOOR`` reads in flight while the lead still has reads to submit, then fills
what the lead's reads in flight leave of the budget: csrc/aio_reader.c). The reads in flight stay within
``budget`` (the depth the disk tier's bound measures its raw rate at: bench/disk_bound.read_depth), the first
table's reads end at about its share of the step's reads ÷ the disk's rate, and the layers up to the next
Engram layer run while the later tables' reads go on. The bytes read are the same; only their order on the
disk changes.

Use: ``with shared.announced():`` around the step's submits, ``with shared.following():`` around the later
tables' (``DiskTable.submit`` hands the share to the table's thread), ``with shared.leading():`` around the
first table's. The announcement makes followers that start before the lead's read hold back; the lead's
first read ends it once all its blocks are submitted, or leaving ``announced`` withdraws it. Reads that do
not go through a thread's AIO context (buffered reads, the thread pools, a lookup's chunks on a table's I/O
threads) read as before.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

try:
    from engram.store import _pread_pool
except ImportError:  # no C reader: nothing reads through AIO, so nothing is shared (reader.py warns)
    _pread_pool = None

FOLLOW_FLOOR = _pread_pool.FOLLOW_FLOOR if _pread_pool is not None else 8
_local = threading.local()  # per thread: .share (the ReadSide its reads take), .announced (a lead to come)


@dataclass(frozen=True)
class ReadSide:
    """How one thread's AIO reads share the disk: ``depth``, its context's slots; ``lead`` or ``follow`` (the
    budget a follower fills, csrc/aio_reader.c)."""
    depth: int
    lead: bool
    follow: int = 0

    def keywords(self) -> dict:
        """Aio.read's keywords for this side's next read; a lead's first read after ``announced`` ends the
        announcement (lead=2, on every path through the C call)."""
        if not self.lead:
            return {"follow": self.follow}
        announced, _local.announced = getattr(_local, "announced", False), False
        return {"lead": 2 if announced else 1}


@dataclass(frozen=True)
class SharedReads:
    """One step's reads of ``tables`` tables side by side within ``budget`` reads in flight (module doc)."""
    budget: int
    tables: int

    @classmethod
    def of(cls, queue_depth: int | None, tables: int, per_thread: bool) -> "SharedReads | None":
        """The share of ``tables`` tables each reading at ``queue_depth`` on its thread's own queue
        (``per_thread``: reader.queue_per_thread), or None where there is nothing to share: one table, no
        disk, a shared pool, no C reader, or a depth below FOLLOW_FLOOR or a budget past an AIO context's
        1024 slots."""
        if (_pread_pool is None or not per_thread or queue_depth is None or tables < 2
                or queue_depth < FOLLOW_FLOOR or queue_depth * tables > 1024):
            return None
        return cls(queue_depth * tables, tables)

    @property
    def lead(self) -> ReadSide:
        return ReadSide(self.budget - FOLLOW_FLOOR * (self.tables - 1), lead=True)

    @property
    def follower(self) -> ReadSide:
        return ReadSide(self.budget, lead=False, follow=self.budget)

    @contextlib.contextmanager
    def announced(self):
        """Followers hold back to FOLLOW_FLOOR from here until this thread's next leading read has submitted
        all its blocks; withdrawn on leaving if no leading read came (every row cached, an error)."""
        _pread_pool.lead_expect(1)
        _local.announced = True
        try:
            yield self
        finally:
            if _local.announced:
                _local.announced = False
                _pread_pool.lead_expect(-1)

    def leading(self):
        """This thread's reads lead while inside."""
        return reading_as(self.lead)

    def following(self):
        """This thread's reads, and the lookups it submits to tables' threads, follow while inside."""
        return reading_as(self.follower)


def current() -> ReadSide | None:
    """The side this thread's reads take (None: unshared)."""
    return getattr(_local, "share", None)


@contextlib.contextmanager
def reading_as(side: ReadSide | None):
    """This thread's reads take ``side`` while inside (None: unshared); restored after."""
    before = current()
    _local.share = side
    try:
        yield
    finally:
        _local.share = before
