"""Tile shape and grid of a Triton gather launch, and the parser of a sweep's config flag; apart from triton_gather.py
so it imports without triton."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and grid of one launch. The defaults are the HBM table's fastest (one program per tile, no streaming
    cache hints); uva.UVA_CONFIG holds the host table's."""

    block_r: int = 32  # ids per tile
    num_warps: int = 4  # warps per program
    # persistent grid = min(tiles, SMs * this); -1 = as many programs as fit on an SM at once (from the
    # compiled kernel's registers, so there is never a second wave); 0 = one program per tile
    programs_per_sm: int = 0
    stream: bool = False  # table rows evict-first, output stores streaming (.cs)
    # at most this many programs whatever the rule above gives (0: no cap): a gather that runs beside other
    # kernels (lookup overlap) holds fewer SMs; programs stride over the tiles, so the rows are the same
    max_programs: int = 0
    # > 1: at most max(SPREAD_MIN_PROGRAMS, ceil(tiles / this)) programs, a grid that grows with the batch
    # (spread_programs); 1: no such limit
    tiles_per_program: int = 1

    def __post_init__(self) -> None:
        if self.block_r < 1 or self.block_r & (self.block_r - 1):
            raise ValueError(f"LaunchConfig.block_r={self.block_r} must be a power of two")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LaunchConfig.num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.programs_per_sm < -1:
            raise ValueError(f"LaunchConfig.programs_per_sm={self.programs_per_sm} must be >= -1")
        if self.max_programs < 0:
            raise ValueError(f"LaunchConfig.max_programs={self.max_programs} must be >= 0 (0: no cap)")
        if self.tiles_per_program < 1:
            raise ValueError(f"LaunchConfig.tiles_per_program={self.tiles_per_program} must be >= 1")


SPREAD_MIN_PROGRAMS = 8  # the fewest programs tiles_per_program leaves a gather of more tiles than this


def spread_programs(n_tiles: int, tiles_per_program: int) -> int:
    """Programs ``n_tiles`` may use: up to ``tiles_per_program`` tiles each, >= SPREAD_MIN_PROGRAMS, <= one a tile."""
    if tiles_per_program <= 1:
        return n_tiles
    return min(n_tiles, max(SPREAD_MIN_PROGRAMS, -(-n_tiles // tiles_per_program)))


def parse_config(spec: str) -> LaunchConfig:
    """A gather launch config from "block_r,num_warps,programs_per_sm[,0|1]" (a benchmark's sweep flag)."""
    parts = spec.split(",")
    try:
        if len(parts) not in (3, 4):
            raise ValueError(spec)
        b, w, p = (int(x) for x in parts[:3])
        stream = bool(int(parts[3])) if len(parts) == 4 else False
    except ValueError as e:
        raise ValueError(f"gather config {spec!r} must be 'block_r,num_warps,programs_per_sm[,0|1]'") from e
    return LaunchConfig(b, w, p, stream)
