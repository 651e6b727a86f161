"""The piecewise runner's decode steps over disk slabs on the CPU (engine/runners/piecewise.py,
engine/step_lookups.py): ``_SlabPieces`` stands in for DecodePieces inside a real PiecewiseRunner, the Worker's
graph runner, since DecodePieces needs CUDA graphs (the real one: tests/gpu/test_piecewise_graphs.py),
emulating its probe order and its lookups inline or in the background. The tokens are the eager engine's;
lookups finish in order, fail their step only, and go to the background thread only after a step that read
from disk."""
from __future__ import annotations

import sys
import threading

import pytest
import torch

from engram.engine.runners.piecewise import PiecewiseRunner
from engram.engine.sampling_params import SamplingParams
from tests.engine_runs import engine_wrapping_lookup
from tests.unit.test_worker import CountingLookups


class _SlabPieces:
    """DecodePieces' slab flow on the CPU, without CUDA graphs: what PiecewiseRunner reads of it, and a ``run``
    that does what the pieces do for disk layers (decode each layer's slab, which the executor read the
    step's pages into) before the eager forward. Over a hot-row cache it does it in the device's order: each
    layer's slots are resolved from the cache's mirrored tags before the step's lookups run (cache_probe,
    the torch reference, which cannot wait: a layer with a missing row is resolved again after the lookups,
    as a waiting piece would be). The real pieces: tests/gpu/test_piecewise_graphs.py."""

    flags = None  # the real one's probe statuses; the statuses here are counted in ``run`` (``counts``)

    def __init__(self, worker, bucket: int):
        self.worker, self.bucket = worker, bucket
        n_cols = worker.ecfg.n_cols
        self.slabs = {lid: t.new_slab(bucket * n_cols) for lid, t in worker.tables.items()}
        self.probed = [lid for lid, slab in self.slabs.items() if slab.probe is not None]
        self.probes_all = bool(self.probed) and len(self.probed) == len(self.slabs)
        self.replays = 0
        self.counts = {"found": 0, "waited": 0}
        self.lookups_ran = threading.Event()  # set by read_lookups
        self.finished = 0  # finish_lookups calls
        self.read_on: set[str] = set()  # the threads the lookups ran on (their names' first part)
        self.read_threads: list[str] = []  # the same, a step's lookups at a time
        self.last_step_read = True  # DecodePieces.last_step_read: whether the last finished lookups read
        self.failed: list[int] = []  # the step of each layer whose lookup failed (its status FAILED)
        self.aborted: list[int] = []  # steps whose lookups were never started (abort_lookups)
        self.events: list[tuple[str, int]] = []  # ("read" | "finish" | "collected", step id), in order
        self.checked: list[int] = []  # steps whose flags the runner checked (check_flags)

    def fits(self, step) -> bool:
        return all(n == 1 for n in step.num_new_tokens) and len(step.seq_ids) <= self.bucket

    def begin(self, step, patch, whole: bool = False) -> None:
        """The real one queues the pieces before the first Engram layer (all of them with ``whole``); eager,
        ``run`` does the whole step."""
        self.whole = whole

    def _decode(self, lid: int, step, ids: torch.Tensor, status: torch.Tensor | None = None) -> torch.Tensor:
        table = self.worker.tables[lid]
        out = torch.empty(ids.numel(), table.dim, dtype=self.worker.lookup.fetch_dtype)
        probe = {}
        if status is not None:
            probe = dict(ids=ids.reshape(-1), plan=torch.tensor([step.step_id]), status=status)
        table.decode_slab(self.slabs[lid], ids.numel(), out, **probe)
        return out.view(*ids.shape, table.dim)

    def read_lookups(self, step, staged, after_each=None) -> None:
        """The step's lookups (the runner runs them on its background thread): pages into the slabs."""
        try:
            self._read(step, staged, after_each)
        finally:
            staged.release()
            self.lookups_ran.set()

    def _read(self, step, staged, after_each=None) -> None:
        self.read_on.add(threading.current_thread().name.split("_")[0])
        self.read_threads.append(threading.current_thread().name.split("_")[0])
        self.events.append(("read", step.step_id))
        for lid in step.engram_row_ids:
            assert staged.rows(lid, step.step_id) is None  # read into the slab, not staged
            if after_each is not None:
                after_each()

    def abort_lookups(self, step_id: int) -> None:
        """The real one fails the pieces still waiting for the step's flags."""
        self.aborted.append(step_id)

    def finish_lookups(self) -> None:
        """Then the rows read are taken out to be cached (DecodePieces.finish_lookups does the same)."""
        self.finished += 1
        self.events.append(("finish", [step for what, step in self.events if what == "read"][-1]))
        self.last_step_read = any([self.worker.tables[lid].admit_probed(self.slabs[lid]) for lid in self.probed])

    def check_flags(self, step_id: int, flags) -> None:
        """The real one counts the probed layers' statuses read back with the tokens (None here)."""
        assert flags is None
        self.checked.append(step_id)

    def run(self, step, staged, patch):
        from engram.store.kernels import cache_probe

        self.replays += 1
        rows = {}
        status = {lid: torch.zeros(1, dtype=torch.int32) for lid in self.probed}
        if self.whole:  # the pieces resolve their slots before the lookups; those that found every row decode
            for lid in self.probed:
                ids = step.engram_row_ids[lid]
                decoded = self._decode(lid, step, ids, status[lid])
                found = int(status[lid]) == cache_probe.FOUND
                if found:
                    rows[lid] = decoded
                self.counts["found" if found else "waited"] += 1  # a piece that did not find them waits
        if staged is None:  # the runner runs the lookups in the background: the pieces wait for their flags
            assert self.lookups_ran.wait(30)
            self.lookups_ran.clear()
        else:
            self._read(step, staged)
        for lid, ids in step.engram_row_ids.items():
            if lid not in rows:
                rows[lid] = self._decode(lid, step, ids, status.get(lid))
                if lid in status and int(status[lid]) == cache_probe.FAILED:  # its lookup failed: the device
                    self.failed.append(step.step_id)  # pieces go on with the plan's rows; collect raises
        if staged is not None:
            self.finish_lookups()
        return self.worker.eager.run(step, _Decoded(staged, rows), patch)


def _slab_pieces(worker, bucket: int = 8) -> tuple[PiecewiseRunner, _SlabPieces]:
    """The Worker's decode steps (those that fit ``bucket``) through a piecewise runner over ``_SlabPieces``,
    its lookups through the Worker's executor; the eager runner for the rest."""
    pieces = _SlabPieces(worker, bucket)
    runner = PiecewiseRunner(pieces, worker.lookup, worker.device)
    worker.runners = [runner, worker.eager]
    return runner, pieces


class _Decoded:
    """Staged rows with the slab layers' rows decoded (what the pieces hand their layers)."""

    def __init__(self, staged, rows: dict):
        self.staged, self.decoded = staged, rows

    def rows(self, layer_id: int, step_id: int):
        return self.decoded[layer_id] if layer_id in self.decoded else self.staged.rows(layer_id, step_id)

    def release(self) -> None:
        if self.staged is not None:
            self.staged.release()


def _disk_llm(tmp_path, cache_rows: int = 0, queue_depth: int | None = None, wrap_lookup=None, **kw):
    import engram

    options = {key: v for key, v in (("cache_rows", cache_rows), ("queue_depth", queue_depth)) if v}
    llm = engram.LLM("tiny", tier="disk", dtype=torch.float32, device="cpu", cache_dir=str(tmp_path),
                     max_num_seqs=8, max_num_batched_tokens=48, engram_config=options or None, **kw)
    if wrap_lookup is not None:  # the same engine, its Worker built with the wrapped executor
        llm.engine = engine_wrapping_lookup(llm.loaded, llm.engine.config, wrap_lookup, llm.device, llm.dtype)
    return llm


def _generate(llm, n: int = 8) -> list[list[int]]:
    from tests.integration.test_engine import prompts

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(n, seed=3), params, use_tqdm=False)]


@pytest.mark.parametrize("cache_rows", [0, 40, 20000], ids=["no-cache", "40-row-cache", "whole-table-cache"])
def test_slab_decoding_steps_give_the_eager_tokens(tmp_path, cache_rows):
    """Mixed lengths with chunked prefill: the decode-only steps read their pages into slabs through the
    executor (the first layer's on this thread, the later ones' on their tables' threads) and decode them
    as the pieces do; the tokens are the eager engine's. With a hot-row cache the slabs hold slots into the
    cache's storage (a 40-row cache: evictions and overflow rows every step), between prefill chunks that
    go through the cache's fetch, and each layer's slots are first looked for on the device before the
    step's lookups (store/kernels/cache_probe.py): with a cache that holds whole tables, a second pass's
    decode steps find every row there."""
    want = _generate(_disk_llm(tmp_path, cache_rows))
    llm = _disk_llm(tmp_path, cache_rows)
    worker = llm.engine.executor.worker
    runner, pieces = _slab_pieces(worker)
    assert _generate(llm) == want
    assert pieces.replays > 5 and worker.stats()["graph_replays"] == pieces.replays
    assert pieces.checked == [s for what, s in pieces.events if what == "finish"]  # every slab step, in order
    caches = [t.cache for t in worker.tables.values()]
    assert all((c is not None) == bool(cache_rows) for c in caches)
    if cache_rows == 40:  # the slab steps went through the cache, and the cache spilled rows past its slots
        assert all(c.counters()["hits"] > 0 and c.counters()["evictions"] > 0 for c in caches)
    if cache_rows:  # new rows every decode step: the pieces waited for their lookups
        assert pieces.probes_all and pieces.counts["waited"] > 0
    if cache_rows > 1000:  # the same requests again: their rows are cached, the pieces find them on the device
        waited = pieces.counts["waited"]
        assert _generate(llm) == want
        assert pieces.counts["found"] > 0 and pieces.counts["waited"] == waited


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_probed_steps_lookups_beside_the_host_work(tmp_path, monkeypatch, async_scheduling):
    """Over probed slabs (a hot-row cache) the whole step is queued first; its lookups then run on the
    runner's background thread (step_lookups.py), finished (the rows read taken out to be cached) before the
    next step is launched or this one collected: the same tokens, with and without async scheduling (the
    next step launched before this one is read)."""
    want = _generate(_disk_llm(tmp_path, 40))
    sys.setswitchinterval(0.005)
    before_si = sys.getswitchinterval()
    llm = _disk_llm(tmp_path, 40, async_scheduling=async_scheduling)
    worker = llm.engine.executor.worker
    runner, pieces = _slab_pieces(worker)
    real_collect = worker.collect

    def collect(launched):
        pieces.events.append(("collecting", launched.step.step_id))
        result = real_collect(launched)
        pieces.events.append(("collected", launched.step.step_id))
        return result

    monkeypatch.setattr(worker, "collect", collect)
    real_ids = worker.lookup.start_host_ids

    def start_host_ids(step, patch):
        pieces.events.append(("ids", step.step_id))
        return real_ids(step, patch)

    monkeypatch.setattr(worker.lookup, "start_host_ids", start_host_ids)
    assert _generate(llm) == want
    assert pieces.replays > 5 and pieces.counts["waited"] > 0 and not pieces.failed
    # a step's lookups are finished before it is collected, and collecting a step never waits for a later one's
    # (with async scheduling the next step is launched, its lookups started, before this one is read)
    events = pieces.events
    collecting = None
    for what, step in events:
        if what == "read":
            assert events.index(("finish", step)) < events.index(("collected", step))
        collecting = step if what == "collecting" else None if what == "collected" else collecting
        if what == "finish" and collecting is not None:
            assert step <= collecting, f"collecting step {collecting} waited for the lookups of step {step}"
    if async_scheduling:  # the next step's lookups were left pending while a step was read
        assert any(events.index(("read", s + 1)) < i < events.index(("finish", s + 1))
                   for i, (w, s) in enumerate(events) if w == "collected" and ("read", s + 1) in events)
        # and the next step's row ids went to the host before the background lookups were finished: their
        # copy follows the step before's sampler, not the copies into the caches that finishing queues
        early = [events.index(("ids", s + 1)) < events.index(("finish", s))
                 for w, s in events if w == "finish" and ("ids", s + 1) in events]
        assert any(early)
    for what, step in events:  # whatever the order above, a step's ids come before its lookups read
        if what == "ids" and ("read", step) in events:
            assert events.index(("ids", step)) < events.index(("read", step))
    assert runner._lookups.pending_step is None  # the last step's lookups were finished when it was read
    # every step's lookups were finished exactly once (BackgroundLookups.start refuses a second step before)
    assert pieces.finished == pieces.replays
    assert pieces.read_on == {"engram-step-lookups"}  # every step read from disk: each went to the thread
    # the lookup threads get the GIL back from a thread running Python within the shortened interval (a
    # Worker with disk tables sets it: step_lookups.py)
    assert sys.getswitchinterval() < before_si


@pytest.mark.parametrize("together", [False, True], ids=["first-alone", "together-at-first-read"])
def test_probed_steps_caching_their_rows_late_give_the_eager_tokens(tmp_path, monkeypatch, together):
    """store/late_caching.py: each step's rows read are cached during the next step's lookups, on the
    tables' late-caching threads; the tokens are the eager engine's, and every row held is cached in the end
    (the caches end full: far more rows were read than they hold). ``together``: every step's lookups read
    together (a read queue of one id: lookup.reads_together), the later table's submitted at the first
    table's first read; else each step's first lookup alone (a queue deeper than any step's ids)."""
    from engram.engine import lookup

    want = _generate(_disk_llm(tmp_path, 40))
    chained = []
    real_first_then_later = lookup.first_then_later
    monkeypatch.setattr(lookup, "first_then_later", lambda *a: chained.append(1) or real_first_then_later(*a))
    llm = _disk_llm(tmp_path, 40, queue_depth=1 if together else 1024, async_scheduling=True)
    worker = llm.engine.executor.worker
    runner, pieces = _slab_pieces(worker)
    assert _generate(llm) == want
    assert pieces.replays > 5 and "engram-step-lookups" in pieces.read_threads
    for table in worker.tables.values():
        table.slab_reader.late.settle()
        assert table.slab_reader.late._thread is not None  # handed over to its thread
        assert len(table.cache) == table.cache.capacity  # every row held was cached (or evicted one)
    assert bool(chained) == together  # the later lookups went at the first read


def test_lookups_run_in_the_background_only_after_a_step_that_read_from_disk(tmp_path):
    """A step whose rows were all cached has a fraction of a millisecond of lookups, less than the hand-off
    to the background thread costs: the runner runs a step's lookups there only when the step before read
    from disk (DecodePieces.last_step_read). A cache holding whole tables: the first pass reads new rows and
    goes to the thread; the same requests again find every row cached, and after the pass's first step (the
    one after a step that read) the lookups run inline. Same tokens throughout."""
    want = _generate(_disk_llm(tmp_path, 20000))
    llm = _disk_llm(tmp_path, 20000)
    worker = llm.engine.executor.worker
    runner, pieces = _slab_pieces(worker)
    assert _generate(llm) == want
    assert "engram-step-lookups" in pieces.read_threads
    first_pass = len(pieces.read_threads)
    assert _generate(llm) == want
    second = pieces.read_threads[first_pass:]
    assert len(second) > 3 and pieces.counts["found"] > 0
    assert set(second[1:]) == {threading.current_thread().name.split("_")[0]}
    assert runner._lookups.pending_step is None and pieces.finished == pieces.replays


def test_a_failed_background_lookup_fails_its_step_not_the_server(tmp_path, caplog):
    """A read that fails on the background thread fails the pieces waiting for it and its step (collect
    raises the read's own error); the engine runs the step's sequences again, isolated, and the tokens are
    those of a clean run."""
    import errno
    import logging

    from engram.store.reader import Fault

    want = _generate(_disk_llm(tmp_path, 40))
    llm = _disk_llm(tmp_path, 40)
    worker = llm.engine.executor.worker
    runner, pieces = _slab_pieces(worker)
    table = worker.tables[min(worker.tables)]  # the first layer's: a slab step reads it on the background thread
    seen = []

    def once(offsets):  # that table's second read on the background thread fails
        if threading.current_thread().name.startswith("engram-step-lookups"):
            seen.append(len(offsets))
            return Fault(0, errno.EIO) if len(seen) == 2 else None
        return None

    table.reader.fault_hook = once
    with caplog.at_level(logging.WARNING, logger="engram.engine.stepping"):
        assert _generate(llm) == want
    assert len(seen) > 2 and len(set(pieces.failed)) == 1 and "failed (DiskReadError" in caplog.text


def test_lookups_that_cannot_start_fail_the_queued_pieces_and_the_step(tmp_path, monkeypatch, caplog):
    """The whole step is queued before its lookups start: if they cannot start (the background thread
    broken, the row ids' wait failing), the pieces are told to give up at once (abort_lookups) instead of
    waiting for flags nobody will set, and the step fails and runs again."""
    import logging

    want = _generate(_disk_llm(tmp_path, 40))
    llm = _disk_llm(tmp_path, 40)
    worker = llm.engine.executor.worker
    runner, pieces = _slab_pieces(worker)
    real, calls = runner._lookups.start, []

    def broken_once(step_id, read):
        calls.append(step_id)
        if len(calls) == 2:
            raise RuntimeError("the lookup thread is gone")
        return real(step_id, read)

    monkeypatch.setattr(runner._lookups, "start", broken_once)
    with caplog.at_level(logging.WARNING, logger="engram.engine.stepping"):
        assert _generate(llm) == want
    assert pieces.aborted == [calls[1]] and "the lookup thread is gone" in caplog.text


def test_a_wrapped_executor_sees_every_step_slab_decoding_ones_included(tmp_path):
    """A Worker built with a wrapped lookup executor (``wrap_lookup``) submits every step's lookups through it:
    the eager steps' and the slab-decoding steps', whose pages it reads into the pieces' slabs; the steps still
    run in the pieces, and the tokens are the eager engine's."""
    want = _generate(_disk_llm(tmp_path), 2)
    llm = _disk_llm(tmp_path, wrap_lookup=CountingLookups)
    worker = llm.engine.executor.worker
    assert isinstance(worker.lookup, CountingLookups)
    runner, pieces = _slab_pieces(worker)
    assert runner.lookup is worker.lookup and worker.eager.lookup is worker.lookup
    assert _generate(llm, 2) == want
    assert pieces.replays > 5 and worker.lookup.calls == llm.engine.num_steps > pieces.replays
