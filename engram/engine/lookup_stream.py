"""Lookup stream (worker side, CUDA): a step's Engram gathers run on their own stream, one event per layer.

A step's row ids are known before its first layer runs, so its gathers (+ MXFP8 dequant) need not wait for
anything the model computes. With ``lookup_overlap`` the lookup executor (eager steps) and the decode
graphs (captured steps) issue every Engram layer's gather on this stream, right after forking it from the
main stream through an event, and record one event per layer; the consuming layer makes the main stream
wait on its layer's event just before it reads the rows. So the gathers run while the embedding and the
layers before each Engram layer compute, and a layer never reads rows its gather has not written.

Inside a CUDA graph the fork and the per-layer waits are captured like any other work: the lookup stream
becomes a branch of the graph that forks at the step's start and joins the main stream at each consumer
(every Engram layer consumes its rows, so every branch is joined, as CUDA requires of a capture). Memory
the lookup stream allocates in eager steps is handed to the main stream (``record_stream``), so the
caching allocator never reuses it while the main stream still reads it. ``idle()`` says whether the lookup
stream has finished its work (checked after each capture and each eager step in tests).

``exposed_seconds()`` is the time consuming layers of eager steps actually waited for their lookups (the
``engram_lookup_exposed_seconds`` metric): a timing event on the main stream where the consumer starts to
wait, one on the lookup stream where the layer's work ends, their difference when positive, summed once both
have run (read lazily, never waited for). Graph replays are not timed: CUDA events recorded inside a
capture cannot be timed from the host, so a profile of the replay shows their overlap instead.

Two test-only knobs (module attributes, never set outside tests) make the race visible: ``DELAY_CYCLES``
spins the lookup stream (``torch.cuda._sleep``) before its first gather, ``DROP_WAIT`` skips the waits. With
the wait dropped and the stream delayed, layers read rows before they are written and outputs change; with
the wait kept they must not (tests/gpu/test_lookup_overlap.py asserts both). A third, for benchmarks:
``CLOCK`` (a ``graph_clock.GraphClock``) stamps the fork (``fork``, main stream), the lookup branch's start
(``lookup_start``), each layer's end on the lookup stream (``lookup_done_L``), the main stream's first work
after the fork (``main_start``), each consumer's wait on either side (``wait_begin_L`` / ``wait_end_L``) and
the final join (``joined``); set before the graphs are captured, the stamps run inside every replay
(benchmarks/trace_lookup_overlap.py reads them).
"""
from __future__ import annotations

import contextlib

import torch

DELAY_CYCLES = 0  # tests only: GPU cycles the lookup stream spins before its first gather
DROP_WAIT = False  # tests only: consumers do not wait for their layer's gather (a race on purpose)
CLOCK = None  # benchmarks only: a GraphClock that stamps the fork, each layer's lookup end and each wait


class LookupStream:
    """A side stream for one Worker's Engram gathers and an event per Engram layer."""

    def __init__(self, device: torch.device, layer_ids):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._fork = torch.cuda.Event()
        self._ready = {lid: torch.cuda.Event() for lid in layer_ids}
        self._timed: dict[int, torch.cuda.Event] = {}  # eager steps: layer -> timing event where its work ended
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (consumer waits, lookup done)
        self._exposed_ms = 0.0

    @contextlib.contextmanager
    def issue(self, *inputs: torch.Tensor):
        """Work inside runs on the lookup stream, ordered after everything the main stream has queued so
        far (the step's id uploads included); call ``done(layer)`` after each layer's gather. ``inputs``:
        tensors the main stream made that the lookup stream reads (marked used by it, so the caching
        allocator does not hand their memory to the main stream again before the lookup stream is done)."""
        main = torch.cuda.current_stream(self.device)
        if CLOCK is not None:
            CLOCK.stamp("fork")
        self._fork.record(main)
        self.stream.wait_event(self._fork)
        for t in inputs:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            if CLOCK is not None:
                CLOCK.stamp("lookup_start")
            if DELAY_CYCLES:
                torch.cuda._sleep(DELAY_CYCLES)
            yield self
        if CLOCK is not None:
            CLOCK.stamp("main_start")

    def done(self, layer_id: int) -> None:
        """Layer ``layer_id``'s rows are queued on the lookup stream (call inside ``issue``)."""
        if CLOCK is not None:
            CLOCK.stamp(f"lookup_done_{layer_id}")
        self._ready[layer_id].record(self.stream)
        if not torch.cuda.is_current_stream_capturing():
            self._timed[layer_id] = torch.cuda.Event(enable_timing=True)
            self._timed[layer_id].record(self.stream)

    def wait(self, layer_id: int, *tensors: torch.Tensor) -> None:
        """Make the current stream wait for layer ``layer_id``'s rows; ``tensors`` (allocated on the lookup
        stream in an eager step) are marked as used by the current stream for the caching allocator."""
        main = torch.cuda.current_stream(self.device)
        done = self._timed.pop(layer_id, None)
        if done is not None and not torch.cuda.is_current_stream_capturing():
            consumer = torch.cuda.Event(enable_timing=True)
            consumer.record(main)
            self._pairs.append((consumer, done))
            if len(self._pairs) > 256:  # fold in the pairs that have run, so the list stays short unread
                self.exposed_seconds()
        if CLOCK is not None:
            CLOCK.stamp(f"wait_begin_{layer_id}")
        if not DROP_WAIT:
            main.wait_event(self._ready[layer_id])
        if CLOCK is not None:
            CLOCK.stamp(f"wait_end_{layer_id}")
        for t in tensors:
            t.record_stream(main)

    def join(self) -> None:
        """Make the current stream wait for everything queued on the lookup stream so far. A graph's capture
        ends with it, so the lookup branch is joined even where a consumer's wait is dropped (``DROP_WAIT``);
        when every consumer waited it adds no wait that was not there."""
        end = torch.cuda.Event()
        end.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(end)
        if CLOCK is not None:
            CLOCK.stamp("joined")

    def exposed_seconds(self) -> float:
        """Seconds consuming layers of eager steps waited for their lookups, summed over the pairs of events
        that have both run (the rest count at a later call)."""
        pending = []
        for consumer, done in self._pairs:
            if consumer.query() and done.query():
                self._exposed_ms += max(0.0, consumer.elapsed_time(done))
            else:
                pending.append((consumer, done))
        self._pairs = pending
        return self._exposed_ms / 1e3

    def idle(self) -> bool:
        """Whether everything queued on the lookup stream has run."""
        return self.stream.query()
