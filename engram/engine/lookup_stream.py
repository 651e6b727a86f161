"""Lookup stream (worker side, CUDA): a step's Engram gathers run on their own stream, one event per layer.

A step's row ids are known before its first layer runs, so with ``lookup_overlap`` the lookup executor
(eager steps) and the decode graphs (captured steps) fork this stream from the main stream through an event,
issue every Engram layer's gather on it and record one event per layer; the consuming layer makes the main
stream wait on its layer's event just before it reads the rows, so a layer never reads unwritten rows.
Inside a capture the lookup stream becomes a graph branch joined at each consumer (CUDA requires every
branch joined). Memory it allocates in eager steps is handed to the main stream (``record_stream``).

``exposed_seconds()``: how long consumers of eager steps waited (``engram_lookup_exposed_seconds``), from a
timing-event pair per layer, read lazily; replays are not timed (events inside a capture cannot be).
Test-only knobs: ``DELAY_CYCLES`` spins the lookup stream before its first gather, ``DROP_WAIT`` skips the
waits (tests/gpu/test_lookup_overlap.py shows the race and its absence)."""
from __future__ import annotations

import contextlib

import torch

DELAY_CYCLES = 0  # tests only: GPU cycles the lookup stream spins before its first gather
DROP_WAIT = False  # tests only: consumers do not wait for their layer's gather (a race on purpose)


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
        self._fork.record(main)
        self.stream.wait_event(self._fork)
        for t in inputs:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            if DELAY_CYCLES:
                torch.cuda._sleep(DELAY_CYCLES)
            yield self

    def done(self, layer_id: int) -> None:
        """Layer ``layer_id``'s rows are queued on the lookup stream (call inside ``issue``)."""
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
        if not DROP_WAIT:
            main.wait_event(self._ready[layer_id])
        for t in tensors:
            t.record_stream(main)

    def join(self) -> None:
        """Make the current stream wait for everything queued on the lookup stream so far. A graph's capture
        ends with it, so the lookup branch is joined even where a consumer's wait is dropped (``DROP_WAIT``);
        when every consumer waited it adds no wait that was not there."""
        end = torch.cuda.Event()
        end.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(end)

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
