"""``GraphClock``: timestamps that the device writes where the work runs, readable after it ran — timing
inside CUDA-graph replays without a profiler.

Events recorded inside a capture cannot be timed from the host, and a profiler changes how a replay's
branches are launched (docs/benchmarks.md: under torch.profiler the decode graph's main branch started
after its lookup branch). A stamp is a one-thread kernel that stores the GPU's global timer (ns,
``%globaltimer``) into a named slot of a device buffer on the current stream; captured into a graph it
stamps again on every replay, so after a replay and a synchronisation ``read()`` says when each stamped
point of the step ran on its stream. ``snapshot()`` after each step's launch keeps every step's stamps
without a synchronisation per step, so the engine keeps its rhythm. Slots are assigned by name on first
use, so the same code path at capture and at replay writes the same slots. Each stamp is one tiny launch
(a few microseconds of the stream's time): a diagnosis tool, set only by benchmarks and tests
(``lookup_stream.CLOCK``), never on a serving path.

On the CPU a stamp takes the host clock at the call (the same API, for what consumes the stamps).
"""
from __future__ import annotations

import functools
import time

import torch


@functools.cache
def _stamp_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stamp(OUT, slot):
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)
        tl.store(OUT + slot, now)

    return stamp


class GraphClock:
    """Named device timestamps (ns). ``slots`` bounds how many names one clock holds."""

    def __init__(self, device: torch.device | str, slots: int = 64):
        self.device = torch.device(device)
        self.names: dict[str, int] = {}
        self.buffer = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self._snapshots: list[torch.Tensor] = []

    def stamp(self, name: str) -> None:
        """Write the time into ``name``'s slot when the current stream reaches this point."""
        slot = self.names.get(name)
        if slot is None:  # a new name: refused before it is registered, so read() never meets a slot past the end
            if len(self.names) >= self.buffer.numel():
                raise ValueError(f"GraphClock: {len(self.names) + 1} names exceed its {self.buffer.numel()} slots "
                                 f"({name!r})")
            slot = self.names[name] = len(self.names)
        if self.device.type == "cuda":
            _stamp_kernel()[(1,)](self.buffer, slot, num_warps=1)
        else:
            self.buffer[slot] = time.perf_counter_ns()

    def snapshot(self) -> None:
        """Queue a copy of the stamps on the current stream, after the work queued there so far (a replay
        launched on it included): one reading per step, without making the host wait."""
        self._snapshots.append(self.buffer.clone())

    def read_snapshots(self) -> list[dict[str, int]]:
        """Every ``snapshot`` as {name: ns}, oldest first (synchronises once); clears them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        rows = [self._named(t) for t in self._snapshots]
        self._snapshots = []
        return rows

    def read(self) -> dict[str, int]:
        """{name: ns} of every stamped name, after the device has run what was queued (synchronises)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._named(self.buffer)

    def _named(self, buffer: torch.Tensor) -> dict[str, int]:
        values = buffer.cpu().tolist()
        return {name: values[slot] for name, slot in self.names.items()}
