"""Worker: everything that lives on one device — model, KV cache, Engram tables, lookups, sampler.

A Worker is driven only through ``execute(StepDescription) -> StepResult`` (engine/step.py), or its two
halves ``launch`` (enqueue the step's device work, start the copy of its tokens to the host) and
``collect`` (wait for that copy: the step's one synchronisation), and reports through ``stats()``; it never
sees a Sequence or the scheduler (of the tokenizer it keeps only the raw -> compressed id map, to hash
tokens that never left the device: engine/pending.py). At start it opens its Engram
tables on its device (``LoadedModel.open_tables``), sizes the paged KV cache (memory.py: from a profiled
warm-up forward at the largest step on CUDA, from the configured budget otherwise) and allocates it.
Decode steps replay CUDA graphs (cuda_graphs.py) unless ``enforce_eager``.
Per-sequence device state — the paper variant's conv state (in the runner) — is keyed by sequence id and
dropped when the engine lists the sequence as finished (seeded sampling keeps no state: sampler.py).
Within a step the only host synchronisation is the read of the sampled tokens. Async scheduling launches
step N+1 before collecting step N; N+1's pending tokens are N's sampled ids, patched in on the device.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from engram.engine import step_lookups
from engram.engine.config import EngineConfig
from engram.engine.cuda_graphs import DecodeGraphs, graph_reserve_bytes
from engram.engine.lookup import HostIds, LookupExecutor, StagedRows, staging_bytes
from engram.engine.lookup_stream import LookupStream
from engram.engine.memory import MemoryPlan, plan_memory, profile_peak_bytes
from engram.engine.pending import PendingPatch, PendingTokens
from engram.engine.runner import ModelRunner
from engram.engine.sampler import SampledTokens, Sampler
from engram.engine.step import SampleSpec, StepDescription, StepResult, TokenLogprobs
from engram.model.kv_cache import KVCache
from engram.hashing import NgramHasher
from engram.model.layers.fused import FAST_DTYPES
from engram.transfer import to_host

_log = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued: its sampled tokens (and scores) are being copied to the host."""

    step: StepDescription
    sampled: SampledTokens  # host copies (in flight until ``sampled.ready``)
    prompt_scores: tuple | None  # host copies of the prompt logprob scores, when the step asked for them
    flags: torch.Tensor | None = None  # graph steps: host copy of DecodeGraphs.flags (stale rows, failed waits)


class Worker:
    def __init__(self, loaded, config: EngineConfig, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 progress: bool | None = None):
        self.config, self.device, self.dtype = config, torch.device(device), dtype  # progress None: bars on a tty
        self.model_config, self.ecfg = loaded.model_config, loaded.engram_config
        self.model = loaded.model
        if self.device.type == "cuda" and dtype in FAST_DTYPES:
            self.model.pack_projections()  # q/k/v and gate/up as one GEMM each (the CPU keeps the plain path)
        self.tables = loaded.open_tables()  # opened here, on this worker's device
        if any(getattr(t, "reads_from_disk", False) for t in self.tables.values()):
            step_lookups.shorten_switch_interval()  # their threads get the GIL back quickly (step_lookups.py)
        # lookup_overlap (CUDA): gathers on their own stream, an event per Engram layer (engine/lookup_stream.py)
        self.lookup_stream = (LookupStream(self.device, self.ecfg.layer_ids)
                              if getattr(loaded, "lookup_overlap", False) and self.ecfg and self.device.type == "cuda"
                              else None)
        run_ahead = getattr(loaded, "wkv_run_ahead", True)  # the WKV projections on the lookup stream too
        self.lookup = LookupExecutor(self.tables, self.ecfg, dtype, self.device, stream=self.lookup_stream,
                                     projectors=_projectors(self.model, self.ecfg, dtype) if run_ahead else None)
        self.sampler = Sampler(seed=config.seed)
        ctok = loaded.compressed_tokenizer
        self.pending = PendingTokens(NgramHasher.from_tokenizer(self.ecfg, ctok) if self.ecfg else None,
                                     ctok.map if self.ecfg else None, self.ecfg.dead_token_ids if self.ecfg else (),
                                     self.device)
        bytes_per_block = KVCache.for_model(self.model_config, 1, config.block_size, dtype, "meta").bytes_per_block()
        staging = staging_bytes(self.ecfg, config.max_num_batched_tokens, dtype) if self.ecfg else 0
        use_graphs = not config.enforce_eager and DecodeGraphs.supports(dtype, self.ecfg, self.device)
        peak = profile_peak_bytes(self, bytes_per_block) if self._profiles_memory() else None
        self.memory: MemoryPlan = plan_memory(config, max_model_len, bytes_per_block, staging,
                                              _hot_cache_bytes(self.tables), self.device, peak,
                                              graph_reserve_bytes(config, peak) if use_graphs else 0)
        # With graphs, one more block than the scheduler hands out: padding sequences of a bucket write there.
        self.kv = KVCache.for_model(self.model_config, self.memory.num_blocks + use_graphs, config.block_size, dtype,
                                    self.device)
        self.runner = ModelRunner(self.model, self.kv, self.device, dtype, self.ecfg)
        self.graphs = (DecodeGraphs(self.model, self.kv, self.ecfg, min(config.max_num_seqs, config.max_graph_batch),
                                    max_model_len,
                                    config.block_size, self.memory.num_blocks, self.device, progress=progress,
                                    tables=self.tables, lookup_stream=self.lookup_stream, run_ahead=run_ahead)
                       if use_graphs else None)
        self._warned_slabs = False  # logged once: a replaced lookup executor makes slab-decoding steps eager
        # a probed decode step's lookups, on a thread beside the host work (step_lookups.py)
        self._lookups = step_lookups.BackgroundLookups(self.device)

    def _profiles_memory(self) -> bool:
        c = self.config
        return self.device.type == "cuda" and c.num_kv_blocks is None and c.kv_cache_memory is None

    # ----------------------------------------------------------------- the step
    def execute(self, step: StepDescription) -> StepResult:
        """Run one step: lookups, forward, sampling; returns the emitted tokens (one host read)."""
        return self.collect(self.launch(step))

    def launch(self, step: StepDescription) -> LaunchedStep:
        """Enqueue one step's device work (lookups, forward, sampling) and the non-blocking copy of its
        tokens to the host; returns without waiting for the device (nor, over probed slabs, for the step's
        lookups: step_lookups.py)."""
        self._free(step.finished_seq_ids)
        patch = self.pending.patch(step)
        if patch is not None and patch.row_ids and type(self.lookup) is not LookupExecutor:
            raise RuntimeError("a replaced lookup executor cannot take pending tokens: run without async scheduling")
        graph = self.graphs is not None and self.graphs.fits(step)
        if graph and self.graphs.slabs and type(self.lookup) is not LookupExecutor:
            # the pieces decode their disk layers from slabs that only the default executor reads into; a
            # replaced one stages rows the graph would not read (it would decode the slab's old pages)
            if not self._warned_slabs:
                self._warned_slabs = True
                _log.info("a replaced lookup executor does not read the decode graphs' disk slabs: decode "
                          "steps run eager (ENGRAM_DISK_DECODE_IN_GRAPH=0 keeps them in graphs)")
            graph = False
        # With the gathers in the graph the default executor has nothing to do; a replaced one (recording,
        # overlapping) still sees every step.
        skip = graph and self.graphs.tables is not None and type(self.lookup) is LookupExecutor
        slabs = self.graphs.slabs if graph and type(self.lookup) is LookupExecutor else None  # DISK_DECODE_IN_GRAPH
        slab_step = not skip and bool(slabs) and set(step.engram_row_ids) <= set(slabs)
        # The row ids go to the host before the step before's background lookups are finished: their copy then
        # follows that step's sampler alone, not the copies into the caches that finishing queues, and they
        # arrive while this thread caches the rows read (step_lookups.EARLY_HOST_IDS).
        wants_ids = slab_step and patch is not None
        host_ids = self.lookup.start_host_ids(step, patch) if wants_ids and step_lookups.EARLY_HOST_IDS else None
        self._finish_lookups()  # the step before's, if they run in the background: before this step's pieces
        if wants_ids and host_ids is None:
            host_ids = self.lookup.start_host_ids(step, patch)
        if skip:
            staged = None
        elif slab_step:
            staged = self._submit_slab_step(step, patch, slabs, host_ids)
        elif type(self.lookup) is LookupExecutor:  # a graph step projects its rows inside the graph
            staged = self.lookup.submit(step, patch, project=not graph, **({"slabs": slabs} if slabs else {}))
        else:
            staged = self.lookup.submit(step)
        try:
            if graph:
                logits = self.graphs.run(step, staged, patch)  # [N, vocab] float32, a view of the graph's output
            else:
                logits = self.runner.run(step, staged, patch)
        finally:
            if staged is not None:
                staged.release()  # reads of layers a failed forward never reached (lookup.py: deferred)
        sampled = self.sampler(logits, step.samples)
        self.pending.remember(step.step_id, sampled.token_ids)
        # prefill chunks only, which run eager: the scores come from the runner
        scores = self.runner.prompt_scores if step.prompt_logprobs else None
        out = [sampled.token_ids, sampled.logprobs, sampled.top_logprobs, sampled.top_token_ids]
        flags = self.graphs.flags if graph else None  # read back with the tokens (cuda_graphs.py)
        host = to_host(out + list(scores or ()) + ([flags] if flags is not None else []), self.device)
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        if ready is not None:
            ready.record()
        n = 4 + len(scores or ())
        return LaunchedStep(step, SampledTokens(*host[:4], ready=ready), tuple(host[4:n]) if scores else None,
                            host[n] if flags is not None else None)

    def _submit_slab_step(self, step: StepDescription, patch: PendingPatch | None, slabs: dict,
                          host_ids: HostIds | None) -> StagedRows | None:
        """A decode-graph step whose every layer's rows are read into the graph's slabs: the row ids went to the
        host first (``host_ids``, from ``LookupExecutor.start_host_ids`` when the step has pending tokens), then
        the pieces before the first Engram layer are queued, and only then does the host wait for the ids (the
        device runs those pieces while the host reads that layer's pages). Pieces that find their rows on the
        device (cached disk tables: ``probes_all``) are all queued at once, and their lookups then run on the
        background thread (step_lookups.py) when the step before read from disk (a step whose rows were all
        cached has ~0.1 ms of lookups, less than the hand-off costs): None is returned, else the staged rows
        for ``graphs.run``."""
        whole = self.graphs.probes_all
        self.graphs.begin(step, patch, whole=whole)
        staged = None
        try:
            staged = self.lookup.submit(step, patch, project=False, slabs=slabs, host_ids=host_ids)
            if whole and step_lookups.BACKGROUND and self.graphs.last_step_read:
                self._lookups.start(step.step_id, functools.partial(self.graphs.read_lookups, step, staged,
                                                                    after_each=self._lookups.handed_off))
                return None  # read_lookups releases the staged rows
            return staged
        except BaseException:
            if whole:  # the queued pieces must not wait for lookups that will not run
                self.graphs.abort_lookups(step.step_id)
            if staged is not None:
                staged.release()
            raise

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens (the step's one host synchronisation) -> its StepResult."""
        step = launched.step
        self._finish_lookups(upto=step.step_id)  # never the next step's: that would wait for its reads here
        failed = self._lookups.error(step.step_id)
        if failed is not None:  # its pieces gave up waiting (FAILED flags); the read's own error says why
            raise failed
        tokens, logprobs = read_tokens(launched.sampled)  # module-level: found by the sync test
        if launched.flags is not None:
            self.graphs.check_flags(step.step_id, launched.flags)
        # Debug check, after the stale flags (which name the layers): with no later step launched, the lookup
        # stream must have finished with this step's tokens (every gather it ran was waited for by a layer).
        if (self.lookup_stream is not None and self.pending.last_step_id == step.step_id
                and not self.lookup_stream.idle()):
            raise RuntimeError(f"step {step.step_id}: the lookup stream still runs after the step's tokens were read "
                               "(a gather no layer waited for)")
        result = StepResult(step.step_id, tokens, _logprobs(logprobs, step.samples, tokens))
        if step.prompt_logprobs:
            result.prompt_logprobs = _prompt_logprobs(launched.prompt_scores, step)
        return result

    def _finish_lookups(self, upto: int | None = None) -> None:
        """Wait for the lookups started in the background, if any (of a step up to ``upto``), and cache what
        they read (on this thread)."""
        pending = self._lookups.pending_step
        if pending is not None and (upto is None or pending <= upto):
            self._lookups.finish(self.graphs.finish_lookups)

    def takes_pending_tokens(self) -> bool:
        """Whether ``launch`` can take steps with pending tokens (async scheduling): the default lookup
        executor can, over any tables (host-read ones wait for the tokens inside ``launch``)."""
        return type(self.lookup) is LookupExecutor

    def _free(self, seq_ids: list[int]) -> None:
        self.runner.free(seq_ids)

    # ----------------------------------------------------------------- reporting
    def stats(self) -> dict[str, Any]:
        """Device-side counters: each Engram table's (by layer id) and the KV cache's size."""
        return {"tables": self.lookup.stats(), "kv_blocks": self.memory.num_blocks,
                "lookup_exposed_s": self.lookup_stream.exposed_seconds() if self.lookup_stream else 0.0,
                "kv_bytes": self.memory.kv_bytes, "graph_replays": self.graphs.replays if self.graphs else 0,
                "graph_pool_bytes": self.graphs.pool_bytes if self.graphs else 0}


def read_tokens(sampled: SampledTokens) -> tuple[list[int], tuple | None]:
    """The step's one host synchronisation: wait for the copy of the emitted tokens (and their logprobs,
    where asked) to the host, then read them; tests wrap this to prove that nothing else in a step waits
    for the device."""
    if sampled.ready is not None:
        sampled.ready.synchronize()
    tokens = sampled.token_ids.tolist()
    if sampled.logprobs is None:
        return tokens, None
    return tokens, (sampled.logprobs.tolist(), sampled.top_logprobs.tolist(), sampled.top_token_ids.tolist())


def _projectors(model, ecfg, dtype: torch.dtype) -> dict:
    """Engram layer id -> its rows' projection (``Engram.project`` in the model's dtype): the WKV run-ahead."""
    if ecfg is None:
        return {}
    layers = model.model.layers
    return {lid: functools.partial(layers[lid].engram.project, dtype=dtype) for lid in ecfg.layer_ids}


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
