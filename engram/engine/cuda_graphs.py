"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start, replayed per step.

A decode step (every sequence computes one token) of S sequences replays the graph of the smallest bucket
B >= S (buckets 1, 2, 4, 8, 16, 24, 32, then every 16 up to min(max_num_seqs, max_graph_batch), as vLLM does). The graph
reads static buffers, filled before each replay from the StepDescription: token ids, positions, KV lengths,
slot mapping, block tables [B, max_blocks] and each Engram layer's row ids [B, n_cols] through one pinned
buffer and one non-blocking copy. When every table gathers device ids as device work alone (tier gpu, tier
host without a hot-row cache: ``gathers_on_device``), the gathers (+ MXFP8 dequant) are captured in the
graph, reading the row-id buffer into the static rows [B, n_cols, head_dim] (with ``lookup_overlap`` on a
branch of the graph forked at its start, joined at each Engram layer: engine/lookup_stream.py); otherwise
(disk tier, hot-row
caches) the lookup executor stages the rows eagerly and they are copied in before the replay. Stale rows
(with the lookup branch): no Python runs inside a replay, so the branch tags each layer's rows with the
replayed step's plan id (a static buffer filled with the other inputs) and the consuming layer compares
that tag with the plan id into a per-layer flag (``stale``), which the Worker copies to the host with the
sampled tokens and checks; a layer that read rows gathered for another step fails the step loudly. The S..B padding
sequences decode token 0 at position 0 into a reserved KV block that no real sequence owns, so their
writes touch nothing real; their logits are dropped. Attention inside the graph is the Triton path with
its split count fixed by ``max_model_len``. What runs eager, and why: prefill and mixed steps (their
shapes change every step), batches above the largest bucket (logged once), the paper variant (its
per-sequence conv state is gathered and scattered in Python), steps with DEAD tokens, float64 and the
torch attention reference. ``replays`` counts replays, so tests can tell a silent eager fallback.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time

import numpy as np
import torch

from engram.engine.graph_slabs import SlabSteps
from engram.engine.lookup import StagedRows
from engram.engine.lookup_stream import LookupStream
from engram.engine.pending import PendingPatch
from engram.engine.step import StepDescription
from engram.fast_path import env_flag
from engram.module import Projected
from engram.model.inputs import StepInputs
from engram.model.layers import paged_attention as pa
from engram.model.layers.attention import AttentionMetadata
from engram.store.kernels import cache_probe

log = logging.getLogger(__name__)

# Piecewise decode graphs for tables whose rows are copied in before a replay (the disk tier, hot-row
# caches): one graph per range of layers, cut at each Engram layer, so the host waits for a layer's reads
# while the layers before it replay (tests/gpu/test_piecewise_graphs.py). On unless
# ENGRAM_PIECEWISE_GRAPHS=0 (one graph per bucket, every row copied in before it).
PIECEWISE = os.environ.get("ENGRAM_PIECEWISE_GRAPHS", "1") != "0"
# Disk tables' rows decoded inside the pieces (on unless ENGRAM_DISK_DECODE_IN_GRAPH=0; kernel switch
# ``disk_decode_in_graph``; a 4b-like batch-1 step on the H200 took 4.33 ms against 4.81 with the rows
# decoded outside the graph, batch 64 the same within its spread, 498c1bd): each such Engram layer (a disk
# table without a hot-row cache) gets a slab of its table (store/page_slabs.py, pinned) sized for the largest
# bucket; a step's lookup only reads the pages into it (``DiskTable.read_slab``), and the piece that starts
# with the layer decodes the slab with the UVA gather it captured (``DiskTable.decode_slab``, reading the
# slots over UVA too), so no decode kernel is launched from Python and no rows are copied in on the step's
# critical path. When every Engram layer is such a layer the worker queues the first pieces before it waits
# for the step's row ids (``DecodeGraphs.begin``).
# Only this thread's unsafe CUDA calls may break a capture: another thread's (a table's lookup finishing in
# the background, which allocates pinned staging or copies to the device) would invalidate a "global"-mode
# capture of another engine's graphs. vLLM, SGLang and TensorRT's backend capture this way for the same reason.
CAPTURE_ERROR_MODE = "thread_local"
DISK_DECODE_IN_GRAPH = env_flag("ENGRAM_DISK_DECODE_IN_GRAPH", default=True)
# Slabs over a hot-row cache find their rows on the device (store/kernels/cache_probe.py): the piece probes the
# cache's mirrored tags and waits for the host's lookup (a pinned flag) only when a row is missing, so a decode
# step whose rows are all cached never waits for the host; the worker then queues the whole step before its
# lookups (``begin(whole=True)``) and runs them on a thread of their own beside its host work
# (``read_lookups``, engine/step_lookups.py; inline in ``run`` with ENGRAM_BACKGROUND_LOOKUPS=0), then caches
# the rows they read (``finish_lookups``: DiskTable.admit_probed, device work only once no piece waits). On
# unless ENGRAM_CACHE_PROBE=0 (the host's slots, waited for before each piece).
CACHE_PROBE = env_flag("ENGRAM_CACHE_PROBE", default=True)


def piece_ranges(engram_layer_ids, num_layers: int) -> list[tuple[int, int, int | None]]:
    """Layer ranges [lo, hi) of a piecewise decode graph, cut before every Engram layer, with the Engram
    layer each range starts with (None for a range that starts with a plain layer): every piece needs at
    most the rows of its first layer, copied in right before it replays."""
    engram = sorted(set(engram_layer_ids))
    cuts = sorted({0, num_layers, *engram})
    return [(lo, hi, lo if lo in engram else None) for lo, hi in zip(cuts, cuts[1:])]


def graph_reserve_bytes(config, step_peak_bytes: int | None) -> int:
    """What the KV plan sets aside for the graphs' memory pool: a decode step of B tokens (the largest
    bucket) needs about B / max_num_batched_tokens of the profiled largest step's peak (activations scale
    with tokens). The pool's real size is measured after capture (``pool_bytes``, in the Worker's stats)."""
    if step_peak_bytes is None:
        return 0
    return step_peak_bytes * min(config.max_num_seqs, config.max_graph_batch) // config.max_num_batched_tokens


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 24, 32, then every 16, up to and including max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32) if b < max_num_seqs]
    sizes += list(range(48, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs(SlabSteps):
    def __init__(self, model, kv, ecfg, max_batch: int, max_model_len: int, block_size: int,
                 null_block: int, device: torch.device, progress: bool | None = None, tables: dict | None = None,
                 lookup_stream: LookupStream | None = None, run_ahead: bool = True):
        self.model, self.kv, self.device = model, kv, device
        self.lookup_stream = lookup_stream  # in-graph gathers on a forked branch (lookup_overlap)
        # The Engram gathers go inside the graphs when every table can gather device ids as device work alone
        # (ENGRAM_GRAPH_LOOKUPS=0, a debugging switch, keeps them in the lookup executor).
        in_graph = os.environ.get("ENGRAM_GRAPH_LOOKUPS", "1") != "0"
        self.tables = tables if in_graph and tables and all(t.gathers_on_device for t in tables.values()) else None
        self.n_cols = ecfg.n_cols if ecfg else 0
        self.buckets = graph_buckets(max_batch)
        self.max_model_len, self.block_size, self.null_block = max_model_len, block_size, null_block
        self.max_blocks = -(-max_model_len // block_size)
        b = self.buckets[-1]
        # Every per-step input in one int64 buffer, [token ids | positions | KV lengths | slots | block tables |
        # Engram row ids per layer (in-graph lookups)], staged in pinned memory and copied with one non-blocking
        # copy per step. Two pinned buffers take turns: with async scheduling a step is filled while the copy
        # of the one before may still be queued; an event per buffer says when its copy has run.
        # Piecewise (PIECEWISE, rows copied in, an Engram model): per bucket one graph per layer range
        engram_layers = list(ecfg.layer_ids) if ecfg else []
        self.ranges = (piece_ranges(engram_layers, len(model.model.layers))
                       if PIECEWISE and self.tables is None and engram_layers else [])
        # DISK_DECODE_IN_GRAPH: {layer: its disk table} and a slab each, read by the executor, decoded in the piece
        self.slab_tables = ({lid: t for lid, t in (tables or {}).items()
                             if lid in engram_layers and getattr(t, "slab_reads", False)}
                            if DISK_DECODE_IN_GRAPH and self.ranges else {})
        self.slabs = {lid: t.new_slab(b * self.n_cols, probe=CACHE_PROBE) for lid, t in self.slab_tables.items()}
        # Slabs over a hot-row cache find their rows on the device (CACHE_PROBE): their row ids are inputs too
        self.probed = [lid for lid, slab in self.slabs.items() if slab.probe is not None]
        self.layer_ids = list(self.tables) if self.tables else list(self.probed)
        n = b * (4 + self.max_blocks + self.n_cols * len(self.layer_ids)) + 1  # + the step's plan id (last)
        self.host_in = [torch.zeros(n, dtype=torch.long).pin_memory() for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in range(2)]
        self._turn = 0
        self._begun: tuple[int, int, int] | None = None  # (step id, bucket, next piece) after begin()
        self.dev_in = torch.zeros(n, dtype=torch.long, device=device)
        self._host_np = [buf.numpy() for buf in self.host_in]
        self._host = [self._views(buf, b) for buf in self._host_np]  # numpy views of the pinned buffers
        self.token_ids, self.positions, self.context_lens, self.slot_mapping, self.block_tables, self.row_ids = (
            self._views(self.dev_in, b))
        self.plan_id = self.dev_in[-1:]  # [1]: the id of the step being replayed
        # Stale-row check of the in-graph lookup branch (lookup_overlap): the branch tags each layer's rows with
        # the plan id it gathered them for; each consumer compares the tag with the replayed step's plan id and
        # writes its layer's flag, which the Worker reads back with the sampled tokens (``stale``).
        checks = lookup_stream is not None and self.tables is not None
        self.row_tags = torch.full((len(self.layer_ids),), -1, dtype=torch.long, device=device) if checks else None
        self.stale = torch.zeros(len(self.layer_ids), dtype=torch.bool, device=device) if checks else None
        self.context_lens.fill_(1)
        for lid in self.probed:  # padding everywhere until a step fills them: the capture warm-up must not wait
            self.row_ids[lid].fill_(-1)
        self.slot_mapping.fill_(null_block * block_size)
        self.block_tables.fill_(null_block)
        self.arange = torch.arange(b + 1, dtype=torch.long, device=device)
        dtype = next(model.parameters()).dtype
        self.rows = {lid: torch.zeros(b, ecfg.n_cols, ecfg.head_dim, dtype=dtype, device=device)
                     for lid in (ecfg.layer_ids if ecfg else ())}
        # WKV run-ahead in the graph (lookup_overlap, v41): each layer's projected rows, written on the lookup branch
        self.engram = {lid: model.model.layers[lid].engram for lid in self.rows}
        ahead = lookup_stream is not None and run_ahead and self.tables is not None and ecfg.variant == "v41"
        self.projected = ({lid: torch.zeros(b, (ecfg.hc_mult + 1) * ecfg.hidden_size, dtype=dtype, device=device)
                           for lid in self.rows} if ahead else {})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # an event after each replay that decoded a slab, two a slab taking turns: a probed step's lookup waits
        # for the step before's while this step's is being recorded
        self._slab_decoded = {lid: [torch.cuda.Event(), torch.cuda.Event()] for lid in self.slabs}
        self._slab_turn = 0
        self.last_step_read = True  # whether the last finished lookups read from disk (finish_lookups)
        # each probed layer's resolve status (cache_probe: FOUND, WAITED, FAILED), read back with the tokens
        self.probe_status = torch.zeros(len(self.probed), dtype=torch.int32, device=device) if self.probed else None
        self.probe_counts = {"found": 0, "waited": 0}  # probed layers of collected steps, by status
        self.replays = 0
        self._warned_too_large = False
        self.pool = torch.cuda.graph_pool_handle()
        before, t0 = torch.cuda.memory_reserved(device), time.perf_counter()
        from tqdm.auto import tqdm

        bar = tqdm(list(reversed(self.buckets)), desc="capture CUDA graphs", unit="graph",
                   disable=None if progress is None else not progress)
        for size in bar:  # largest first: the smaller ones reuse its pool
            self._capture(size)
        for table in (self.tables or {}).values():  # capture gathered once per bucket: not lookups
            table.reset_stats()
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s; pool %.1f MiB", len(self.buckets),
                 self.buckets[0], self.buckets[-1], self.capture_s, self.pool_bytes / 2**20)

    def _views(self, buf, b: int):
        """token ids [b], positions [b], KV lengths [b], slots [b], block tables [b, max_blocks] and
        {layer: row ids [b, n_cols]} of ``buf``."""
        parts = [buf[i * b:(i + 1) * b] for i in range(4)]
        at = b * (4 + self.max_blocks)
        tables = buf[4 * b:at].reshape(b, self.max_blocks)
        ids = {lid: buf[at + i * b * self.n_cols:at + (i + 1) * b * self.n_cols].reshape(b, self.n_cols)
               for i, lid in enumerate(self.layer_ids)}
        return (*parts, tables, ids)

    @staticmethod
    def supports(step_dtype: torch.dtype, ecfg, device: torch.device) -> bool:
        """Whether a model of this kind can run its decode steps as graphs at all."""
        if device.type != "cuda" or step_dtype not in pa.FAST_DTYPES or pa.SWITCH.value == "torch":
            return False
        return ecfg is None or ecfg.variant != "paper"

    def fits(self, step: StepDescription) -> bool:
        if step.dead_mask is not None or step.prompt_logprobs or any(n != 1 for n in step.num_new_tokens):
            return False
        if len(step.sample_rows) != step.num_seqs:  # a one-token prompt chunk that does not sample yet
            return False
        if step.num_seqs > self.buckets[-1]:
            if not self._warned_too_large:
                log.info("decode batch of %d sequences is above the largest CUDA graph (%d): runs eager",
                         step.num_seqs, self.buckets[-1])
                self._warned_too_large = True
            return False
        return True

    def _inputs(self, size: int) -> StepInputs:
        idx = self.arange[:size]
        meta = AttentionMetadata(starts=[], q_lens=[], context_lens=[], block_tables=self.block_tables[:size],
                                 slot_mapping=self.slot_mapping[:size], write_keep=None, decode_seqs=idx,
                                 decode_tokens=idx, decode_lens=self.context_lens[:size],
                                 decode_max_len=self.max_model_len)
        return StepInputs(token_ids=self.token_ids[:size], positions=self.positions[:size],
                          cu_seqlens=self.arange[:size + 1], context_lens=self.context_lens[:size],
                          block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
                          engram_rows=lambda layer_id: self._consume(layer_id, size), logits_indices=idx,
                          attention=meta)

    def _consume(self, layer_id: int, size: int) -> torch.Tensor:
        """Layer ``layer_id``'s static rows [size, n_cols, D], after its gather when that runs on the lookup
        stream (a captured wait: the graph's lookup branch joins the main stream here)."""
        if self.lookup_stream is not None and self.tables is not None:
            self.lookup_stream.wait(layer_id)
            i = self.layer_ids.index(layer_id)
            torch.ne(self.row_tags[i:i + 1], self.plan_id, out=self.stale[i:i + 1])
        if self.projected:
            return Projected(size, (self.projected[layer_id][:size],))
        return self.rows[layer_id][:size]

    def _forward(self, size: int, inputs: StepInputs) -> torch.Tensor:
        """What a graph holds: the Engram gathers (when in the graph), the model, the logits [size, vocab]."""
        if self.tables is not None:
            with self.lookup_stream.issue() if self.lookup_stream is not None else contextlib.nullcontext():
                for lid, table in self.tables.items():
                    rows = self.rows[lid][:size]  # [size, n_cols, D]
                    table.gather(self.row_ids[lid][:size].reshape(-1), out=rows.view(-1, rows.shape[-1]),
                                 dtype=rows.dtype)
                    if self.projected:  # WKV run-ahead: the projection needs no hidden state
                        self.engram[lid].project(rows, rows.dtype, out=self.projected[lid][:size])
                    if self.lookup_stream is not None:
                        i = self.layer_ids.index(lid)
                        self.row_tags[i:i + 1].copy_(self.plan_id)  # these rows are the replayed step's
                        self.lookup_stream.done(lid)
        logits = self.model.compute_logits(self.model.forward(inputs, self.kv))
        if self.tables is not None and self.lookup_stream is not None:
            self.lookup_stream.join()  # CUDA requires the branch joined; the consumers' waits already did
        return logits

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        inputs = self._inputs(size)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks its kernels
            self._forward(size, inputs)
            for lid in self.slabs:
                self._decode_slab(lid, size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.ranges:
            self._capture_pieces(size, inputs)
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE):
            logits = self._forward(size, inputs)  # [size, vocab] float32
        self.graphs[size], self.logits[size] = graph, logits

    def _capture_pieces(self, size: int, inputs: StepInputs) -> None:
        """One graph per layer range, in the shared pool: the first also embeds, the last also makes the
        logits; each reads the streams the one before it wrote (tensors of the pool, kept alive by the
        state), so replaying them in order is the whole step."""
        pieces, state, logits = [], None, None
        for k, (lo, hi, lid) in enumerate(self.ranges):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE):
                if state is None:
                    state = self.model.forward_begin(inputs, self.kv)
                if lid in self.slabs:
                    self._decode_slab(lid, size)
                self.model.forward_layers(state, lo, hi)
                if k == len(self.ranges) - 1:
                    logits = self.model.compute_logits(self.model.forward_end(state))  # [size, vocab] float32
            pieces.append(graph)
        self.pieces[size], self.logits[size] = pieces, logits

    def _fill_inputs(self, step: StepDescription, patch: PendingPatch | None) -> int:
        """The step's tokens, positions, KV slots, block tables and row ids into the static inputs of its
        bucket (padded), patched on the device with the pending tokens -> the bucket size."""
        s = step.num_seqs
        size = next(b for b in self.buckets if b >= s)
        turn, self._turn = self._turn, 1 - self._turn
        if not self._copied[turn].query():  # this buffer's previous copy (two steps ago) has run: no wait
            self._copied[turn].synchronize()
        tok, pos, ctx, slots, tables, row_ids = self._host[turn]  # numpy views of a pinned staging buffer
        tok[:s], pos[:s], ctx[:s], slots[:s] = (step.token_ids.numpy(), step.positions.numpy(),
                                                step.context_lens.numpy(), step.slot_mapping.numpy())
        tok[s:size], pos[s:size], ctx[s:size], slots[s:size] = 0, 0, 1, self.null_block * self.block_size
        bt = step.block_tables.numpy()  # [S, W], -1 padded
        tables[:size] = self.null_block
        tables[:s, :bt.shape[1]] = np.where(bt >= 0, bt, self.null_block)
        for lid, ids in row_ids.items():
            ids[:s] = step.engram_row_ids[lid].numpy()  # [S, n_cols]
            ids[s:size] = -1 if self.probed else 0  # padding: no row (a probe skips it), or row 0 (a gather)
        self._host_np[turn][-1] = step.step_id  # the plan id the lookup branch tags its rows with
        self.dev_in.copy_(self.host_in[turn], non_blocking=True)
        self._copied[turn].record()
        if patch is not None:
            self.token_ids.index_copy_(0, patch.rows, patch.token_ids)
            for lid, ids in self.row_ids.items():
                ids.index_copy_(0, patch.rows, patch.row_ids[lid])
        return size

    @property
    def flags(self) -> torch.Tensor | None:
        """What the Worker reads back with a graph step's tokens and hands to ``check_flags``: the lookup
        branch's stale-row flags, or the probed layers' statuses (never both: those are disk tables)."""
        return self.stale if self.stale is not None else self.probe_status

    def check_flags(self, step_id: int, flags: torch.Tensor) -> None:
        """Raise when a host copy of ``flags`` marks a layer: it read rows that were not its step's. Counts
        the probed layers' statuses (``probe_counts``)."""
        if self.stale is not None:
            if not bool(flags.any()):
                return
            layers = [lid for lid, bad in zip(self.layer_ids, flags.tolist()) if bad]
            raise RuntimeError(f"step {step_id}: stale Engram rows: layer(s) {layers} read rows their lookup "
                               "branch had not yet gathered for this step (a missing wait on the lookup stream)")
        status = flags.tolist()
        self.probe_counts["waited"] += sum(st == cache_probe.WAITED for st in status)
        self.probe_counts["found"] += sum(st == cache_probe.FOUND for st in status)
        layers = [lid for lid, st in zip(self.probed, status) if st == cache_probe.FAILED]
        if not layers:
            return
        raise RuntimeError(f"step {step_id}: Engram layer(s) {layers} waited for rows their lookup did not "
                           "deliver (the lookup failed, or the wait gave up after cache_probe.SPIN_LIMIT reads)")

    @torch.inference_mode()
    def begin(self, step: StepDescription, patch: PendingPatch | None = None, whole: bool = False) -> None:
        """The part of ``run`` that needs no Engram rows, queued now: the step's inputs and, piecewise, the
        pieces before the first Engram layer (embedding, layer 0); with ``whole`` (``probes_all``) every
        piece, since each finds its rows on the device and waits only for rows its lookup has yet to read.
        ``run`` of the same step then replays the rest (or only waits for the lookups). The worker calls it
        before it waits for the step's row ids on the host, so the device goes on from the step before to
        these pieces while the host reads the first Engram layer's rows."""
        size = self._fill_inputs(step, patch)
        k = 0
        self._slab_turn = 1 - self._slab_turn
        while k < len(self.ranges) and (whole or self.ranges[k][2] is None):
            self._replay_piece(size, k)
            k += 1
        self._begun = (step.step_id, size, k)

    def _replay_piece(self, size: int, k: int) -> None:
        """Replay piece ``k`` of bucket ``size``; after a piece that decodes a slab, an event (``_settle_slab``)."""
        self.pieces[size][k].replay()
        lid = self.ranges[k][2]
        if lid in self.slabs:
            self._slab_decoded[lid][self._slab_turn].record()

    @torch.inference_mode()
    def run(self, step: StepDescription, staged: StagedRows | None, patch: PendingPatch | None = None) -> torch.Tensor:
        """Fill the static buffers from the step, replay its bucket's graph -> logits [S, vocab] (a view that
        the next replay overwrites: sample from it first). ``staged``: the lookup executor's rows, needed
        unless the gathers are in the graph (then, if given, they were counted by the executor). ``patch``:
        pending tokens (async scheduling), written into the static token and row-id buffers on the device.
        After ``begin(step)`` only what it left: the pieces from the first Engram layer on, then the lookups
        of layers whose pieces ``begin`` queued already (probed slabs). ``staged`` None after a whole
        ``begin``: nothing is left; the caller runs ``read_lookups`` and ``finish_lookups`` itself."""
        s = step.num_seqs
        begun, self._begun = self._begun, None
        if begun is not None and begun[0] == step.step_id:
            _, size, first = begun
        else:
            self.begin(step, patch)
            _, size, first = self._begun
            self._begun = None
        if self.ranges and staged is None:  # the whole step was queued; its lookups run elsewhere
            if first < len(self.ranges):
                raise RuntimeError(f"step {step.step_id}: no staged rows, but begin() left pieces to replay")
        elif self.ranges:  # each piece's rows right before it: the host waits for them while earlier pieces run
            try:
                self.read_lookups(step, staged, first, release=False)
                for k in range(first, len(self.ranges)):
                    lid = self.ranges[k][2]
                    if lid is not None:
                        rows = staged.rows(lid, step.step_id)  # a slab layer: None once its pages are in the slab
                        if lid not in self.slabs:
                            self.rows[lid][:s].copy_(rows)
                    self._replay_piece(size, k)
            except BaseException:
                if self.probed:
                    self.abort_lookups(step.step_id)
                raise
            finally:
                self.finish_lookups()
        else:
            if self.tables is None:
                for lid, buf in self.rows.items():
                    buf[:s].copy_(staged.rows(lid, step.step_id))
            self.graphs[size].replay()
        self.replays += 1
        if self.tables is not None and staged is None:
            for lid, table in self.tables.items():
                table.record_lookups(1, s * self.n_cols)
        return self.logits[size][:s]
