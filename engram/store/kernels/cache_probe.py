"""A hot-row cache probed on the device: a decode step's slots into the cache's storage, found without the host.

A disk table behind a hot-row cache (store/cache.py) keeps its policy on the host, but mirrors the cache's tags
on the device (``RowCache.dev_tags``: every insert's tags are written there on the cache's stream, after the
rows' bytes). A decode-graph piece resolves its layer's slots from that mirror (``resolve_slots``): each row id
is hashed to its set exactly as the host hashes it and compared with the set's ways. When every id is found the
piece gathers at once, and the host's lookup of the step (the policy's stamps) runs beside it; when any id is
missing the piece waits for the step's flag, which the host's lookup writes on the cache's stream once the
misses are read and cached (``signal``), and then takes every slot from the host's list (the slab's pinned
``slots``). So the device only waits for the host when a row has to come from disk.

Why the mirror can be trusted: the host's tags at the start of a step's lookup are the mirror after every
earlier lookup's writes, which the piece is ordered after (an earlier piece either waited for their flag or
found the rows those writes inserted, each tag written after its row's bytes). A lookup never evicts a row it
finds, so an id the piece finds is still there when it is read, and an id only the piece finds (inserted by
the same step's lookup, whose tag it saw) has its bytes in place. Rows placed past the cache's ways (overflow
rows) never enter the mirror: they always make the piece wait.

The flag holds ``2 * plan id`` once a step's lookup succeeded and ``2 * plan id + 1`` when it failed
(``signal(..., ok=False)``). Each resolve writes a ``status``: FOUND (every row in the mirror), WAITED (took the
host's slots after the flag) or FAILED (the flag said failed, or the wait gave up after ``SPIN_LIMIT`` reads of
it). The Worker reads it back with the sampled tokens and raises on FAILED: the step fails loudly rather than
decode rows that never arrived.

``resolve_slots`` runs the Triton kernel on CUDA (one program: a decode step has at most a few thousand ids)
and the torch reference elsewhere; the reference cannot wait, so on the CPU it treats an unset flag as a
failed wait. Bitwise: both return the same int64 slots (tests/unit/test_cache_probe.py,
tests/gpu/test_cache_probe_gpu.py).
"""
from __future__ import annotations

import torch

from engram.store.kernels import triton_available

HASH_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: store/cache.py's set hash
SPIN_LIMIT = 200_000_000  # reads of the flag before a wait gives up (tens of seconds on an H200)
FOUND, WAITED, FAILED = 0, 1, 2  # a resolve's status


def set_of(ids: torch.Tensor, n_sets: int) -> torch.Tensor:
    """The cache set of each row id (int64, any device): ``((id * HASH_MUL) >> 32) & 0x7FFFFFFF`` mod n_sets,
    the multiply wrapping as int64 does (RowCache._set_of)."""
    return (((ids * HASH_MUL) >> 32) & 0x7FFFFFFF) % n_sets


def signal(flag: torch.Tensor, plan_id: int, ok: bool = True) -> None:
    """A step's lookup has finished (``ok``) or failed: the flag a waiting piece reads, written on the current
    stream after the work queued there (the lookup's inserts into the cache)."""
    flag.fill_(2 * plan_id + (0 if ok else 1))


def resolve_slots(ids: torch.Tensor, tags: torch.Tensor, host_slots: torch.Tensor, flag: torch.Tensor,
                  plan: torch.Tensor, out: torch.Tensor, status: torch.Tensor, *,
                  spin_limit: int | None = None) -> torch.Tensor:
    """Slots into the cache's storage of ``ids`` (int64 [N] on the tags' device; -1 marks a padding position,
    which gets slot 0 and never waits): found in ``tags`` (int64 [n_sets, ways], the device mirror), or, when
    any id is missing, all of them from ``host_slots`` (int64 [>= N], pinned host memory on CUDA) once
    ``flag`` (int64 [1]) reads ``2 * plan`` (``plan``: int64 [1], the step's plan id). Writes ``out`` [N] and
    ``status`` (int32 [1]: FOUND, WAITED or FAILED). No host synchronisation on CUDA, so a CUDA graph can
    hold it."""
    n = ids.numel()
    if out.numel() < n or tags.dim() != 2 or ids.dtype != torch.int64 or tags.dtype != torch.int64:
        raise ValueError(f"resolve_slots: ids {tuple(ids.shape)} {ids.dtype}, tags {tuple(tags.shape)} {tags.dtype}, "
                         f"out {tuple(out.shape)}")
    if ids.is_cuda and triton_available():
        _resolve_triton(ids, tags, host_slots, flag, plan, out, status,
                        SPIN_LIMIT if spin_limit is None else spin_limit)
        return out
    return resolve_slots_reference(ids, tags, host_slots, flag, plan, out, status)


def probe(ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
    """Slot of each id in the mirror ``tags`` [n_sets, ways], -1 where it is not cached (or the id is < 0)."""
    n_sets, ways = tags.shape
    sets = set_of(ids.clamp_min(0), n_sets)  # [N]
    match = (tags[sets] == ids[:, None]) & (ids[:, None] >= 0)  # [N, ways]
    return torch.where(match.any(dim=1), sets * ways + match.to(torch.int8).argmax(dim=1), -1)


def resolve_slots_reference(ids: torch.Tensor, tags: torch.Tensor, host_slots: torch.Tensor, flag: torch.Tensor,
                            plan: torch.Tensor, out: torch.Tensor, status: torch.Tensor) -> torch.Tensor:
    """``resolve_slots`` in torch; cannot wait: an unset flag when an id is missing is a failed wait."""
    n = ids.numel()
    slots = probe(ids, tags)  # [N]
    if bool(((slots < 0) & (ids >= 0)).any()):
        ok = int(flag.reshape(-1)[0]) == 2 * int(plan.reshape(-1)[0])
        out[:n].copy_(host_slots[:n])
        status.fill_(WAITED if ok else FAILED)
        return out
    out[:n].copy_(slots.clamp_min(0))
    status.fill_(FOUND)
    return out


def _resolve_triton(ids, tags, host_slots, flag, plan, out, status, spin_limit: int) -> None:
    import triton

    from engram.store.kernels.triton_gather import kernel_arg

    n = ids.numel()
    block = min(1024, max(32, triton.next_power_of_2(n)))
    _kernel()[(1,)](ids, tags, kernel_arg(host_slots), flag, plan, out, status, n, tags.shape[0], HASH_MUL,
                    spin_limit, WAYS=tags.shape[1], BLOCK=block, num_warps=4)


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _resolve_slots_kernel(IDS, TAGS, HOST_SLOTS, FLAG, PLAN, OUT, STATUS, N, N_SETS, MUL, SPIN_LIMIT,
                              WAYS: tl.constexpr, BLOCK: tl.constexpr):
        misses = 0
        for start in range(0, N, BLOCK):  # probe the mirror; slots found (or 0) into OUT
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
        status = misses * 0  # FOUND
        if misses > 0:  # wait for the host's lookup of this step, then take its slots
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
                tl.store(OUT + offs, tl.load(HOST_SLOTS + offs, mask=inside, other=0, volatile=True), mask=inside)
        tl.store(STATUS, status)

    _KERNEL = _resolve_slots_kernel
    return _KERNEL
