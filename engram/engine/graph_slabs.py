"""The disk layers' part of a decode graph (``DecodeGraphs``, engine/cuda_graphs.py, is a ``SlabSteps``).

With ``DISK_DECODE_IN_GRAPH`` each disk Engram layer owns a pinned slab of its table, sized for the largest
bucket (``DecodeGraphs.slabs``): a step's lookup only reads the rows' pages into it, and the piece that starts
with the layer decodes it with the gather it captured (``_decode_slab``). Over a hot-row cache with
``CACHE_PROBE`` the piece finds its rows in the cache's tags mirrored on the device and waits for the host's
lookup (a pinned flag) only when a row is missing (store/kernels/cache_probe.py); when every layer does
(``probes_all``) the whole step is queued before its lookups run. Then:

* ``read_lookups`` runs the step's lookups (host work only, which signals each layer's flag): inline in
  ``DecodeGraphs.run``, or on the Worker's background thread (engine/step_lookups.py);
* ``finish_lookups``, on the engine's thread once they are done, caches the rows they read
  (``DiskTable.admit_probed``: device work, queued only now that no piece waits for a flag; on CUDA it
  copies the rows out of the slab over UVA after the slab's decode) and lets each slab's next lookup wait
  for this step's decode of it and those copies (``_settle_slab``, then ``admit_probed``'s event: two decode
  events a slab, taking turns, since a step's lookup must not wait for its own step's piece, which may be
  waiting for that lookup); with ``late_caching.DEFER`` it only takes the rows out of the slabs, and each
  table's next lookup caches them beside its reads (store/late_caching.py);
* ``abort_lookups`` fails the pieces still waiting when the lookups failed or will not run.

Caching a layer's rows right after its own lookup, while the next layer's reads run (kernel switch
``early_admit``), was measured on the H200 at e77e6d6 and removed: it took 2 ms of caching off the engine's
thread, but the next step's ids arrived no sooner and neither A/B found a difference; since ed4aa1c a batch-64
step reads both tables together anyway (lookup.TOGETHER_WHEN_DEEP, docs/benchmarks.md).

The mixin uses DecodeGraphs' ``rows``, ``row_ids``, ``plan_id``, ``n_cols``, ``ranges``, ``slabs``,
``slab_tables``, ``probed``, ``probe_status``, ``last_step_read`` and ``_slab_decoded`` / ``_slab_turn``.
"""
from __future__ import annotations

from typing import Callable

from engram.engine.lookup import StagedRows
from engram.engine.step import StepDescription
from engram.store.kernels import cache_probe


class SlabSteps:
    """Disk layers decoded from slabs inside the pieces, and a step's lookups into them."""

    def _decode_slab(self, layer_id: int, size: int) -> None:
        """Layer ``layer_id``'s slab decoded into its static rows [size, n_cols, D] (captured in its piece)."""
        rows = self.rows[layer_id][:size]
        probe = {}
        if layer_id in self.probed:  # slots found on the device (store/kernels/cache_probe.py)
            i = self.probed.index(layer_id)
            probe = dict(ids=self.row_ids[layer_id][:size].reshape(-1), plan=self.plan_id,
                         status=self.probe_status[i:i + 1])
        self.slab_tables[layer_id].decode_slab(self.slabs[layer_id], size * self.n_cols,
                                               out=rows.view(-1, rows.shape[-1]), **probe)

    @property
    def probes_all(self) -> bool:
        """Whether every Engram layer's piece finds its rows without the host (all slabs probed): ``begin`` may
        then queue the whole step before the step's lookups run."""
        return bool(self.probed) and len(self.probed) == len(self.rows)

    def _settle_slab(self, lid: int) -> None:
        """After layer ``lid``'s lookup of a step: the slab's next lookup waits for this step's decode of it
        (``slab.done``), and so do the next writes into its cache's storage. Not sooner: this step's lookup
        (which writes the slots) must not wait for this step's piece, which may be waiting for that lookup."""
        slab = self.slabs[lid]
        slab.done = self._slab_decoded[lid][self._slab_turn]
        cache = getattr(self.slab_tables[lid], "cache", None)
        if cache is not None:  # writes into the cache's storage wait for this replay's gather
            cache.note_read(slab.done)

    def read_lookups(self, step: StepDescription, staged: StagedRows, first: int | None = None,
                     release: bool = True, after_each: Callable[[], None] | None = None) -> None:
        """Run the lookups of the Engram layers whose pieces ``begin`` queued already (probed slabs; all of
        them when ``first`` is None: the whole step was queued), in layer order: host work only, which signals
        each layer's flag. The Worker runs it on a thread of its own (engine/step_lookups.py), ``run`` inline.
        A failed lookup fails the pieces still waiting (``abort_lookups``) and is raised. ``release``: cancel
        what is left of ``staged`` after (reads a failure part-way left). ``after_each()``: after each
        layer's lookup."""
        upto = self.ranges if first is None else self.ranges[:first]
        try:
            for lid in [lid for _, _, lid in upto if lid is not None]:
                staged.rows(lid, step.step_id)  # a slab layer: its pages go into the slab, its flag is set
                if after_each is not None:
                    after_each()
        except BaseException:
            self.abort_lookups(step.step_id)
            raise
        finally:
            if release:
                staged.release()

    def finish_lookups(self) -> None:
        """After a step's lookups (``read_lookups``, on whichever thread): the rows they read go into the
        caches (``DiskTable.admit_probed``: device work, queued only now that no piece waits for a flag), and
        each slab's next lookup waits for this step's decode of it (``_settle_slab``, first: the copies out of a
        slab that ``admit_probed`` queues come after its decode, and the slab's next read waits for them). On
        the engine's thread, before the next step's ``begin``. ``last_step_read``: whether those lookups read
        any row from disk (the Worker runs a step's lookups in the background only after one that did)."""
        for lid in self.slabs:  # first: admit_probed's device copies out of a slab come after its decode
            self._settle_slab(lid)
        read = [self.slab_tables[lid].admit_probed(self.slabs[lid]) for lid in self.probed]
        self.last_step_read = any(read)

    def abort_lookups(self, step_id: int) -> None:
        """A step's lookups failed or will not run: pieces still waiting for a probed layer's flag give up
        (failed) at once."""
        for lid in self.probed:
            cache_probe.signal(self.slabs[lid].probe.flag, step_id, ok=False)
