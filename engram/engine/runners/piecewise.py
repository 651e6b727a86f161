"""The piecewise runner: decode steps over host-read tables, each step's lookups paired with its pieces. ``launch``: (1)
over slabs with pending tokens, the row ids start to the host first (``start_host_ids``); (2) the step before's
background lookups are settled before this step's pieces are queued; (3) over slabs, the pieces needing no rows are
queued (``begin``), then the lookups read pages into the slabs, on a background thread (step_lookups.py) when every
layer probes and the step before read from disk, else inline; (4) without slabs the lookups stage rows, copied in before
each piece; (5) ``run`` replays the rest. The Worker calls ``settle(step_id)``, then ``check``."""
from __future__ import annotations

import functools

import torch

from engram.engine.lookup import HostIds, LookupExecutor, StagedRows
from engram.engine.pending import PendingPatch
from engram.engine.runners.base import Forward, StepRunner
from engram.engine.step import StepDescription
from engram.engine.step_lookups import BackgroundLookups


class PiecewiseRunner(StepRunner):
    name = "piecewise"
    def __init__(self, pieces, lookup: LookupExecutor, device: torch.device):
        self.pieces = pieces  # DecodePieces (pieces.py), or a stand-in with its interface
        self.lookup = lookup
        self._lookups = BackgroundLookups(device)  # a probed step's lookups, beside the host work

    def covers(self, step: StepDescription) -> bool:
        return self.pieces.fits(step)

    def launch(self, step: StepDescription, patch: PendingPatch | None) -> Forward:
        slabs = self.pieces.slabs
        slab_step = bool(slabs) and set(step.engram_row_ids) <= set(slabs)
        host_ids = self.lookup.start_host_ids(step, patch) if slab_step and patch is not None else None
        self.settle()
        if slab_step:
            staged = self._submit_slab_step(step, patch, host_ids)
        else:
            staged = self.lookup.submit(step, patch, project=False, **({"slabs": slabs} if slabs else {}))
        try:
            logits = self.pieces.run(step, staged, patch)  # [S, vocab] float32
        finally:
            if staged is not None:
                staged.release()  # reads of layers a failed step never reached (lookup.py: deferred)
        return Forward(logits, self.pieces.flags)

    def _submit_slab_step(self, step: StepDescription, patch: PendingPatch | None,
                          host_ids: HostIds | None) -> StagedRows | None:
        """Queue the pieces needing no rows, submit the slab lookups -> staged rows (None: run in the background)."""
        whole = self.pieces.probes_all
        self.pieces.begin(step, patch, whole=whole)
        staged = None
        try:
            staged = self.lookup.submit(step, patch, project=False, slabs=self.pieces.slabs, host_ids=host_ids)
            # a step whose rows were all cached has lookups shorter than the hand-off to the thread and back
            if whole and self.pieces.last_step_read:
                self._lookups.start(step.step_id, functools.partial(self.pieces.read_lookups, step, staged,
                                                                    after_each=self._lookups.handed_off))
                return None
            return staged
        except BaseException:
            if whole:  # the queued pieces must not wait for lookups that will not run
                self.pieces.abort_lookups(step.step_id)
            if staged is not None:
                staged.release()
            raise

    def settle(self, upto: int | None = None) -> None:
        """Wait for background lookups (of steps up to ``upto``) and cache what they read: the one place they finish."""
        pending = self._lookups.pending_step
        if pending is not None and (upto is None or pending <= upto):
            self._lookups.finish(self.pieces.finish_lookups)

    def check(self, step_id: int, flags: torch.Tensor | None) -> None:
        failed = self._lookups.error(step_id)
        if failed is not None:  # its pieces gave up waiting (FAILED flags); the read's own error says why
            raise failed
        self.pieces.check_flags(step_id, flags)

    def stats(self) -> dict:
        return {"graph_replays": self.pieces.replays, "graph_pool_bytes": getattr(self.pieces, "pool_bytes", 0)}
