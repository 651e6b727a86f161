"""``PinnedUpload``: a graph's int64 inputs staged in pinned memory and copied to one static device buffer by one
non-blocking copy a step. Two pinned buffers take turns, so a step can be filled while the copy of the step before is
still queued (async scheduling); an event per buffer says when its copy ran, and a buffer is only refilled after it."""
from __future__ import annotations

import numpy as np
import torch


def lay_out(sizes: list[tuple[str, int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """Named parts of one buffer back to back, in order -> ({name: (start, end)}, total length)."""
    ranges, at = {}, 0
    for name, n in sizes:
        ranges[name] = (at, at + n)
        at += n
    return ranges, at


class PinnedUpload:
    """``begin()`` -> the numpy view of the pinned buffer to fill; ``upload(n)`` copies its first ``n`` elements (all by
    default) into ``device_buffer``, whose other elements keep their values."""

    def __init__(self, numel: int, device: torch.device):
        cuda = torch.device(device).type == "cuda"  # on the CPU (tests) the buffers are plain and copies synchronous
        self.host = [torch.zeros(numel, dtype=torch.long) for _ in range(2)]
        self.host = [buf.pin_memory() for buf in self.host] if cuda else self.host
        self._np = [buf.numpy() for buf in self.host]
        self._copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._turn = 0
        self.device_buffer = torch.zeros(numel, dtype=torch.long, device=device)

    def views(self) -> list[np.ndarray]:
        """Both pinned buffers as numpy arrays (to carve the same views from each)."""
        return self._np

    def begin(self) -> int:
        """The turn (0 or 1) whose pinned buffer the caller fills now, after its previous copy has run."""
        turn, self._turn = self._turn, 1 - self._turn
        event = self._copied[turn]
        if event is not None and not event.query():
            event.synchronize()
        return turn

    def upload(self, turn: int, n: int | None = None) -> None:
        src = self.host[turn] if n is None else self.host[turn][:n]
        dst = self.device_buffer if n is None else self.device_buffer[:n]
        dst.copy_(src, non_blocking=True)
        if self._copied[turn] is not None:
            self._copied[turn].record()
