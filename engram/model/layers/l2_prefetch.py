"""Prefetching a projection's weight into L2 while latency-bound kernels run (decode at a few tokens, CUDA).

At batch 1 a layer's q/k norm + RoPE and its attention (~10 µs on 4b-like) leave the memory bus mostly
idle, and the o projection that follows then streams its 21 MB weight from HBM at ~62 % of the copy
bandwidth (docs/benchmarks.md). ``WeightPrefetcher.start(w)`` forks a side stream from the current one
and issues ``prefetch.global.L2::evict_last`` for every 128-byte line of ``w`` there (a Triton kernel; no
data is written anywhere), ``finish()`` makes the current stream wait for it, right before ``w`` is read.
Both are stream operations, so they are captured into decode graphs like any other work. Nothing the model
computes changes (the GEMM reads the same bytes), so outputs are bitwise the same with it on or off.

Off unless ``ENGRAM_L2_PREFETCH=1`` (``ENABLED``), until the H200 A/B decides; used only for steps of at
most ``MAX_TOKENS`` tokens (at larger batches attention itself is bandwidth-bound). scripts/bench_l2_prefetch.py
measures the effect on one GEMV in isolation.
"""
from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("ENGRAM_L2_PREFETCH", "0") == "1"
MAX_TOKENS = 8
LINE = 128  # bytes per prefetched cache line
BLOCK = 1024  # lines per program


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_lines(W, nbytes, BLOCK: tl.constexpr):
        offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * 128
        ptrs = W + tl.where(offs < nbytes, offs, 0)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    return prefetch_lines


def prefetch(weight: torch.Tensor) -> None:
    """Queue an L2 prefetch of every line of ``weight`` (contiguous, CUDA) on the current stream."""
    nbytes = weight.numel() * weight.element_size()
    lines = -(-nbytes // LINE)
    _kernel()[(-(-lines // BLOCK),)](weight.view(torch.uint8), nbytes, BLOCK=BLOCK, num_warps=4)


class WeightPrefetcher:
    """A side stream for L2 prefetches of one device; ``start`` / ``finish`` pair up around the kernels
    that the prefetch should run beside."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._done = torch.cuda.Event()

    def start(self, weight: torch.Tensor) -> None:
        """Prefetch ``weight`` on the side stream, after what the current stream has queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            prefetch(weight)
            self._done.record(self.stream)

    def finish(self) -> None:
        """The current stream waits for the last ``start``'s prefetch (the graph branch joins here)."""
        torch.cuda.current_stream(self.device).wait_event(self._done)
