"""DeepSeek-V4 decode steps as CUDA graphs (``V4GraphRunner``, route "graph"): one graph a (batch bucket, context
span) pair, each holding the pages -> ``BatchedCache`` gathers, the batched static-shape decode step with the Engram
gathers inside, the write-back into the pages and the logits (runners/v4_batched_pages.py, model/deepseek_v4/
batched_decode.py). Per step, on the host: the step's ``PageIndex`` (positions and group tables, padded to the bucket)
copied into the span's static index, the token ids and Engram row ids into static buffers, then one replay; after it
the pool's host record of the positions the state pages hold (``commit``).

Buckets: the decode graphs' batch sizes (``graph_buckets``) times context spans: the entry capacity of a compressed
layer is span // ratio, and the graph of the smallest span at or above every sequence's position + 1 runs the step, so
a step at short contexts copies short entry buffers (a span is 1024 * 4^k tokens, the last max_model_len).

Padding rows (bucket rows past the step's sequences) decode token 0 at position 0 through one page no sequence holds
(``null_page``: the Worker's pool has one more page than the scheduler hands out): at position 0 every read of theirs is
masked to zero, and their writes (the new key, buffer slot 0) land in that page only, whatever they hold. Windows that
close for some sequences and not others are masked writes inside the same graph (counted: ``partial_closes``).

Engram rows: where every table gathers on the device (gpu, host over UVA), the gathers run inside the graph from the
static row ids (tokens in flight patched in on the device); else (disk) the lookup executor stages the rows before the
replay and they are copied into the static rows. ``capture=False`` (the CPU, tests) runs the same callables uncaptured
on the same static inputs. Covered: decode-shaped steps (one token a sequence, every sequence sampling, no DEAD
tokens, prompt logprobs or drafts) of at most the largest bucket; the paper variant's conv states stay eager."""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from engram.engine.pending import PendingPatch
from engram.engine.runners.base import Forward, StepRunner
from engram.engine.runners.decode_inputs import CAPTURE_ERROR_MODE, capture_progress, graph_buckets, warm_up
from engram.engine.runners.group_pool import GroupPool
from engram.engine.runners.v4_batched_pages import BatchedPages, PageIndex
from engram.engine.step import StepDescription
from engram.model.deepseek_v4.batched_decode import decode_step
from engram.model.deepseek_v4.batched_state import BatchedCache
from engram.transfer import to_device

log = logging.getLogger(__name__)

__all__ = ["V4GraphRunner", "batched_cache_bytes", "context_spans", "covers_decode", "v4_graphs_wanted"]


def v4_graphs_wanted(config, ecfg, device: torch.device, dtype: torch.dtype, graph_capture: bool,
                     fast_dtypes) -> bool:
    """Whether a Worker of a DeepSeek-V4 model (the whole model, not a pipeline stage) runs decode steps through
    ``V4GraphRunner``: not ``enforce_eager``, not the paper variant, and CUDA in a fast dtype or uncaptured."""
    if config.enforce_eager or (ecfg is not None and ecfg.variant == "paper"):
        return False
    return not graph_capture or (device.type == "cuda" and dtype in fast_dtypes)


def context_spans(max_model_len: int) -> list[int]:
    """Context spans that get graphs: 1024 * 4^k below max_model_len, then max_model_len."""
    spans, s = [], 1024
    while s < max_model_len:
        spans.append(s)
        s *= 4
    return spans + [max_model_len]


def entry_caps(cfg, span: int) -> list[int]:
    """Per decoder layer the entry capacity of a span's graphs: span // ratio (at least 1; sliding layers 1)."""
    return [max(1, span // cfg.ratio(i)) if cfg.ratio(i) else 1 for i in range(cfg.num_layers)]


def cache_nbytes(cache) -> int:
    """Bytes of a ``BatchedCache``'s state tensors."""
    return sum(t.numel() * t.element_size() for st in cache.layers for t in st.tensors())


def batched_cache_bytes(model, dtype: torch.dtype, max_batch: int, max_model_len: int,
                        spans: list[int] | None = None) -> int:
    """Bytes of the batched caches a ``V4GraphRunner`` of these arguments allocates (one of the largest bucket per
    span), counted on the meta device before anything is allocated: what the memory plan sets aside for them."""
    b = graph_buckets(max_batch)[-1]
    return sum(cache_nbytes(BatchedCache.zeros(model, b, entry_caps(model.config, s), dtype, "meta"))
               for s in (spans if spans is not None else context_spans(max_model_len)))


def covers_decode(step: StepDescription) -> bool:
    """Decode-shaped: one new token a sequence, each sampled, no DEAD tokens, prompt logprobs or drafts."""
    return (step.dead_mask is None and not step.prompt_logprobs and not step.num_drafts
            and all(n == 1 for n in step.num_new_tokens) and len(step.sample_rows) == step.num_seqs)


class V4GraphRunner(StepRunner):
    """``model``: a DeepseekV4 causal LM; ``pool``: the Worker's GroupPool, ``null_page`` a page of it no sequence
    holds; ``tables``: {Engram layer: table}; ``lookup``: the Worker's lookup executor (rows staged for tables that do
    not gather on the device); ``spans``: context spans (None: ``context_spans``); ``rows_in_graph`` False: rows staged
    by the lookup executor and copied in, whatever the tables (tests of that path on the CPU)."""

    name = "graph"

    def __init__(self, model, pool: GroupPool, null_page: int, tables: dict, lookup, ecfg, max_batch: int,
                 max_model_len: int, device: torch.device, progress: bool | None = None, graph_pool=None,
                 capture: bool = True, spans: list[int] | None = None, rows_in_graph: bool | None = None):
        self.model, self.pool, self.null_page, self.device = model, pool, null_page, torch.device(device)
        self.tables, self.lookup, self.captured = tables, lookup, capture
        # None: inside where the graph may gather (uncaptured, or every table gathers on the device); False: staged
        self.in_graph = ((not capture or all(t.gathers_on_device for t in tables.values())) if rows_in_graph is None
                         else rows_in_graph)
        self.buckets = graph_buckets(max_batch)
        self.spans = sorted(spans) if spans is not None else context_spans(max_model_len)
        cfg = model.config
        b = self.buckets[-1]
        self.ratios = sorted({cfg.ratio(i) for i in range(cfg.num_layers)} - {0})
        self.n_cols = ecfg.n_cols if ecfg else 0
        self.pages = {s: BatchedPages(model, pool, entry_caps(cfg, s)) for s in self.spans}
        self.caches = {s: p.empty(b) for s, p in self.pages.items()}
        self.index = {s: self._padding_index(s, b) for s in self.spans}  # static: what the graphs read
        self.token_ids = torch.zeros(b, dtype=torch.long, device=self.device)
        dtype = next(model.parameters()).dtype
        n_cols, head_dim = (ecfg.n_cols, ecfg.head_dim) if ecfg else (0, 0)
        self.row_ids = {lid: torch.zeros(b, n_cols, dtype=torch.long, device=self.device) for lid in tables}
        self.rows = {lid: torch.zeros(b, n_cols, head_dim, dtype=dtype, device=self.device) for lid in tables}
        self.ropes = model.ropes(self.device)  # built once, outside any capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.replays = self.padded_rows = self.partial_closes = 0
        self.replays_by_span = {s: 0 for s in self.spans}
        self.pool_bytes, self.capture_s = 0, 0.0
        self.cache_bytes = sum(cache_nbytes(c) for c in self.caches.values())
        if capture:
            self._capture_all(graph_pool, progress)

    # ----------------------------------------------------------------- host
    def covers(self, step: StepDescription) -> bool:
        return (covers_decode(step) and step.num_seqs <= self.buckets[-1]
                and max(step.start_positions) + 1 <= self.spans[-1])

    def _pad(self, step: StepDescription, size: int) -> tuple[list[int], dict[str, torch.Tensor], list]:
        """(positions, group tables, sequence names) of the step padded to ``size`` rows with padding rows."""
        s = step.num_seqs
        positions = list(step.start_positions) + [0] * (size - s)
        tables = {}
        for name, t in step.group_tables.items():  # at least one column: a padding row's writes need its page
            width = max(1, t.shape[1])
            table = torch.full((size, width), self.null_page, dtype=t.dtype)
            table[:s] = -1  # no page (where a group holds none for any sequence yet)
            table[:s, :t.shape[1]] = t
            tables[name] = table
        return positions, tables, list(step.seq_ids) + [f"padding {i}" for i in range(size - s)]

    def _padding_index(self, span: int, size: int) -> PageIndex:
        """A static index of ``size`` padding rows (every table the null page): valid to replay at any time."""
        tables = {g.name: torch.full((size, max(1, g.pages_per_sequence)), self.null_page, dtype=torch.long)
                  for g in self.pool.layout.groups}
        return self.pages[span].index([0] * size, tables, [f"padding {i}" for i in range(size)])

    @torch.inference_mode()
    def launch(self, step: StepDescription, patch: PendingPatch | None) -> Forward:
        """Write the step into its bucket's static inputs, replay -> logits [S, vocab] (a view the next replay
        overwrites)."""
        s = step.num_seqs
        size = next(b for b in self.buckets if b >= s)
        span = next(x for x in self.spans if x >= max(step.start_positions) + 1)
        pages = self.pages[span]
        # on the host (raises, naming the sequence, before anything is written), then one copy a field up
        idx = pages.index(*self._pad(step, size), device="cpu")
        _copy_index(_head(self.index[span], size), idx)
        self.token_ids[:s].copy_(to_device(step.token_ids, self.device))  # pinned: never waits for the device
        self.token_ids[s:size].zero_()
        if patch is not None:
            self.token_ids.index_copy_(0, patch.rows, patch.token_ids)
        if self.in_graph:
            for lid, ids in self.row_ids.items():
                ids[:s].copy_(to_device(step.engram_row_ids[lid], self.device))
                ids[s:size].zero_()
                if patch is not None:
                    ids.index_copy_(0, patch.rows, patch.row_ids[lid])
        else:
            staged = self.lookup.submit(step, patch, project=False)
            try:
                for lid, rows in self.rows.items():
                    rows[:s].copy_(staged.rows(lid, step.step_id))
            finally:
                staged.release()
        key = (size, span)
        if self.captured:
            self.graphs[key].replay()
        else:
            self.logits[key] = self._forward(size, span)
        pages.commit(idx, s)
        self.replays += 1
        self.replays_by_span[span] += 1
        self.padded_rows += size - s
        shut = [any((p + 1) % r == 0 for r in self.ratios) for p in step.start_positions]
        self.partial_closes += any(shut) and not all(shut)
        if self.in_graph:
            for table in self.tables.values():
                table.record_lookups(1, s * self.n_cols)
        return Forward(self.logits[key][:s])

    # ----------------------------------------------------------------- what a graph holds
    def _forward(self, size: int, span: int) -> torch.Tensor:
        """The pages -> cache gathers, the Engram gathers, the decode step, the write-back -> logits [size, vocab]."""
        pages, cache, idx = self.pages[span], self.caches[span].head(size), _head(self.index[span], size)
        pages.fill(cache, idx)
        if self.in_graph:
            for lid, table in self.tables.items():
                rows = self.rows[lid][:size]
                table.gather(self.row_ids[lid][:size].reshape(-1), out=rows.view(-1, rows.shape[-1]),
                             dtype=rows.dtype)
        hidden = decode_step(self.model, self.token_ids[:size], cache, lambda lid: self.rows[lid][:size],
                             ropes=self.ropes)
        pages.write_back(cache, idx)
        return self.model.compute_logits(hidden)

    def _capture_all(self, graph_pool, progress: bool | None) -> None:
        self.graph_pool = graph_pool if graph_pool is not None else torch.cuda.graph_pool_handle()
        before, t0 = torch.cuda.memory_reserved(self.device), time.perf_counter()
        keys = [(b, s) for s in reversed(self.spans) for b in reversed(self.buckets)]  # largest first
        for size, span in capture_progress(keys, progress):
            self._capture(size, span)
        for table in self.tables.values():  # the captures gathered once per graph: not lookups
            table.reset_stats()
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d DeepSeek-V4 decode CUDA graphs (batch %d..%d x spans %s) in %.1f s; pool %.1f MiB, "
                 "batched caches %.1f MiB", len(keys), self.buckets[0], self.buckets[-1], self.spans,
                 self.capture_s, self.pool_bytes / 2**20, self.cache_bytes / 2**20)

    @torch.inference_mode()
    def _capture(self, size: int, span: int) -> None:
        warm_up(self.device, lambda: self._forward(size, span))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode=CAPTURE_ERROR_MODE):
            logits = self._forward(size, span)
        self.graphs[(size, span)], self.logits[(size, span)] = graph, logits

    def stats(self) -> dict:
        return {"graph_replays": self.replays, "graph_pool_bytes": self.pool_bytes,
                "v4_graph": {"replays_by_span": dict(self.replays_by_span), "padded_rows": self.padded_rows,
                             "partial_closes": self.partial_closes, "cache_bytes": self.cache_bytes,
                             "rows_in_graph": self.in_graph}}


def _head(idx, b: int):
    """``idx`` (a PageIndex or GroupIndex) with every tensor cut to its first ``b`` rows (views)."""
    out = {}
    for f in dataclasses.fields(idx):
        v = getattr(idx, f.name)
        if isinstance(v, torch.Tensor):
            v = v[:b]
        elif isinstance(v, dict):
            v = {k: _head(g, b) for k, g in v.items()}
        out[f.name] = v
    return type(idx)(**out)


def _copy_index(static, idx) -> None:
    """Copy every (host) tensor of ``idx`` into the same field of ``static`` (equal shapes), recursively: from pinned
    memory without waiting, where ``static`` is on CUDA."""
    for f in dataclasses.fields(idx):
        v = getattr(idx, f.name)
        if isinstance(v, torch.Tensor):
            dst = getattr(static, f.name)
            dst.copy_(v.pin_memory() if dst.is_cuda else v, non_blocking=dst.is_cuda)
        elif isinstance(v, dict):
            for k, g in v.items():
                _copy_index(getattr(static, f.name)[k], g)
