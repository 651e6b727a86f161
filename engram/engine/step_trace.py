"""The engine's record of the steps it ran, for serving benchmarks and the serving roofline: one ``StepRecord`` a
collected step (its shape as totals, the runner that ran it, and on CUDA its GPU time and the GPU's idle time before
it, from events around the step's work), the last ``capacity`` kept. ``StepTrace.since(step_id)`` returns the records
after a step id, so a client can take the records of one measured window."""
from __future__ import annotations

import collections
import threading
from dataclasses import astuple, dataclass, field, fields

DEFAULT_CAPACITY = 1 << 17  # records kept (about 40 MB of Python tuples at most)


@dataclass(frozen=True)
class StepRecord:
    """One step as totals: ``attended`` is the causal (query, key) pairs of its attention, Σ n·(c − n) + n·(n + 1)/2
    over its sequences (n new tokens, c KV entries after the step); ``kv_read`` is Σ c."""

    step_id: int
    # the step runner that ran it: "graph", "mixed-graph", "verify-graph", "verify-piecewise", "piecewise", "eager"
    route: str
    num_tokens: int
    num_seqs: int
    num_decode: int  # sequences computing exactly one token
    sampled: int  # LM-head rows
    kv_read: int
    attended: int
    gpu_s: float | None  # the step's device work, first kernel to the sampled ids' copy (CUDA), else None
    idle_s: float | None  # the device's idle time between the step before and this one (CUDA), else None
    # the engine's wall time between the step before being read and this one's launch (0 when it was launched ahead)
    host_gap_s: float = 0.0
    lookup_exposed_s: float | None = None  # time it waited for its Engram rows (lookup_timing.py); None: a replay
    gather_s: dict = field(default_factory=dict)  # tier -> seconds its tables took to produce the rows
    ids: tuple = ()  # Engram row ids planned per layer (layer order)
    unique_ids: tuple = ()  # of which distinct (what a deduplicated lookup gathers), per layer

    @classmethod
    def from_shape(cls, step_id: int, route: str, new_tokens: list[int], context_lens: list[int], sampled: int,
                   gpu_s: float | None = None, idle_s: float | None = None, **lookups) -> "StepRecord":
        """``lookups``: host_gap_s, lookup_exposed_s, gather_s, ids, unique_ids."""
        attended = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(new_tokens, context_lens))
        return cls(step_id, route, sum(new_tokens), len(new_tokens), sum(1 for n in new_tokens if n == 1), sampled,
                   sum(context_lens), attended, gpu_s, idle_s, **lookups)

    @property
    def kind(self) -> str:
        """"decode" (every sequence one token), "prefill" (none), or "mixed"."""
        if self.num_decode == self.num_seqs:
            return "decode"
        return "prefill" if self.num_decode == 0 else "mixed"


FIELDS = tuple(f.name for f in fields(StepRecord))


class StepTrace:
    """A bounded, append-only log of StepRecords in step order; the engine's thread appends while a server's reads."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.steps_by_route: collections.Counter[str] = collections.Counter()  # every step since start
        self.steps_by_kind: collections.Counter[str] = collections.Counter()
        self.gpu_busy_s = 0.0  # Σ gpu_s
        self.gpu_idle_s = 0.0  # Σ idle_s
        self.host_gap_s = 0.0  # Σ host_gap_s
        self.lookup_exposed_s = 0.0  # Σ lookup_exposed_s (steps that measured it)
        self.gather_s: collections.Counter[str] = collections.Counter()  # tier -> Σ gather_s
        self.ids = 0  # Σ ids over layers
        self.unique_ids = 0  # Σ unique_ids over layers

    def append(self, record: StepRecord) -> None:
        with self._lock:
            self._records.append(record)
        self.steps_by_route[record.route] += 1
        self.steps_by_kind[record.kind] += 1
        self.gpu_busy_s += record.gpu_s or 0.0
        self.gpu_idle_s += record.idle_s or 0.0
        self.host_gap_s += record.host_gap_s
        self.lookup_exposed_s += record.lookup_exposed_s or 0.0
        self.gather_s.update(record.gather_s)
        self.ids += sum(record.ids)
        self.unique_ids += sum(record.unique_ids)

    def totals(self) -> dict:
        """Counters since start: steps by route and by kind, the device's busy and idle seconds, the host gaps, the
        steps' lookup waits (``lookup_exposed_s``), their tables' time by tier and the ids planned and distinct."""
        return {"steps_by_route": dict(self.steps_by_route), "steps_by_kind": dict(self.steps_by_kind),
                "gpu_busy_s": self.gpu_busy_s, "gpu_idle_s": self.gpu_idle_s, "host_gap_s": self.host_gap_s,
                "lookup_exposed_s": self.lookup_exposed_s, "gather_s_by_tier": dict(self.gather_s),
                "lookup_ids": self.ids, "lookup_unique_ids": self.unique_ids}

    def since(self, step_id: int = -1) -> list[StepRecord]:
        """The kept records of steps after ``step_id`` (all with -1), oldest first."""
        out = []
        with self._lock:
            records = list(self._records)
        for record in reversed(records):
            if record.step_id <= step_id:
                break
            out.append(record)
        return out[::-1]

    def last_step_id(self) -> int:
        with self._lock:
            return self._records[-1].step_id if self._records else -1

    @staticmethod
    def to_json(records: list[StepRecord]) -> dict:
        """{"fields": [...], "steps": [[...], ...]}: one row per record, in FIELDS order."""
        return {"fields": list(FIELDS), "steps": [list(astuple(r)) for r in records]}

    @staticmethod
    def from_json(body: dict) -> list[StepRecord]:
        """The inverse of ``to_json``; ValueError naming the field when the columns differ."""
        if list(body.get("fields", [])) != list(FIELDS):
            raise ValueError(f"step trace fields {body.get('fields')!r}: expected {list(FIELDS)}")
        return [StepRecord(*row[:12], dict(row[12]), tuple(row[13]), tuple(row[14])) for row in body["steps"]]
