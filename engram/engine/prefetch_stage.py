"""Prompt rows ahead of their prefill (worker side): the bounded staging area of the ranges a step's ``prefetch``
field names (engine/prefetch_plan.py), and the step-time read of them.

Who does what, when:

* ``accept(step)`` (``Worker.launch``, before the step runs): drops the ranges of finished and preempted sequences,
  then starts each new range's fetch on the staging thread: per Engram layer ``table.gather_raw`` of the range's
  distinct ids (raw rows, 264 B for MXFP8: values then scale bytes; the disk tier reads them at prompt priority,
  behind decode reads), past the hot-row cache (whose lock a step's lookups need). A range that does not fit
  ``capacity_bytes`` is not staged; it is counted (``skipped``).
  On CUDA the fetch runs on a stream of its own and records an event after it.
* ``overlay(step, layer, rows, ...)`` (``LookupExecutor._finish``): for each ``StagedUse`` of the step, the token
  rows it names get the staged range's rows at its positions (waiting for the fetch if it still runs: that wait is
  exposed time), decoded by ``table.decode_raw`` (bitwise ``gather``). A range this Worker did not stage (full,
  failed, inactive) is gathered directly from the table instead: outputs never depend on staging.
* ``release(step)`` (``Worker.launch``, after the step was launched, also when it failed): a range is freed once a
  step computes up to its end, by the same rule as the engine's book, so both bounds agree.

Inactive (``active=False``: no capacity, or prefill that never reads staging such as the mixed-step CUDA graphs, or
TP column shards) it stages nothing and every use falls back to the direct gather."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import torch

from engram.engine.step import StepDescription
from engram.store import reader
from engram.transfer import to_device


class _Staged:
    """One staged range: its fetch (-> ({layer: raw [U, row_bytes]}, event | None)) and its bytes."""

    def __init__(self, prange, future: cf.Future):
        self.range, self.future = prange, future

    def raw(self, layer_id: int) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        rows, ready = self.future.result()
        return rows[layer_id], ready


class PrefetchStaging:
    """A Worker's staging area of prompt ranges keyed by (sequence id, start, end); see the module docstring."""

    def __init__(self, tables: dict, capacity_bytes: int, device: torch.device, active: bool = True):
        self.tables, self.capacity_bytes, self.device = tables, capacity_bytes, torch.device(device)
        self.active = active and capacity_bytes > 0
        self._ranges: dict[tuple[int, int, int], _Staged] = {}
        self._lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._stream = None
        self.used_bytes = 0
        self.counts = {"staged": 0, "skipped": 0, "failed": 0, "rows_staged": 0, "rows_read": 0, "rows_direct": 0,
                       "wait_s": 0.0}

    # ----------------------------------------------------------------- the book
    def accept(self, step: StepDescription) -> None:
        for seq_id in (*step.finished_seq_ids, *step.prefetch_drop):
            self._drop(lambda key: key[0] == seq_id)
        if not self.active:
            return
        for prange in step.prefetch:
            with self._lock:
                if prange.key in self._ranges:
                    continue
                if self.used_bytes + prange.nbytes > self.capacity_bytes:
                    self.counts["skipped"] += 1
                    continue
                self.used_bytes += prange.nbytes
                self.counts["staged"] += 1
                self.counts["rows_staged"] += prange.end - prange.start
                self._ranges[prange.key] = _Staged(prange, self._thread().submit(self._fetch, prange))

    def release(self, step: StepDescription) -> None:
        """Free the ranges this step's chunks reach the end of (the engine's rule)."""
        reached = {seq_id: s0 + n for seq_id, s0, n in zip(step.seq_ids, step.start_positions, step.num_new_tokens)}
        self._drop(lambda key: key[0] in reached and key[2] <= reached[key[0]])

    def _drop(self, which) -> None:
        with self._lock:
            for key in [k for k in self._ranges if which(k)]:
                staged = self._ranges.pop(key)
                staged.future.cancel()  # a fetch still running finishes, and its rows are dropped with it
                self.used_bytes -= staged.range.nbytes

    # ----------------------------------------------------------------- fetch (staging thread)
    def _thread(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            cuda = self.device.type == "cuda"
            # set_device needs an index; "cuda" alone means the device current where the engine runs
            index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) if cuda else None
            self._stream = torch.cuda.Stream(self.device) if cuda else None
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="engram-prefetch", initializer=(
                (lambda: torch.cuda.set_device(index)) if cuda else None))
        return self._pool

    def _fetch(self, prange) -> tuple[dict[int, torch.Tensor], "torch.cuda.Event | None"]:
        with reader.read_priority(reader.PROMPT):
            if self._stream is None:
                return self._raw_rows(prange), None
            with torch.cuda.stream(self._stream):
                rows = self._raw_rows(prange)
                ready = torch.cuda.Event()
                ready.record(self._stream)
            return rows, ready

    def _raw_rows(self, prange) -> dict[int, torch.Tensor]:
        """{layer: raw rows uint8 [U, row_bytes]} of a range's distinct ids, past the hot-row cache."""
        return {lid: self.tables[lid].gather_raw(d.unique, cached=False) for lid, d in prange.dedup.items()
                if lid in self.tables}  # a pipeline stage holds its own layers' tables

    # ----------------------------------------------------------------- the step's read
    def overlay(self, step: StepDescription, layer_id: int, rows: torch.Tensor, table, fetch_dtype: torch.dtype,
                n_cols: int) -> float:
        """Write the staged token rows of ``step`` into ``rows`` [T * n_cols, D] (model dtype, device) -> seconds
        spent waiting for fetches still running."""
        waited = 0.0
        for use in step.staged_uses:
            ids = step.engram_row_ids[layer_id][use.row:use.row + use.count]  # [count, n_cols]
            staged = self._ranges.get(use.key) if self.active else None
            part = None
            if staged is not None:
                t0 = time.monotonic()
                try:
                    raw, ready = staged.raw(layer_id)  # [U, row_bytes]
                except Exception:  # a failed fetch: those rows are gathered directly below, as without prefetch
                    self.counts["failed"] += 1
                else:
                    if ready is not None:
                        torch.cuda.current_stream(self.device).wait_event(ready)
                        raw.record_stream(torch.cuda.current_stream(self.device))
                    at = use.offset * n_cols  # the range's inverse entries of the used positions
                    inverse = staged.range.dedup[layer_id].inverse[at:at + use.count * n_cols]
                    part = table.decode_raw(raw.index_select(0, to_device(inverse, raw.device)), fetch_dtype)
                    self.counts["rows_read"] += use.count
                waited += time.monotonic() - t0
            if part is None:
                part = table.gather(ids.reshape(-1), dtype=fetch_dtype)
                self.counts["rows_direct"] += use.count
            rows[use.row * n_cols:(use.row + use.count) * n_cols] = part.to(rows.device, rows.dtype)
        self.counts["wait_s"] += waited
        return waited

    def stats(self) -> dict:
        """Ranges staged / skipped (full) / failed, prompt positions staged, token rows read from staging and gathered
        directly instead, seconds waited for fetches, bytes in use and the capacity."""
        return {**self.counts, "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes,
                "active": self.active}
