"""Piecewise decode graphs for host-read tables: one graph per range of layers, cut before each Engram layer, so the
host reads a layer's rows while the layers before it replay. Speculative verify steps take the same pieces over the
verify buckets' inputs (verify_pieces.py), every layer's rows copied in.

A layer's rows reach its piece copied in (staged rows, hot-row caches over the host tier) or from a pinned slab (disk
tables: the lookup reads pages into it, the piece decodes it with its captured UVA gather). Over a hot-row cache the
piece probes the device-mirrored tags and waits for the host only on a miss (kernels/cache_probe.py); when every layer
probes (``probes_all``) the whole step is queued first (``begin(whole=True)``). The runner (piecewise.py) decides when
``read_lookups``, ``finish_lookups`` and ``abort_lookups`` run."""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from engram.engine.lookup import StagedRows
from engram.engine.pending import PendingPatch
from engram.engine.runners.decode_inputs import CAPTURE_ERROR_MODE, DecodeInputs, capture_progress, warm_up
from engram.engine.step import StepDescription
from engram.store.kernels import cache_probe

log = logging.getLogger(__name__)


def piece_ranges(engram_layer_ids, num_layers: int) -> list[tuple[int, int, int | None]]:
    """Ranges [lo, hi) cut before every Engram layer, each with the Engram layer it starts with (None: a plain one)."""
    engram = sorted(set(engram_layer_ids))
    cuts = sorted({0, num_layers, *engram})
    return [(lo, hi, lo if lo in engram else None) for lo, hi in zip(cuts, cuts[1:])]


class DecodePieces:
    """Decode steps' pieces over ``tables``; ``io`` (VerifyInputs: speculative verify steps, verify_pieces.py) replaces
    the decode steps' inputs, every layer's rows then copied in (no slabs). ``pool``: a graph pool shared with runners
    never replayed at once (None: one of its own). ``capture=False`` (tests, the CPU) runs what each piece holds
    eagerly, in the same order, on the same static inputs."""

    def __init__(self, model, kv, ecfg, tables: dict, max_batch: int, max_model_len: int, block_size: int,
                 null_block: int, device: torch.device, progress: bool | None = None, io=None, pool=None,
                 capture: bool = True):
        self.model, self.kv, self.device = model, kv, device
        self.n_cols = ecfg.n_cols
        self.ranges = piece_ranges(ecfg.layer_ids, len(model.model.layers))
        # {layer: its disk table} and a slab each, read by the executor, decoded in the piece
        self.slab_tables = ({lid: t for lid, t in tables.items() if getattr(t, "slab_reads", False)}
                            if io is None else {})
        self.slabs = {lid: t.new_slab(max_batch * self.n_cols, probe=True) for lid, t in self.slab_tables.items()}
        # slabs over a hot-row cache find their rows on the device: their row ids are inputs too
        self.probed = [lid for lid, slab in self.slabs.items() if slab.probe is not None]
        self.io = io if io is not None else DecodeInputs(max_batch, max_model_len, block_size, null_block,
                                                         self.n_cols, self.probed, -1, device)
        b = self.io.max_rows
        dtype = next(model.parameters()).dtype
        self.rows = {lid: torch.zeros(b, ecfg.n_cols, ecfg.head_dim, dtype=dtype, device=device)
                     for lid in ecfg.layer_ids}
        self.pieces: dict[int, list] = {}  # bucket -> its pieces (CUDA graphs; uncaptured: piece indices)
        self.logits: dict[int, torch.Tensor] = {}
        self._begun: tuple[int, int, int] | None = None  # (step id, bucket, next piece) after begin()
        # an event after each replay that decoded a slab, two a slab taking turns: a probed step's lookup waits
        # for the step before's while this step's is being recorded
        self._slab_decoded = {lid: [torch.cuda.Event(), torch.cuda.Event()] for lid in self.slabs}
        self._slab_turn = 0
        self.last_step_read = True  # whether the last finished lookups read from disk (finish_lookups)
        # each probed layer's resolve status (cache_probe: FOUND, WAITED, FAILED), read back with the tokens
        self.probe_status = torch.zeros(len(self.probed), dtype=torch.int32, device=device) if self.probed else None
        self.probe_counts = {"found": 0, "waited": 0}  # probed layers of collected steps, by status
        self.replays = 0
        self.captured = capture
        self._state = None  # uncaptured: the forward state the pieces of the step being run hand on
        self.pool_bytes, self.capture_s = 0, 0.0
        if not capture:
            if self.slabs:
                raise ValueError(f"DecodePieces(capture=False): layers {sorted(self.slabs)} read into slabs, which "
                                 "only captured pieces decode; uncaptured pieces copy every layer's rows in (io=...)")
            self.pieces = {size: list(range(len(self.ranges))) for size in self.io.buckets}
            return
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        before, t0 = torch.cuda.memory_reserved(device), time.perf_counter()
        for size in capture_progress(self.io.buckets, progress):
            self._capture(size)
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d piecewise CUDA graphs (%s %d..%d, %d pieces) in %.1f s; pool %.1f MiB",
                 len(self.io.buckets), self.io.unit, self.io.buckets[0], self.io.buckets[-1], len(self.ranges),
                 self.capture_s, self.pool_bytes / 2**20)

    def fits(self, step: StepDescription) -> bool:
        return self.io.fits(step)

    @property
    def probes_all(self) -> bool:
        """Whether every Engram layer's piece finds its rows without the host, so ``begin`` may queue the whole step."""
        return bool(self.probed) and len(self.probed) == len(self.rows)

    @property
    def flags(self) -> torch.Tensor | None:
        """The probed layers' statuses, read back with a step's tokens for ``check_flags``."""
        return self.probe_status

    def _decode_slab(self, layer_id: int, size: int) -> None:
        """Layer ``layer_id``'s slab decoded into its static rows [size, n_cols, D] (captured in its piece)."""
        rows = self.rows[layer_id][:size]
        probe = {}
        if layer_id in self.probed:  # slots found on the device (store/kernels/cache_probe.py)
            i = self.probed.index(layer_id)
            probe = dict(ids=self.io.row_ids[layer_id][:size].reshape(-1), plan=self.io.plan_id,
                         status=self.probe_status[i:i + 1])
        self.slab_tables[layer_id].decode_slab(self.slabs[layer_id], size * self.n_cols,
                                               out=rows.view(-1, rows.shape[-1]), **probe)

    def _inputs(self, size: int):
        return self.io.inputs(size, lambda layer_id: self.rows[layer_id][:size])

    def _piece(self, size: int, k: int, inputs, state):
        """What piece ``k`` of bucket ``size`` holds (``state`` None: the first) -> the forward state it hands on; the
        last piece leaves the logits [size, vocab] float32 in ``self.logits[size]``."""
        lo, hi, lid = self.ranges[k]
        if state is None:
            state = self.model.forward_begin(inputs, self.kv)
        if lid in self.slabs:
            self._decode_slab(lid, size)
        self.model.forward_layers(state, lo, hi)
        if k == len(self.ranges) - 1:
            self.logits[size] = self.model.compute_logits(self.model.forward_end(state))
        return state

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        """One graph per layer range, in the shared pool; replaying them in order is the whole step."""
        inputs = self._inputs(size)

        def whole_step() -> None:
            self.model.compute_logits(self.model.forward(inputs, self.kv))
            for lid in self.slabs:
                self._decode_slab(lid, size)

        warm_up(self.device, whole_step)
        pieces, state = [], None
        for k in range(len(self.ranges)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE):
                state = self._piece(size, k, inputs, state)
            pieces.append(graph)
        self.pieces[size] = pieces

    @torch.inference_mode()
    def begin(self, step: StepDescription, patch: PendingPatch | None = None, whole: bool = False) -> None:
        """Queue the inputs and the pieces before the first Engram layer (all with ``whole``); ``run`` does the rest."""
        size = self.io.fill(step, patch)
        k = 0
        self._slab_turn = 1 - self._slab_turn
        while k < len(self.ranges) and (whole or self.ranges[k][2] is None):
            self._replay_piece(size, k)
            k += 1
        self._begun = (step.step_id, size, k)

    def _replay_piece(self, size: int, k: int) -> None:
        """Replay piece ``k`` of bucket ``size``; after a piece that decodes a slab, an event (``_settle_slab``)."""
        if not self.captured:  # no slabs here (refused at construction): nothing to record
            with torch.inference_mode():
                state = self._state if k else None
                self._state = self._piece(size, k, None if k else self._inputs(size), state)
            return
        self.pieces[size][k].replay()
        lid = self.ranges[k][2]
        if lid in self.slabs:
            self._slab_decoded[lid][self._slab_turn].record()

    @torch.inference_mode()
    def run(self, step: StepDescription, staged: StagedRows | None, patch: PendingPatch | None = None) -> torch.Tensor:
        """Replay what ``begin(step)`` (called here if need be) left -> logits [N, vocab] of the step's N sampled rows,
        a view the next replay overwrites; each piece gets its rows right before it (``io.place``). ``staged`` None
        after a whole ``begin``."""
        begun, self._begun = self._begun, None
        if begun is None or begun[0] != step.step_id:
            self.begin(step, patch)
            begun, self._begun = self._begun, None
        _, size, first = begun
        if staged is None:  # the whole step was queued; its lookups run elsewhere
            if first < len(self.ranges):
                raise RuntimeError(f"step {step.step_id}: no staged rows, but begin() left pieces to replay")
        else:
            try:
                self.read_lookups(step, staged, first, release=False)
                for k in range(first, len(self.ranges)):
                    lid = self.ranges[k][2]
                    if lid is not None:
                        rows = staged.rows(lid, step.step_id)  # a slab layer: None once its pages are in the slab
                        if lid not in self.slabs:
                            self.io.place(self.rows[lid], rows, size)
                    self._replay_piece(size, k)
            except BaseException:
                self.abort_lookups(step.step_id)
                raise
            finally:
                self.finish_lookups()
        self.replays += 1
        self._state = None
        return self.logits[size][:len(step.samples)]

    def read_lookups(self, step: StepDescription, staged: StagedRows, first: int | None = None,
                     release: bool = True, after_each: Callable[[], None] | None = None) -> None:
        """Run, in layer order, the lookups of layers whose pieces are queued (all when ``first`` is None), signalling
        each flag; a failure aborts the waiting pieces and is raised. ``release``, ``after_each()``: after each one."""
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

    def _settle_slab(self, lid: int) -> None:
        """After layer ``lid``'s lookup (not sooner: that lookup writes what this step's piece may wait for), the slab's
        next lookup and cache writes wait for this step's decode of it (``slab.done``)."""
        slab = self.slabs[lid]
        slab.done = self._slab_decoded[lid][self._slab_turn]
        cache = getattr(self.slab_tables[lid], "cache", None)
        if cache is not None:  # writes into the cache's storage wait for this replay's gather
            cache.note_read(slab.done)

    def finish_lookups(self) -> None:
        """After a step's lookups, on the engine's thread: slabs' next lookups wait for this step's decodes and the rows
        read are handed to late caching (``admit_probed``). ``last_step_read``: whether any row came from disk."""
        for lid in self.slabs:
            self._settle_slab(lid)
        read = [self.slab_tables[lid].admit_probed(self.slabs[lid]) for lid in self.probed]
        self.last_step_read = any(read)

    def abort_lookups(self, step_id: int) -> None:
        """A step's lookups failed or will not run: pieces still waiting for a probed layer's flag give up."""
        for lid in self.probed:
            cache_probe.signal(self.slabs[lid].probe.flag, step_id, ok=False)

    def check_flags(self, step_id: int, flags: torch.Tensor | None) -> None:
        """Count the probed layers' statuses (``probe_counts``); raise when one gave up waiting (FAILED)."""
        if flags is None:
            return
        status = flags.tolist()
        self.probe_counts["waited"] += sum(st == cache_probe.WAITED for st in status)
        self.probe_counts["found"] += sum(st == cache_probe.FOUND for st in status)
        layers = [lid for lid, st in zip(self.probed, status) if st == cache_probe.FAILED]
        if layers:
            raise RuntimeError(f"step {step_id}: Engram layer(s) {layers} waited for rows their lookup did not "
                               "deliver (the lookup failed, or the wait gave up after cache_probe.SPIN_LIMIT reads)")
