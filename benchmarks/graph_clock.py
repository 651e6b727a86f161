"""``GraphClock``: timestamps the device writes where the work runs, readable after it ran — timing inside
CUDA-graph replays without a profiler (which changes how a replay's branches launch).

A stamp is a one-thread kernel storing ``%globaltimer`` (ns) into a named slot of a device buffer on the
current stream; captured into a graph it stamps on every replay. Slots are assigned by name on first use, so
capture and replay write the same slots. On the CPU a stamp takes the host clock. ``install(clock)`` makes
every ``LookupStream`` stamp the fork, the lookup branch's start, each layer's lookup end, the main stream's
first work, both sides of each consumer's wait and the join; call it before the graphs are captured.
"""
from __future__ import annotations

import contextlib
import functools
import time

import torch

from engram.engine.lookup_stream import LookupStream


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


def install(clock: GraphClock, setattr=setattr) -> None:
    """Wrap ``LookupStream``'s ``issue``/``done``/``wait``/``join`` to stamp ``clock`` (replacing an earlier
    install's wrappers). ``setattr``: pytest's ``monkeypatch.setattr`` in tests, so the methods are restored."""
    orig = {name: getattr(getattr(LookupStream, name), "_unclocked", getattr(LookupStream, name))
            for name in ("issue", "done", "wait", "join")}

    @contextlib.contextmanager
    def issue(self, *inputs):
        clock.stamp("fork")
        with orig["issue"](self, *inputs) as stream:
            clock.stamp("lookup_start")
            yield stream
        clock.stamp("main_start")

    def done(self, layer_id):
        clock.stamp(f"lookup_done_{layer_id}")
        orig["done"](self, layer_id)

    def wait(self, layer_id, *tensors, tag=None):
        clock.stamp(f"wait_begin_{layer_id}")
        orig["wait"](self, layer_id, *tensors, tag=tag)
        clock.stamp(f"wait_end_{layer_id}")

    def join(self):
        orig["join"](self)
        clock.stamp("joined")

    for name, fn in (("issue", issue), ("done", done), ("wait", wait), ("join", join)):
        fn._unclocked = orig[name]
        setattr(LookupStream, name, fn)
