"""Worker: everything on one device — model, KV cache, Engram tables, lookups, step runners, sampler. Driven only
through ``execute(step) -> StepResult`` or its halves ``launch`` and ``collect`` (the step's one host synchronisation),
reporting through ``stats()``; it never sees a Sequence or the scheduler. At start it opens its tables, sizes the KV
cache (memory.py) and chooses its runners once (engine/runners/): unless ``enforce_eager``, with speculative decoding
the verify graphs (both Engram variants: ``VerifyGraphRunner`` when every table gathers on the device, else
``VerifyPiecesRunner``, the host-read rows copied in between pieces); two
``GraphRunner``s (decode steps, then mixed steps) when every table gathers on the device (or, with ``graph_capture``
False, uncaptured on any device), else ``PiecewiseRunner`` (decode steps); then the eager runner for every other
step."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engram.engine import step_lookups
from engram.engine.config import EngineConfig
from engram.engine.lookup import LookupExecutor, staging_bytes
from engram.engine.lookup_stream import LookupStream
from engram.engine.memory import MemoryPlan, plan_memory, profile_peak_bytes
from engram.engine.pending import PendingTokens
from engram.engine.prefetch_stage import PrefetchStaging
from engram.engine.runners import conv_blocks
from engram.engine.runners.base import StepRunner
from engram.engine.runners.decode_inputs import DecodeInputs, graph_reserve_bytes
from engram.engine.runners.eager import EagerRunner
from engram.engine.runners.group_pool import GroupPool
from engram.engine.runners.graphs import GraphRunner
from engram.engine.runners.mixed_inputs import MixedInputs
from engram.engine.runners.pieces import DecodePieces
from engram.engine.runners.piecewise import PiecewiseRunner
from engram.engine.runners.sequence_cache import SequenceCacheRunner
from engram.engine.runners.v4_graphs import V4GraphRunner, batched_cache_bytes, v4_graphs_wanted
from engram.engine.runners.verify_graphs import verify_runner
from engram.engine.runners.verify_pieces import verify_pieces_runner
from engram.engine.sampler import SampledTokens, Sampler
from engram.engine.spec.config import logit_rows
from engram.engine.spec.drafter import Drafter, load_draft
from engram.engine.spec.verify import Verifier, flatten
from engram.engine.step import SampleSpec, StepDescription, StepResult, TokenLogprobs
from engram.hashing import NgramHasher
from engram.model.deepseek_v4.cache_layout import cache_layout
from engram.model.deepseek_v4.config import ARCHITECTURES as SEQUENCE_CACHE_ARCHITECTURES
from engram.model.kv_cache import KVCache
from engram.model.layers import paged_attention as pa
from engram.model.layers.fused import FAST_DTYPES
from engram.transfer import to_device, to_host

_log = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued: its sampled tokens (and scores) are being copied to the host."""

    step: StepDescription
    runner: StepRunner  # the runner that launched it
    sampled: SampledTokens  # host copies (in flight until ``sampled.ready``)
    prompt_scores: tuple | None  # host copies of the prompt logprob scores, when the step asked for them
    flags: torch.Tensor | None = None  # host copy of the runner's flags (stale rows, failed waits)
    started: "torch.cuda.Event | None" = None  # recorded before the step's first kernel (CUDA)
    before: "torch.cuda.Event | None" = None  # the step before's ``sampled.ready``: the idle time runs from it


class Worker:
    """``wrap_lookup`` (tests): wraps the lookup executor the runners submit through (not the memory warm-up's).
    ``kv_layers``: the layers whose KV cache this Worker allocates (a pipeline stage's own, parallel/pp.py
    ``local_allocation``; None: every KV-source layer). A pipeline stage's model (parallel/pp_stage.py) holds some
    layers and opens only their tables; a stage before the last returns no logits and samples nothing."""

    def __init__(self, loaded, config: EngineConfig, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 progress: bool | None = None,
                 wrap_lookup: Callable[[LookupExecutor], LookupExecutor] | None = None,
                 kv_layers: tuple[int, ...] | None = None, draft=None, graph_capture: bool = True):
        """``kv_layers``: a pipeline stage's KV layers (None: every layer); ``draft``: the draft model's LoadedModel
        (speculative_config method "draft_model"; loaded here when None). ``graph_capture`` False: the graph runners
        are built on any device and run their graphs' callables uncaptured on the same static inputs
        (``GraphRunner(capture=False)``: how the CPU takes the graph path, e.g. a tensor-parallel rank's)."""
        self.graph_capture = graph_capture
        self.config, self.device, self.dtype = config, torch.device(device), dtype  # progress None: bars on a tty
        self.model_config, self.ecfg = loaded.model_config, loaded.engram_config
        self.model = loaded.model
        # DeepSeek-V4 keeps cache groups (runners/sequence_cache.py, v4_graphs.py): no paged KV, no memory profiling
        self.sequence_caches = self.model_config.architecture in SEQUENCE_CACHE_ARCHITECTURES
        if self.device.type == "cuda" and dtype in FAST_DTYPES and not self.sequence_caches:
            self.model.pack_projections()  # q/k/v and gate/up as one GEMM each (the CPU keeps the plain path)
        self.tables = loaded.open_tables()  # opened here, on this worker's device (a stage: its own layers')
        engram_ids = tuple(self.tables)  # the Engram layers this Worker serves
        if any(getattr(t, "reads_from_disk", False) for t in self.tables.values()):
            step_lookups.shorten_switch_interval()  # their threads get the GIL back quickly (step_lookups.py)
        # lookup_overlap (CUDA): gathers on their own stream, an event per Engram layer (engine/lookup_stream.py)
        self.lookup_stream = (LookupStream(self.device, engram_ids)
                              if getattr(loaded, "lookup_overlap", False) and self.ecfg and self.device.type == "cuda"
                              else None)
        # a column shard's eager lookup ends in an all-gather, which stays on the main stream: only the graphs split
        # it around the lookup stream (runners/column_gathers.py)
        columns = any(getattr(t, "column_layout", False) for t in self.tables.values())
        self.lookup = LookupExecutor(self.tables, self.ecfg, dtype, self.device,
                                     stream=None if columns else self.lookup_stream,
                                     projectors=_projectors(self.model, engram_ids, dtype),
                                     layer_ids=engram_ids if loaded.layers is not None else None)
        self._timed_lookup = self.lookup  # keeps each step's lookup timing, whatever wraps it later
        self.sampler = Sampler(seed=config.seed)
        self.verifier = Verifier(self.sampler)  # speculative decoding: drafts accepted or not, on the device
        ctok = loaded.compressed_tokenizer
        self.pending = PendingTokens(NgramHasher.from_tokenizer(self.ecfg, ctok) if self.ecfg else None,
                                     ctok.map if self.ecfg else None, self.ecfg.dead_token_ids if self.ecfg else (),
                                     self.device)
        # DeepSeek-V4: one pool of equal pages shared by its cache groups (model/deepseek_v4/cache_layout.py)
        self.cache_layout = cache_layout(self.model_config, dtype, config.block_size) if self.sequence_caches else None
        self.kv_layers = kv_layers
        bytes_per_block = (self.cache_layout.page_bytes if self.sequence_caches
                           else KVCache.for_model(self.model_config, 1, config.block_size, dtype, "meta",
                                                  kv_layers).bytes_per_block())
        # the paper variant keeps its conv inputs with each block for prefix-cache hits (runners/conv_blocks.py)
        keeps_conv = (config.enable_prefix_caching and not self.sequence_caches and self.ecfg is not None
                      and self.ecfg.variant == "paper")
        if keeps_conv:
            bytes_per_block += conv_blocks.bytes_per_block(self.ecfg, config.block_size, dtype, engram_ids)
        spec = config.speculative_config
        if spec is not None and spec.uses_draft_model:  # its KV blocks sit beside the target's, same ids
            self.draft = draft if draft is not None else load_draft(spec, dtype, self.device)
            bytes_per_block += KVCache.for_model(self.draft.model_config, 1, config.block_size, dtype,
                                                 "meta").bytes_per_block()
        else:
            self.draft = None
        # max_num_batched_tokens holds the decode reservation (engine/spec/config.py), so one full step's staging
        # covers every verify row
        staging = staging_bytes(self.ecfg, config.max_num_batched_tokens, dtype, engram_ids) if self.ecfg else 0
        use_graphs = (not config.enforce_eager and not self.sequence_caches
                      and (_graphs_supported(dtype, self.ecfg, self.device) or not graph_capture))
        # verify steps as decode-style graphs, both Engram variants: one graph a bucket with the gathers inside where
        # every table gathers on the device (runners/verify_graphs.py), else pieces cut at the Engram layers with the
        # host-read rows copied in (runners/verify_pieces.py); over column shards eager (their all-gather must not
        # run on the lookup branch)
        use_verify_graphs = (spec is not None and not config.enforce_eager and not self.sequence_caches
                             and _graphs_supported(dtype, None, self.device) and not columns)
        peak = profile_peak_bytes(self, bytes_per_block) if self._profiles_memory() else None
        if wrap_lookup is not None:  # after the warm-up, which no statistic or wrapper sees (memory.py)
            self.lookup = wrap_lookup(self.lookup)
            self._timed_lookup = self.lookup if hasattr(self.lookup, "take_timing") else self._timed_lookup
        # Decided once: whether prefill's lookups run through the lookup executor (eager prefill; the mixed-step graphs
        # gather every planned id inside the graph), where host-deduplicated ids and staged prompt rows are read
        self.eager_prefill = not (use_graphs and self._graph_gathers())
        # prompt rows staged ahead (prefetch_stage.py): there, and where every table takes any ids (not TP column
        # shards)
        self.prefetch = PrefetchStaging(self.tables, config.prefetch_staging_bytes if config.prompt_prefetch else 0,
                                        self.device, active=self.eager_prefill and all(
                                            not getattr(t, "column_layout", False) for t in self.tables.values()))
        if hasattr(self.lookup, "staging"):
            self.lookup.staging = self.prefetch
        v4_graphs = (self.sequence_caches and loaded.layers is None
                     and v4_graphs_wanted(config, self.ecfg, self.device, dtype, graph_capture, FAST_DTYPES))
        graph_batch = min(config.max_num_seqs, config.max_graph_batch)
        self.memory: MemoryPlan = plan_memory(config, max_model_len, bytes_per_block, staging,
                                              _hot_cache_bytes(self.tables), self.device, peak,
                                              graph_reserve_bytes(config, peak,
                                                                  self._graph_rows(use_graphs, use_verify_graphs))
                                              + (batched_cache_bytes(self.model, dtype, graph_batch, max_model_len)
                                                 if v4_graphs else 0),
                                              self.cache_layout.max_blocks_per_sequence(max_model_len)
                                              if self.sequence_caches else None,
                                              self.prefetch.capacity_bytes if self.prefetch.active and self.ecfg
                                              else 0)
        # One more block than the scheduler hands out (``memory.num_blocks``): the padding of a graph's bucket
        # writes there.
        if self.sequence_caches:  # with V4 graphs one more page than the scheduler hands out: the padding rows'
            self.kv = None
            self.group_pool = GroupPool(self.model_config, self.cache_layout, self.memory.num_blocks + int(v4_graphs),
                                        dtype, self.device)
            self.eager = SequenceCacheRunner(self.model, self.group_pool, self.lookup, self.device, dtype, self.ecfg)
        else:
            self.kv = KVCache.for_model(self.model_config, self.memory.num_blocks + 1, config.block_size, dtype,
                                        self.device, kv_layers)
            conv = (conv_blocks.ConvBlockStore(self.ecfg, self.memory.num_blocks + 1, config.block_size, dtype,
                                               self.device, engram_ids) if keeps_conv else None)
            self.eager = EagerRunner(self.model, self.kv, self.lookup, self.device, dtype, self.ecfg, conv)
        self.drafter = (Drafter(self.draft, self.memory.num_blocks + 1, config.block_size, dtype, self.device,
                                self.pending) if self.draft is not None else None)
        # never two replays at once; uncaptured runners need none
        pool = torch.cuda.graph_pool_handle() if (use_graphs and graph_capture) or use_verify_graphs else None
        graphs = self._graph_runners(max_model_len, progress, pool) if use_graphs else []
        if v4_graphs:
            graphs.append(V4GraphRunner(self.model, self.group_pool, self.memory.num_blocks, self.tables, self.lookup,
                                        self.ecfg, graph_batch, max_model_len,
                                        self.device, progress, capture=graph_capture))
        if use_verify_graphs and self._gathers_on_device():
            graphs.insert(0, verify_runner(self.model, self.kv, self.ecfg, self.tables, config, max_model_len,
                                           self.memory.num_blocks, self.device, dtype, self.eager.conv_states,
                                           progress=progress, lookup_stream=self.lookup_stream, pool=pool))
        elif use_verify_graphs:
            graphs.insert(0, verify_pieces_runner(self.model, self.kv, self.ecfg, self.tables, self.lookup, config,
                                                  max_model_len, self.memory.num_blocks, self.device, dtype,
                                                  self.eager.conv_states, progress=progress, pool=pool))
        self.runners: list[StepRunner] = [*graphs, self.eager]
        self._last_ready: torch.cuda.Event | None = None  # the last launched step's ``sampled.ready``

    def _gathers_on_device(self) -> bool:
        return all(t.gathers_on_device for t in self.tables.values())

    def _graph_gathers(self) -> bool:
        """Whether the graph runners gather inside their callables (uncaptured ones run any table's gather)."""
        return not self.graph_capture or self._gathers_on_device()

    def _profiles_memory(self) -> bool:
        c = self.config
        return (self.device.type == "cuda" and c.num_kv_blocks is None and c.kv_cache_memory is None
                and not self.sequence_caches)

    def _graph_rows(self, decode_graphs: bool, verify_graphs: bool) -> int:
        """Token rows of the largest graph bucket this Worker captures (0: none), what the graphs' pool reserves: a
        mixed-step graph's max_num_batched_tokens, else the largest decode bucket, or a verify bucket's (K + 1) x it."""
        c = self.config
        batch = min(c.max_num_seqs, c.max_graph_batch)
        rows = (c.max_num_batched_tokens if self._graph_gathers() else batch) if decode_graphs else 0
        return max(rows, batch * c.speculative_config.verify_rows if verify_graphs else 0)

    def _graph_runners(self, max_model_len: int, progress: bool | None, pool) -> list[StepRunner]:
        """Decided once. Every table gathers on the device: one graph a decode bucket, and one a mixed-step token
        bucket (sharing one memory pool); else decode pieces cut at Engram layers (mixed steps then run eager)."""
        c = self.config
        shape = dict(max_model_len=max_model_len, block_size=c.block_size, null_block=self.memory.num_blocks)
        batch = min(c.max_num_seqs, c.max_graph_batch)
        if not self._graph_gathers():
            return [PiecewiseRunner(DecodePieces(self.model, self.kv, self.ecfg, self.tables, max_batch=batch,
                                                 device=self.device, progress=progress, pool=pool, **shape),
                                    self.lookup, self.device)]
        n_cols, layers = (self.ecfg.n_cols, list(self.tables)) if self.ecfg else (0, [])
        common = dict(model=self.model, kv=self.kv, ecfg=self.ecfg, tables=self.tables, device=self.device,
                      progress=progress, lookup_stream=self.lookup_stream, pool=pool, capture=self.graph_capture)
        mixed = MixedInputs(c.max_num_batched_tokens, c.max_num_seqs, n_cols=n_cols, row_layers=layers,
                            device=self.device, max_logits=logit_rows(c), **shape)
        decode = DecodeInputs(batch, n_cols=n_cols, row_layers=layers, pad_row_id=0, device=self.device, **shape)
        return [GraphRunner(io=decode, name="graph", **common), GraphRunner(io=mixed, name="mixed-graph", **common)]

    # ----------------------------------------------------------------- the step
    def execute(self, step: StepDescription) -> StepResult:
        """Run one step: lookups, forward, sampling; returns the emitted tokens (one host read)."""
        return self.collect(self.launch(step))

    def launch(self, step: StepDescription) -> LaunchedStep:
        """Enqueue a step on the first runner covering it and the copy of its tokens to the host; returns without
        waiting for the device (nor, over probed slabs, for the lookups)."""
        started = torch.cuda.Event(enable_timing=True) if self.device.type == "cuda" else None
        if started is not None:
            started.record()
        self.eager.free(step.finished_seq_ids)
        patch = self.pending.patch(step)
        drafts = None
        if step.draft is not None:  # the draft model runs first; its drafts reach the step as a patch
            drafts, draft_patch = self.drafter.propose(step)
            patch = draft_patch if step.num_drafts else patch
        elif step.num_drafts:  # n-gram drafts are ordinary ids of the step
            drafts = to_device(step.token_ids[step.draft_rows], self.device)
        runner = next(r for r in self.runners if r.covers(step))
        for other in self.runners:
            if other is not runner:
                other.settle()  # its background lookups, before this step's
        self.prefetch.accept(step)  # the next prompt ranges start fetching beside this step
        try:
            forward = runner.launch(step, patch)
        finally:
            self.prefetch.release(step)  # the ranges this step reached are done with (also when it failed)
        if forward.logits is None:  # a pipeline stage before the last: its streams went on, nothing to sample
            sampled = SampledTokens(torch.empty(0, dtype=torch.long, device=self.device), None, None, None)
        else:
            sampled = self.sample(step, forward.logits, drafts)
            if step.num_drafts:  # per-sequence state (the paper's conv state) ends at each one's last accepted token
                runner.keep(step, sampled.accepted)
        self.pending.remember(step.step_id, sampled.token_ids)
        scores = list(forward.prompt_scores or ())
        flags = [forward.flags] if forward.flags is not None else []
        host = to_host([sampled.token_ids, sampled.logprobs, sampled.top_logprobs, sampled.top_token_ids,
                        sampled.accepted] + scores + flags, self.device)
        ready = torch.cuda.Event(enable_timing=True) if started is not None else None
        if ready is not None:
            ready.record()
        before, self._last_ready = self._last_ready, ready
        n = 5 + len(scores)
        return LaunchedStep(step, runner, SampledTokens(*host[:4], ready=ready, accepted=host[4]),
                            tuple(host[5:n]) if scores else None, host[n] if flags else None, started, before)

    def sample(self, step: StepDescription, logits: torch.Tensor, drafts: torch.Tensor | None) -> SampledTokens:
        """The step's tokens from its logits rows: the sampler's, or with drafts the verifier's (a token per row)."""
        if step.num_drafts:
            return self.verifier(logits, step.samples, step.num_drafts, drafts)
        return self.sampler(logits, step.samples)

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens (the step's one host synchronisation) -> its StepResult."""
        step = launched.step
        for runner in self.runners:
            runner.settle(upto=step.step_id)  # never the next step's: that would wait for its reads here
        tokens, logprobs = read_tokens(launched.sampled)  # module-level: found by the sync test
        launched.runner.check(step.step_id, launched.flags)
        # Debug check, after the flags (which name the layers): with no later step launched, the lookup
        # stream must have finished with this step's tokens (every gather it ran was waited for by a layer).
        if (self.lookup_stream is not None and self.pending.last_step_id == step.step_id
                and not self.lookup_stream.idle()):
            raise RuntimeError(f"step {step.step_id}: the lookup stream still runs after the step's tokens were read "
                               "(a gather no layer waited for)")
        per_row = _logprobs(logprobs, step.samples, tokens)
        result = StepResult(step.step_id, tokens, per_row, route=launched.runner.name)
        if step.num_drafts:  # each sequence's rows up to its first rejection
            accepted = launched.sampled.accepted.tolist()
            result.token_ids, result.num_emitted = flatten(accepted, step.num_drafts, tokens)
            result.logprobs, _ = flatten(accepted, step.num_drafts, per_row)
        if launched.started is not None:  # every event involved has completed: ``ready`` was waited for
            result.gpu_s = launched.started.elapsed_time(launched.sampled.ready) / 1e3
            if launched.before is not None:
                result.idle_s = max(0.0, launched.before.elapsed_time(launched.started) / 1e3)
        timing = self._timed_lookup.take_timing(step.step_id)
        if timing is not None:  # None: a graph replay, whose gathers no host clock sees
            result.lookup_exposed_s, result.gather_s = timing.exposed_s, dict(timing.gather_s)
        if step.prompt_logprobs and launched.prompt_scores is not None:  # None: a stage before the last
            result.prompt_logprobs = _prompt_logprobs(launched.prompt_scores, step)
        return result

    def takes_pending_tokens(self) -> bool:
        """Whether ``launch`` takes steps with pending tokens: always (host-read tables wait inside the lookups)."""
        return True

    # ----------------------------------------------------------------- reporting
    def stats(self) -> dict[str, Any]:
        """Device-side counters: each Engram table's (by layer id), the KV cache's size, the graphs'."""
        out = {"tables": self.lookup.stats(), "kv_blocks": self.memory.num_blocks,
               "lookup_exposed_s": self.lookup_stream.exposed_seconds() if self.lookup_stream else 0.0,
               "kv_bytes": self.memory.kv_bytes, "graph_replays": 0, "graph_pool_bytes": 0,
               "mixed_graph_replays": 0, "mixed_graph_pool_bytes": 0, "verify_graph_replays": 0,
               "verify_graph_pool_bytes": 0, "verify_graph_rows": 0, "verify_graph_padded_rows": 0,
               "verify_graph_short_seqs": 0, "prefetch": self.prefetch.stats(),
               "hot_cache_bytes": self.memory.cache_bytes, "eager_prefill": self.eager_prefill,
               "table_files": _table_files(self.tables)}
        for runner in self.runners:
            out.update(runner.stats())
        return out


def read_tokens(sampled: SampledTokens) -> tuple[list[int], tuple | None]:
    """The step's one host synchronisation: wait for the copy of the emitted tokens (and logprobs) to the host and
    read them; tests wrap this to prove nothing else in a step waits for the device."""
    if sampled.ready is not None:
        sampled.ready.synchronize()
    tokens = sampled.token_ids.tolist()
    if sampled.logprobs is None:
        return tokens, None
    return tokens, (sampled.logprobs.tolist(), sampled.top_logprobs.tolist(), sampled.top_token_ids.tolist())


def _graphs_supported(step_dtype: torch.dtype, ecfg, device: torch.device) -> bool:
    """Whether decode steps can be graphs: CUDA, a Triton attention dtype, not the paper variant (its decode and mixed
    steps gather their conv states in Python; ``ecfg`` None asks for the verify graphs, which hold them static)."""
    if device.type != "cuda" or step_dtype not in pa.FAST_DTYPES or pa.SWITCH.value == "torch":
        return False
    return ecfg is None or ecfg.variant != "paper"


def _projectors(model, layer_ids, dtype: torch.dtype) -> dict:
    """Engram layer id -> its rows' projection (``Engram.project`` in the model's dtype): the WKV run-ahead."""
    layers = model.model.layers
    return {lid: functools.partial(layers[lid].engram.project, dtype=dtype) for lid in layer_ids}


def _table_files(tables: dict) -> dict[int, dict]:
    """The file layouts of the tables read from files (``TableBackend.file_layout``), by layer; a tensor-parallel
    column shard (parallel/engram_tp.py) reports none: its rank reads a share of each step's columns."""
    layouts = {lid: getattr(t, "file_layout", lambda: None)() for lid, t in tables.items()}
    return {lid: f for lid, f in layouts.items() if f is not None}


def _hot_cache_bytes(tables: dict) -> int:
    """Bytes of the hot-row caches the tables opened with (they count against an explicit KV budget)."""
    return sum(t.cache.nbytes for t in tables.values() if getattr(t, "cache", None) is not None)


def _logprobs(read: tuple | None, specs: list[SampleSpec], tokens: list[int]) -> list[TokenLogprobs | None]:
    if read is None:
        return [None] * len(specs)
    own, top_v, top_i = read
    return [TokenLogprobs(tok, lp, list(zip(ids[:s.logprobs], vals[:s.logprobs]))) if s.logprobs >= 0 else None
            for s, tok, lp, vals, ids in zip(specs, tokens, own, top_v, top_i)]


def _prompt_logprobs(scores, step: StepDescription) -> dict[int, list[TokenLogprobs]]:
    own, top_v, top_i = (None if t is None else t.tolist() for t in scores)
    out, at = {}, 0
    for p in step.prompt_logprobs:
        out[p.seq] = [TokenLogprobs(t, own[at + i], list(zip(top_i[at + i][:p.k], top_v[at + i][:p.k])) if p.k else [])
                      for i, t in enumerate(p.targets)]
        at += len(p.targets)
    return out
