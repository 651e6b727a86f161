"""Lookup stream (worker side, CUDA): a step's Engram gathers run on their own stream, one event per layer. With
``lookup_overlap`` the lookup executor and the decode graphs fork this stream from the main stream, issue every layer's
gather on it and record one event per layer; the consuming layer waits on its layer's event just before reading, so it
never reads unwritten rows. In a capture the stream is a graph branch joined at each consumer; eager allocations are
handed to the main stream (``record_stream``). ``exposed_seconds()`` sums how long eager consumers waited. Test-only:
``DELAY_CYCLES`` spins the stream first, ``DROP_WAIT`` skips waits."""
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
        # (consumer waits, lookup done, step tag)
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event, int | None]] = []
        self._exposed_ms = 0.0
        self._exposed_by_tag: dict[int, float] = {}  # step tag -> ms, until ``pop_exposed`` takes it

    @contextlib.contextmanager
    def issue(self, *inputs: torch.Tensor):
        """Work inside runs on the lookup stream after all the main stream queued so far; call ``done(layer)`` after
        each layer's gather. ``inputs``: main-stream tensors it reads (marked used by it for the caching allocator)."""
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

    def wait(self, layer_id: int, *tensors: torch.Tensor, tag: int | None = None) -> None:
        """Make the current stream wait for ``layer_id``'s rows; ``tensors`` (eager allocations) are marked used;
        ``tag`` (a step id) files the measured wait under that step for ``pop_exposed``."""
        main = torch.cuda.current_stream(self.device)
        done = self._timed.pop(layer_id, None)
        if done is not None and not torch.cuda.is_current_stream_capturing():
            consumer = torch.cuda.Event(enable_timing=True)
            consumer.record(main)
            self._pairs.append((consumer, done, tag))
            if len(self._pairs) > 256:  # fold in the pairs that have run, so the list stays short unread
                self.exposed_seconds()
        if not DROP_WAIT:
            main.wait_event(self._ready[layer_id])
        for t in tensors:
            t.record_stream(main)

    def join(self) -> None:
        """Make the current stream wait for all queued on the lookup stream; a capture ends with it, so the branch is
        joined even where a wait is dropped (``DROP_WAIT``)."""
        end = torch.cuda.Event()
        end.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(end)

    def exposed_seconds(self) -> float:
        """Seconds eager consumers waited for their lookups, over event pairs that both ran (the rest count later)."""
        pending = []
        for consumer, done, tag in self._pairs:
            if consumer.query() and done.query():
                ms = max(0.0, consumer.elapsed_time(done))
                self._exposed_ms += ms
                if tag is not None:
                    self._exposed_by_tag[tag] = self._exposed_by_tag.get(tag, 0.0) + ms
            else:
                pending.append((consumer, done, tag))
        self._pairs = pending
        return self._exposed_ms / 1e3

    def pop_exposed(self, tag: int) -> float:
        """Seconds the consumers of step ``tag`` waited (its events have run once its tokens were read); older
        tags never taken (failed steps) are dropped."""
        self.exposed_seconds()
        ms = self._exposed_by_tag.pop(tag, 0.0)
        for old in [t for t in self._exposed_by_tag if t < tag]:
            del self._exposed_by_tag[old]
        return ms / 1e3

    def idle(self) -> bool:
        """Whether everything queued on the lookup stream has run."""
        return self.stream.query()
