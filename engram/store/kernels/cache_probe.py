"""A hot-row cache probed on the device: a decode piece finds its rows' slots in the cache's mirrored tags
(``resolve_slots``) and waits for the host's lookup (a pinned flag, then its plan) only when a row is missing.

Deadlock freedom: the work that sets a flag is host work only; rows enter the cache after it, on the table's cache
stream. The mirror can be trusted: pieces are ordered after every earlier lookup's writes, a lookup never evicts a row
it finds, bytes are written before tags, and rows a full set cannot take never enter it. The flag reads ``2 * plan id``
when planned, ``2 * plan id + 1`` on failure; each resolve writes a ``status`` (FOUND, WAITED, FAILED) that the Worker
checks. The torch reference cannot wait: an unset flag fails."""
from __future__ import annotations

import functools

import torch

from engram.store.kernels import triton_available

HASH_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: store/cache.py's set hash
SPIN_LIMIT = 20_000_000  # reads of the pinned flag (each a PCIe round trip) before a wait gives up
FOUND, WAITED, FAILED = 0, 1, 2  # a resolve's status
SLOTS, ROWS, RUNS = 0, 1, 2  # the host plan's rows: cache slot, row in the slab's pages, run (i: read, -1: cached)


def set_of(ids: torch.Tensor, n_sets: int) -> torch.Tensor:
    """The cache set of each row id (int64, any device): ``((id * HASH_MUL) >> 32) & 0x7FFFFFFF`` mod n_sets,
    the multiply wrapping as int64 does (RowCache._set_of)."""
    return (((ids * HASH_MUL) >> 32) & 0x7FFFFFFF) % n_sets


def signal(flag: torch.Tensor, plan_id: int, ok: bool = True) -> None:
    """Host write of the pinned ``flag``: the step's plan is in place (``ok``) or the lookup failed; a waiting piece
    sees every host write before it."""
    flag.numpy()[0] = 2 * plan_id + (0 if ok else 1)


def resolve_slots(ids: torch.Tensor, tags: torch.Tensor, plan_host: torch.Tensor, flag: torch.Tensor,
                  plan: torch.Tensor, out: torch.Tensor, status: torch.Tensor, *,
                  spin_limit: int | None = None) -> torch.Tensor:
    """Where the rows of ``ids`` (int64 [N] on the tags' device; -1: padding, reads slot 0, never waits) come from, into
    ``out`` int64 [3, >= N] (SLOTS, ROWS, RUNS): found in ``tags`` [n_sets, ways] -> their slots, RUNS -1; any id
    missing -> the host's ``plan_host`` (int64 [3, >= N], pinned) once ``flag`` reads ``2 * plan``. Writes ``status``
    int32 [1]. No host synchronisation on CUDA (graph-capturable)."""
    n = ids.numel()
    if out.shape[0] != 3 or out.shape[1] < n or tags.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(f"resolve_slots: ids {tuple(ids.shape)} {ids.dtype}, tags {tuple(tags.shape)}, "
                         f"out {tuple(out.shape)}")
    if ids.is_cuda and triton_available():
        _resolve_triton(ids, tags, plan_host, flag, plan, out, status,
                        SPIN_LIMIT if spin_limit is None else spin_limit)
        return out
    return resolve_slots_reference(ids, tags, plan_host, flag, plan, out, status)


def probe(ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
    """Slot of each id in the mirror ``tags`` [n_sets, ways], -1 where it is not cached (or the id is < 0)."""
    n_sets, ways = tags.shape
    sets = set_of(ids.clamp_min(0), n_sets)  # [N]
    match = (tags[sets] == ids[:, None]) & (ids[:, None] >= 0)  # [N, ways]
    return torch.where(match.any(dim=1), sets * ways + match.to(torch.int8).argmax(dim=1), -1)


def resolve_slots_reference(ids: torch.Tensor, tags: torch.Tensor, plan_host: torch.Tensor, flag: torch.Tensor,
                            plan: torch.Tensor, out: torch.Tensor, status: torch.Tensor) -> torch.Tensor:
    """``resolve_slots`` in torch; cannot wait: an unset flag when an id is missing is a failed wait."""
    n = ids.numel()
    slots = probe(ids, tags)  # [N]
    if bool(((slots < 0) & (ids >= 0)).any()):
        ok = int(flag.reshape(-1)[0]) == 2 * int(plan.reshape(-1)[0])
        out[:, :n].copy_(plan_host[:, :n])
        status.fill_(WAITED if ok else FAILED)
        return out
    out[SLOTS, :n].copy_(slots.clamp_min(0))
    out[ROWS, :n].zero_()
    out[RUNS, :n].fill_(-1)
    status.fill_(FOUND)
    return out


def _resolve_triton(ids, tags, plan_host, flag, plan, out, status, spin_limit: int) -> None:
    import triton

    from engram.store.kernels.triton_gather import kernel_arg

    n = ids.numel()
    block = min(1024, max(32, triton.next_power_of_2(n)))
    _kernel()[(1,)](ids, tags, kernel_arg(plan_host), kernel_arg(flag), plan, out, status, n, tags.shape[0],
                    plan_host.stride(0), out.stride(0), HASH_MUL, spin_limit, WAYS=tags.shape[1], BLOCK=block,
                    num_warps=4)


@functools.cache
def _kernel():
    """The Triton kernel, defined on first use (triton imports only where CUDA runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _resolve_slots_kernel(IDS, TAGS, PLAN_HOST, FLAG, PLAN, OUT, STATUS, N, N_SETS, HOST_STRIDE, OUT_STRIDE,
                              MUL, SPIN_LIMIT, WAYS: tl.constexpr, BLOCK: tl.constexpr):
        misses = 0
        for start in range(0, N, BLOCK):  # probe the mirror: slots found (or 0), nothing to read from the slab
            offs = start + tl.arange(0, BLOCK)
            inside = offs < N
            ids = tl.load(IDS + offs, mask=inside, other=-1)
            valid = inside & (ids >= 0)
            sets = (((ids * MUL) >> 32) & 0x7FFFFFFF) % N_SETS
            slot = tl.full([BLOCK], -1, tl.int64)
            for w in tl.static_range(WAYS):
                tag = tl.load(TAGS + sets * WAYS + w, mask=valid, other=-2)
                slot = tl.where((tag == ids) & (slot < 0), sets * WAYS + w, slot)
            misses += tl.sum((valid & (slot < 0)).to(tl.int32), axis=0)
            tl.store(OUT + offs, tl.where(slot >= 0, slot, 0), mask=inside)
            tl.store(OUT + OUT_STRIDE + offs, tl.zeros([BLOCK], tl.int64), mask=inside)
            tl.store(OUT + 2 * OUT_STRIDE + offs, tl.full([BLOCK], -1, tl.int64), mask=inside)
        status = misses * 0  # FOUND
        if misses > 0:  # wait for the host's lookup of this step, then follow its plan
            want = tl.load(PLAN) * 2
            seen = tl.load(FLAG, volatile=True)
            spins = 0
            while (seen < want) & (spins < SPIN_LIMIT):
                seen = tl.load(FLAG, volatile=True)
                spins += 1
            status = 1 + (seen != want).to(tl.int32)  # WAITED, or FAILED
            for start in range(0, N, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                inside = offs < N
                for r in tl.static_range(3):
                    v = tl.load(PLAN_HOST + r * HOST_STRIDE + offs, mask=inside, other=0, volatile=True)
                    tl.store(OUT + r * OUT_STRIDE + offs, v, mask=inside)
        tl.store(STATUS, status)

    return _resolve_slots_kernel
