"""The graph runner: steps as one CUDA graph per bucket of its static inputs (decode steps by batch size, mixed steps
by token count), with the gathers of tables that gather on the device (``gathers_on_device``) inside
(tensor-parallel column shards: split around their all-gather, runners/column_gathers.py). With ``lookup_overlap``
the gathers and projections run on a branch joined at each Engram layer; each layer compares its rows' plan-id tag
with the replayed step's into a ``stale`` flag, checked after the step (a mismatch fails it). ``replays`` counts
replays for tests."""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from engram.engine.lookup_stream import LookupStream
from engram.engine.pending import PendingPatch
from engram.engine.runners.column_gathers import gather_columns
from engram.engine.runners.base import Forward, StepRunner
from engram.engine.runners.decode_inputs import CAPTURE_ERROR_MODE, capture_progress, warm_up
from engram.engine.step import StepDescription
from engram.module import Projected

log = logging.getLogger(__name__)


class GraphRunner(StepRunner):
    """``io``: the static inputs and buckets of the steps it runs (DecodeInputs: decode steps by batch size, "graph";
    MixedInputs: mixed steps by token count, "mixed-graph"); runners sharing ``pool`` are never replayed at once.
    ``capture=False`` (tests, the CPU) runs what a graph would hold eagerly on the same static inputs instead."""

    def __init__(self, model, kv, ecfg, tables: dict, io, device: torch.device, name: str = "graph",
                 progress: bool | None = None, lookup_stream: LookupStream | None = None, pool=None,
                 capture: bool = True):
        self.model, self.kv, self.device, self.name = model, kv, device, name
        self.tables = tables  # {layer: table}, each gathering inside the graphs ({} without Engram layers)
        self.lookup_stream = lookup_stream if tables else None  # in-graph gathers on a forked branch
        self.layer_ids = list(tables)
        self.n_cols = ecfg.n_cols if ecfg else 0
        self.columns = any(getattr(t, "column_layout", False) for t in tables.values())  # tensor-parallel shards
        self.io = io
        b = self.io.max_rows
        checks = self.lookup_stream is not None
        self.row_tags = torch.full((len(self.layer_ids),), -1, dtype=torch.long, device=device) if checks else None
        self.stale = torch.zeros(len(self.layer_ids), dtype=torch.bool, device=device) if checks else None
        dtype = next(model.parameters()).dtype
        self.rows = {lid: torch.zeros(b, ecfg.n_cols, ecfg.head_dim, dtype=dtype, device=device)
                     for lid in self.layer_ids}
        self.engram = {lid: model.model.layers[lid].engram for lid in self.rows}
        ahead = self.lookup_stream is not None and ecfg.variant == "v41"  # each layer's projected rows
        self.projected = ({lid: torch.zeros(b, (ecfg.hc_mult + 1) * ecfg.hidden_size, dtype=dtype, device=device)
                           for lid in self.rows} if ahead else {})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.captured = capture
        self.pool_bytes, self.capture_s = 0, 0.0
        if capture:
            self._capture_all(pool, progress)

    def _capture_all(self, pool, progress: bool | None) -> None:
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        device = self.device
        before, t0 = torch.cuda.memory_reserved(device), time.perf_counter()
        for size in capture_progress(self.io.buckets, progress):
            self._capture(size)
        for table in self.tables.values():  # the captures gathered once per bucket: not lookups
            table.reset_stats()
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d %s CUDA graphs (%s %d..%d) in %.1f s; pool %.1f MiB", len(self.io.buckets), self.name,
                 self.io.unit, self.io.buckets[0], self.io.buckets[-1], self.capture_s, self.pool_bytes / 2**20)

    def covers(self, step: StepDescription) -> bool:
        return self.io.fits(step)

    def _consume(self, layer_id: int, size: int) -> torch.Tensor:
        """Layer ``layer_id``'s static rows [size, n_cols, D], after a captured wait for its gather on the branch."""
        if self.lookup_stream is not None:
            self.lookup_stream.wait(layer_id)
            i = self.layer_ids.index(layer_id)
            torch.ne(self.row_tags[i:i + 1], self.io.plan_id, out=self.stale[i:i + 1])
        if self.projected:
            return Projected(size, (self.projected[layer_id][:size],))
        return self.rows[layer_id][:size]

    def _forward(self, size: int) -> torch.Tensor:
        """What a graph holds: the Engram gathers, the model, the logits [size, vocab] float32."""
        inputs = self.io.inputs(size, lambda layer_id: self._consume(layer_id, size))
        def finish(i: int, lid: int) -> None:  # on the lookup branch, after layer ``lid``'s rows are written
            if self.projected:  # WKV run-ahead: the projection needs no hidden state
                self.engram[lid].project(self.rows[lid][:size], self.rows[lid].dtype, out=self.projected[lid][:size])
            if self.lookup_stream is not None:
                self.row_tags[i:i + 1].copy_(self.io.plan_id)  # these rows are the replayed step's
                self.lookup_stream.done(lid)

        if self.columns:  # tensor-parallel column shards: their all-gathers at the step's fixed point
            gather_columns(self.tables, {lid: self.io.row_ids[lid][:size] for lid in self.tables},
                           {lid: self.rows[lid][:size] for lid in self.tables}, self.lookup_stream, finish)
        else:
            branch = self.lookup_stream.issue() if self.lookup_stream is not None else contextlib.nullcontext()
            with branch:
                for i, (lid, table) in enumerate(self.tables.items()):
                    rows = self.rows[lid][:size]  # [size, n_cols, D]
                    table.gather(self.io.row_ids[lid][:size].reshape(-1), out=rows.view(-1, rows.shape[-1]),
                                 dtype=rows.dtype)
                    finish(i, lid)
        logits = self.model.compute_logits(self.model.forward(inputs, self.kv))
        if self.lookup_stream is not None:
            self.lookup_stream.join()  # CUDA requires the branch joined; the consumers' waits already did
        return logits

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        warm_up(self.device, lambda: self._forward(size))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE):
            logits = self._forward(size)  # [size, vocab] float32
        self.graphs[size], self.logits[size] = graph, logits

    @torch.inference_mode()
    def launch(self, step: StepDescription, patch: PendingPatch | None) -> Forward:
        """Fill the static inputs, replay the bucket's graph -> logits [N, vocab], a view the next replay overwrites."""
        size = self.io.fill(step, patch)
        if self.captured:
            self.graphs[size].replay()
        else:
            self.logits[size] = self._forward(size)
        self.replays += 1
        for table in self.tables.values():
            table.record_lookups(1, step.num_tokens * self.n_cols)
        return Forward(self.logits[size][:len(step.samples)], self.stale)  # a row per spec (verify rows too)

    def check(self, step_id: int, flags: torch.Tensor | None) -> None:
        if flags is None or not bool(flags.any()):
            return
        layers = [lid for lid, bad in zip(self.layer_ids, flags.tolist()) if bad]
        raise RuntimeError(f"step {step_id}: stale Engram rows: layer(s) {layers} read rows their lookup "
                           "branch had not yet gathered for this step (a missing wait on the lookup stream)")

    def stats(self) -> dict:
        return {f"{self.name.replace('-', '_')}_replays": self.replays, f"{self.name.replace('-', '_')}_pool_bytes":
                self.pool_bytes}
