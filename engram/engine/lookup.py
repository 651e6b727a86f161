"""Lookup execution (worker side): a step's planned Engram row ids -> rows staged for the model.
``LookupExecutor.submit(step)`` hands each layer's row ids to its table and returns ``StagedRows`` ([T, n_cols,
head_dim] per layer, tagged with the step id). With a lookup stream (``lookup_overlap``) the gathers and each layer's
projection run on it and a consumer waits for its own layer's event; over host-read tables the first lookup runs when
the model reaches its layer (``ChainedLookups``) and a later one still reading is deferred to its consumer (bitwise
equal to staging everything first)."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import time

import torch

from engram.config import EngramConfig
from engram.engine.lookup_stream import LookupStream
from engram.engine.lookup_timing import LookupTiming, TimingBook, tier_name
from engram.engine.pending import PendingPatch
from engram.engine.prefetch_stage import PrefetchStaging
from engram.engine.row_dedup import host_table_ids
from engram.engine.step import StepDescription
from engram.module import Projected
from engram.store import reader
from engram.store.base import CompletedLookup, LookupHandle
from engram.transfer import to_device

def reads_together(first_ids: int, queue_depth: int | None) -> bool:
    """Whether the later layers' lookups are submitted before the first layer's, reading beside it: only when
    ``first_ids`` fill the table's read queue (``queue_depth``; None: never), so the disk is rate-bound already."""
    return queue_depth is not None and first_ids >= queue_depth


def read_queue_depth(table) -> int | None:
    """The queue depth of a disk-reading table's reader (DiskTable.reader), else None."""
    return getattr(getattr(table, "reader", None), "queue_depth", None)


class StagedRows:
    """Rows of one step, per layer [T, n_cols, head_dim]; ``rows(layer_id, step_id)`` checks the step.
    ``ready(layer_id, rows)``, when given, runs before a staged layer's rows are handed out (the lookup stream's
    wait). ``deferred``: {layer: (handle, finish)} of reads still running at staging; the first ``rows`` of such
    a layer waits and finishes it. ``release()`` cancels deferred reads nobody asked for (a failed step)."""

    def __init__(self, step_id: int, rows: dict[int, torch.Tensor], ready=None, deferred: dict | None = None,
                 timing: LookupTiming | None = None):
        self.step_id = step_id
        self._rows = rows
        self._ready = ready
        self._deferred = dict(deferred or {})
        self.timing = timing  # the step's lookup timing: a deferred layer's wait is time the step stood still

    def rows(self, layer_id: int, step_id: int) -> torch.Tensor:
        if step_id != self.step_id:
            raise RuntimeError(f"stale Engram rows: staged for step {self.step_id}, consumed by step {step_id}")
        if layer_id in self._deferred:
            handle, finish = self._deferred.pop(layer_id)
            t0 = time.monotonic()
            self._rows[layer_id] = finish(handle.wait())  # on the current stream: its consumer needs it now
            if self.timing is not None:
                self.timing.add_exposed(time.monotonic() - t0)
            return self._rows[layer_id]
        if layer_id not in self._rows:
            raise KeyError(f"no staged rows for Engram layer {layer_id} (step {self.step_id} has {sorted(self._rows)})")
        if self._ready is not None:
            self._ready(layer_id, self._rows[layer_id])
        return self._rows[layer_id]

    def release(self) -> None:
        """Cancel the reads of deferred layers never asked for (a running read frees its rows when done)."""
        while self._deferred:
            _, (handle, _) = self._deferred.popitem()
            handle.cancel()


class ChainedLookups:
    """A step's disk-table lookups with the first run late: ``handle(layer)`` is not done until the chain ran.
    The first ``wait`` on any handle runs ``gather_first() -> rows`` on the waiting thread (the model reached that
    layer), then ``submit_later() -> {layer: handle}``; with ``later_first`` (``reads_together``) the later ones
    are submitted right before the first layer's first read (``first_then_later``). Cancelling before the chain
    ran cancels all of it; after, that layer's read. An error of the first lookup or the submits reaches every
    waiter."""

    def __init__(self, first: int, gather_first, submit_later, later_first: bool = False):
        self.first = first
        self._gather_first, self._submit_later = gather_first, submit_later
        self._later_first = later_first  # submit the later layers' lookups right before the first's first read
        self._handles: dict | None = None  # layer -> the real handle, once the chain ran
        self._error: BaseException | None = None
        self._cancelled = False

    def handle(self, layer_id: int) -> "Chained":
        return Chained(self, layer_id)

    def run(self) -> dict:
        if self._handles is None:
            if self._cancelled:
                raise cf.CancelledError("this step's lookups were cancelled")
            if self._error is not None:
                raise self._error
            later: dict = {}
            try:
                if self._later_first:
                    rows = first_then_later(self._gather_first, self._submit_later, later)
                else:
                    rows = self._gather_first()
                    later.update(self._submit_later())
                self._handles = {self.first: CompletedLookup(rows), **later}
            except BaseException as e:
                for handle in later.values():  # submitted, never to be waited for
                    handle.cancel()
                self._error = e
                raise
        return self._handles


def first_then_later(gather_first, submit_later, later: dict):
    """``gather_first()``, with ``submit_later()``'s handles put into ``later`` right before its first disk read here
    (``reader.on_read_start``; an earlier hook runs after), or after it returned if it read nothing here."""
    submitted = False
    before = None

    def submit() -> None:
        nonlocal submitted
        reader.on_read_start(before)  # once
        submitted = True
        later.update(submit_later())
        if before is not None:
            before()

    before = reader.on_read_start(submit)
    try:
        rows = gather_first()
    finally:
        reader.on_read_start(before)
    if not submitted:
        later.update(submit_later())
    return rows


class Chained(LookupHandle):
    """One layer's handle in a ``ChainedLookups``."""

    def __init__(self, chain: ChainedLookups, layer_id: int):
        self.chain, self.layer_id = chain, layer_id

    def wait(self) -> torch.Tensor:
        return self.chain.run()[self.layer_id].wait()

    def done(self) -> bool:
        handles = self.chain._handles
        return handles is not None and handles[self.layer_id].done()

    def cancel(self) -> bool:
        handles = self.chain._handles
        if handles is None:
            self.chain._cancelled = True
            return True
        return handles[self.layer_id].cancel()


class LookupExecutor:
    """Submits every layer's lookup of a step, then waits for all of them, before the model runs."""

    def __init__(self, tables: dict, cfg: EngramConfig | None, dtype: torch.dtype, device: torch.device,
                 stream: LookupStream | None = None, projectors: dict | None = None, layer_ids=None):
        # layer_ids: the Engram layers this executor serves (a pipeline stage's own; None: every layer of cfg)
        wanted = (cfg.layer_ids if cfg else ()) if layer_ids is None else layer_ids
        missing = [lid for lid in wanted if lid not in tables]
        if missing:
            raise ValueError(f"no table for Engram layer(s) {missing} (tables cover {sorted(tables)})")
        self.tables = tables
        self.cfg = cfg
        self.dtype = dtype
        # Tables serve at most float32 on CUDA (the Triton gather); every table value is exact in float32,
        # so float64 models read float32 rows and widen them.
        self.fetch_dtype = torch.float32 if dtype == torch.float64 else dtype
        self.device = torch.device(device)
        self.stream = stream  # lookup_overlap: gathers on their own stream, an event per layer
        # WKV run-ahead (with a stream): layer id -> Engram.project of its rows, run on the lookup stream too
        self.projectors = projectors if stream is not None else None
        # prompt ranges staged ahead (prefetch_stage.py; the Worker's): steps' StagedUses read them, and without it
        # (inactive) those rows are gathered directly
        self.staging = PrefetchStaging(tables, 0, self.device, active=False)
        self.tiers = {lid: tier_name(t) for lid, t in tables.items()}  # what each layer's time counts under
        # tables that take any ids (not a TP column shard, which reads its columns of [T * n_cols])
        self.dedupes = {lid: not getattr(t, "column_layout", False) for lid, t in tables.items()}
        self._timings = TimingBook()  # each step's LookupTiming, until the Worker takes it at collect

    def submit(self, step: StepDescription, patch: PendingPatch | None = None, project: bool = True,
               slabs: dict | None = None, host_ids: HostIds | None = None) -> StagedRows:
        """Stage every layer's rows of ``step``. ``patch`` (async scheduling: some ids exist only on the device):
        tables that gather device ids patch and gather there; the others (host-read tables; every table on the CPU)
        get the patched ids on the host after one synchronisation. ``project``: with a lookup stream and projectors,
        stage each layer's projection (False: the rows, for a graph that projects them). ``slabs``: {layer: slab}
        read into the slab and not decoded (engine/runners/pieces.py); their ``rows`` is None once the pages are in.
        ``host_ids``: an earlier ``start_host_ids(step, patch)`` (else called here)."""
        deferred: dict = {}
        timing = self._timings.new(step.step_id)
        if self.stream is None:
            t0 = time.monotonic()  # without a stream the step waits for all of its staging
            rows = self._stage(step, patch, lambda lid, rows: None, deferred, slabs, host_ids, timing)
            timing.add_exposed(time.monotonic() - t0)
            return StagedRows(step.step_id, rows, deferred=deferred, timing=timing)

        def done(layer_id: int, rows: dict) -> None:
            if project and self.projectors:  # the layer gets its rows' projection (Engram.project), made ahead
                rows[layer_id] = self.projectors[layer_id](rows[layer_id])
            self.stream.done(layer_id)

        with self.stream.issue(*([patch.rows, *patch.row_ids.values()] if patch is not None else [])):
            rows = self._stage(step, patch, done, deferred, slabs, host_ids, timing)
        return StagedRows(step.step_id, rows, ready=functools.partial(self._wait, step.step_id), deferred=deferred,
                          timing=timing)

    def _wait(self, step_id: int, layer_id: int, staged) -> None:
        self.stream.wait(layer_id, *(staged.tensors if isinstance(staged, Projected) else (staged,)), tag=step_id)

    def take_timing(self, step_id: int) -> LookupTiming | None:
        """The timing of step ``step_id``'s lookups (once), with the lookup stream's measured waits folded in; None
        when this executor staged nothing for it (a CUDA-graph replay gathers inside the graph)."""
        timing = self._timings.take(step_id)
        if timing is not None and self.stream is not None:
            timing.add_exposed(self.stream.pop_exposed(step_id))
        return timing

    def _stage(self, step: StepDescription, patch: PendingPatch | None, done, deferred: dict,
               slabs: dict | None = None, early: HostIds | None = None,
               timing: LookupTiming | None = None) -> dict[int, torch.Tensor]:
        """Every layer's rows [T, n_cols, D] on the current stream, ``done(layer, rows)`` after each; a later layer
        whose reads still run goes to ``deferred`` as (handle, finish), and so do ``slabs`` layers (rows None)."""
        handles: dict = {}
        slabs = slabs or {}

        def dedup_of(lid: int):  # the layer's deduplicated ids, where its table takes them (not slabs, not shards)
            dd = step.engram_dedup.get(lid) if self.dedupes[lid] and lid not in slabs else None
            # and only when its slots are the patch's rows (a draft model's patch covers rows the plan never saw)
            return dd if dd is None or dd.patch_slots == (0 if patch is None else patch.rows.numel()) else None

        try:
            if patch is None or not self.takes_device_ids():
                # host ids: the first layer's lookup runs on this thread (no hand-off and back); the later layers'
                # are submitted before it (reads_together) or after it
                host_ids = (step.engram_row_ids if patch is None else early.wait() if early is not None else
                            self._host_ids(step, patch))
                layers = list(host_ids)
                # [T * n_cols] each, CPU int64: the step's distinct ids where it was deduplicated (row_dedup.py)
                flat = {lid: host_table_ids(step, dedup_of(lid), host_ids[lid]) for lid in layers}
                alone = not layers or not reads_together(flat[layers[0]].numel(),
                                                         read_queue_depth(self.tables[layers[0]]))
                # over the disk tier the first lookup waits until the model reaches its layer (see above)
                lazy = bool(layers) and (bool(slabs) or alone and getattr(self.tables[layers[0]], "reads_from_disk",
                                                                          False))

                def gather_first() -> torch.Tensor | None:
                    first, t0 = layers[0], time.monotonic()
                    if first in slabs:
                        rows = self.tables[first].read_slab(flat[first], slabs[first],
                                                            plan=step.step_id)
                    else:
                        rows = self.tables[first].gather(flat[first], dtype=self.fetch_dtype)
                    if timing is not None:
                        timing.add_gather(self.tiers[first], time.monotonic() - t0)
                    return rows

                def submit_later() -> dict:
                    out = {}
                    for lid in layers[1:]:
                        t0 = time.monotonic()
                        handle = self.tables[lid].submit(flat[lid], dtype=self.fetch_dtype,
                                                         **({"into": slabs[lid], "plan": step.step_id}
                                                            if lid in slabs else {}))
                        out[lid] = timing.track(self.tiers[lid], handle, t0) if timing is not None else handle
                    return out

                if lazy:
                    chain = ChainedLookups(layers[0], gather_first, submit_later, later_first=not alone)
                    handles.update({lid: chain.handle(lid) for lid in layers})
                else:
                    if not alone:
                        handles.update(submit_later())
                    if layers:
                        handles[layers[0]] = CompletedLookup(gather_first())
                    if alone:
                        handles.update(submit_later())

                def fetch(lid: int, ids: torch.Tensor) -> torch.Tensor:
                    return handles[lid].wait()
            else:
                # device ids, patched where tokens are in flight
                def fetch(lid: int, ids: torch.Tensor) -> torch.Tensor:
                    t0 = time.monotonic()
                    dedup = dedup_of(lid)
                    dev_ids = (dedup.patched_unique(patch.row_ids[lid]) if dedup is not None  # [U + P * n_cols]
                               else patch.patched(to_device(ids, self.device), patch.row_ids[lid]).reshape(-1))
                    rows = self.tables[lid].gather(dev_ids, dtype=self.fetch_dtype)
                    if timing is not None:  # the host's part: the gather itself runs on the device
                        timing.add_gather(self.tiers[lid], time.monotonic() - t0)
                    return rows
            rows = {}
            for i, (lid, ids) in enumerate(step.engram_row_ids.items()):
                dedup = dedup_of(lid)
                finish = _read_only if lid in slabs else functools.partial(
                    self._finish, shape=ids.shape, inverse=dedup.inverse if dedup is not None else None,
                    staged=(step, lid, timing) if dedup is not None and step.staged_uses else None)
                if lid in handles and not handles[lid].done() and (i > 0 or isinstance(handles[lid], Chained)):
                    deferred[lid] = (handles[lid], finish)
                    continue
                rows[lid] = finish(fetch(lid, ids))
                done(lid, rows)
            return rows
        except BaseException:
            # A failed read (or submit) fails this step only: every lookup it started is dropped, so none
            # keeps its table's in-flight slot (max_inflight) once the step is gone. Consumed handles ignore it.
            deferred.clear()
            for handle in handles.values():
                handle.cancel()
            raise

    def start_host_ids(self, step: StepDescription, patch: PendingPatch) -> HostIds:
        """Every layer's row ids [T, n_cols], pending rows patched in (on the lookup stream, if any), on a non-blocking
        copy to the host (``wait()`` gives them); main-stream work queued after this does not delay them."""
        if self.stream is None:
            return self._ids_to_host(step, patch)
        with self.stream.issue(patch.rows, *patch.row_ids.values()):
            return self._ids_to_host(step, patch)

    def _host_ids(self, step: StepDescription, patch: PendingPatch) -> dict[int, torch.Tensor]:
        """The step's row ids on the host, patched and copied on the current stream and waited for now."""
        return self._ids_to_host(step, patch).wait()

    def _ids_to_host(self, step: StepDescription, patch: PendingPatch) -> HostIds:
        """``start_host_ids`` on the current stream."""
        layers = list(step.engram_row_ids)
        if not layers:
            return HostIds([], None, None)
        patched = torch.stack([patch.patched(to_device(step.engram_row_ids[lid], self.device), patch.row_ids[lid])
                               for lid in layers])
        if self.device.type != "cuda":
            return HostIds(layers, patched, None)
        host = torch.empty(patched.shape, dtype=patched.dtype, pin_memory=True)
        host.copy_(patched, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        return HostIds(layers, host, arrived)

    def _finish(self, flat: torch.Tensor, shape: torch.Size, inverse: torch.Tensor | None = None,
                staged: tuple | None = None) -> torch.Tensor:
        """A layer's fetched rows [T * n_cols, head_dim] (or, deduplicated, [U, head_dim] expanded through
        ``inverse`` [T * n_cols]) -> [T, n_cols, D] on the device in the model's dtype; ``staged`` (step, layer,
        timing): the step's token rows staged ahead are written in from the staging area."""
        rows = flat.to(self.device, self.dtype)
        if inverse is not None:
            rows = rows.index_select(0, to_device(inverse, self.device))  # [T * n_cols, D]
        if staged is not None:
            step, lid, timing = staged
            waited = self.staging.overlay(step, lid, rows, self.tables[lid], self.fetch_dtype, shape[1])
            if timing is not None:
                timing.add_exposed(waited)
        return rows.reshape(shape[0], shape[1], -1)

    def takes_device_ids(self) -> bool:
        """Whether ``submit`` serves a patch without a host synchronisation: every table gathers device ids as device
        work (CUDA: tier gpu, tier host without a hot-row cache)."""
        return self.device.type == "cuda" and all(t.gathers_on_device for t in self.tables.values())

    def stats(self) -> dict[int, dict[str, int]]:
        """Each table's counters (lookups, rows, hits, misses, bytes_read, ...), by Engram layer id."""
        return {lid: t.stats() for lid, t in self.tables.items()}


class HostIds:
    """A step's patched row ids on their way to the host (``LookupExecutor.start_host_ids``)."""

    def __init__(self, layers: list[int], ids: torch.Tensor | None, arrived: "torch.cuda.Event | None"):
        self.layers, self._ids, self._arrived = layers, ids, arrived

    def wait(self) -> dict[int, torch.Tensor]:
        """{layer: [T, n_cols] CPU int64}, once the copy has run."""
        if self._arrived is not None:
            self._arrived.synchronize()
        return dict(zip(self.layers, self._ids.unbind(0))) if self.layers else {}


def _read_only(nothing: None) -> None:
    """The finish of a layer read into a slab: nothing to decode here (its decode graph does it)."""
    return nothing


def staging_bytes(cfg: EngramConfig, max_tokens: int, dtype: torch.dtype, layers=None) -> int:
    """Peak bytes of a step's staged rows: per layer (of ``layers``; None: every Engram layer) the [T * n_cols, D]
    gather and its reshape into the model dtype."""
    per_layer = 2 * max_tokens * cfg.n_cols * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()
    return per_layer * len(cfg.layer_ids if layers is None else layers)
