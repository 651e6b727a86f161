"""Running an engine's requests to completion in tests: ``drain(engine)`` steps until nothing is unfinished
and returns each request's (token ids, [(logprob, top-k)] per token). ``engine_wrapping_lookup`` builds an
engine whose Worker wraps its lookup executor (the Worker's ``wrap_lookup`` hook: one that records or fails
steps), ``engine_with_worker`` one whose Worker takes other options (``graph_capture``). ``preset_variant`` builds
a preset's float64 CPU decoder with its Engram config changed. ``mixed_graphs_eager`` makes an engine's Worker run
its mixed-step graphs' callables eagerly on the same static inputs (``capture=False``), ``verify_graphs_eager`` its
verify graphs', ``verify_pieces_eager`` its host-read verify pieces'."""
from __future__ import annotations

from typing import Callable

import torch


def drain(engine) -> dict[str, tuple[list[int], list[tuple]]]:
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            c = o.outputs[0]
            out[o.request_id] = (c.token_ids, [(lp.logprob, lp.top) for lp in c.logprobs])
    return out


def engine_wrapping_lookup(loaded, config, wrap_lookup: Callable, device=None, dtype=None):
    """An LLMEngine over ``loaded`` whose Worker submits every lookup through ``wrap_lookup(executor)``, on the
    model's device and dtype unless given. ``llm.engine = engine_wrapping_lookup(llm.loaded, llm.engine.config,
    ...)`` does it for an ``engram.LLM``."""
    return engine_with_worker(loaded, config, device, dtype, wrap_lookup=wrap_lookup)


def engine_with_worker(loaded, config, device=None, dtype=None, **worker_options):
    """An LLMEngine over ``loaded`` whose Worker is built with ``worker_options`` (``wrap_lookup``, ``graph_capture``
    False: the graph runners' callables run uncaptured, the CPU's way through them), on the model's device and dtype
    unless given."""
    from engram.engine.engine import LLMEngine
    from engram.engine.executor import UniProcExecutor
    from engram.engine.worker import Worker

    device = torch.device(loaded.device if device is None else device)
    dtype = loaded.dtype if dtype is None else dtype
    max_model_len = config.max_model_len or loaded.model_config.max_position_embeddings  # as LLMEngine's
    worker = Worker(loaded, config, max_model_len, device, dtype, **worker_options)
    return LLMEngine(loaded, config, device, dtype, executor=UniProcExecutor(worker))


def preset_variant(preset: str, name: str, *, device=None, dtype=torch.float64, **engram_changes):
    """A preset's decoder (float64 on the CPU unless given, random weights of seed 0, its preset tables) with its
    Engram config changed, e.g. the paper variant or DEAD ids, as a LoadedModel called ``name``."""
    from tokenizers import Tokenizer

    from engram.model.loader import LoadedModel, build_model
    from engram.model.presets import TOKENIZER_FILE, init_random_weights, preset_config
    from engram.model.tables import ensure_preset_tables, open_tables
    from engram.tokenizer import CompressedTokenizer

    dev = torch.device("cpu" if device is None else device)
    base = preset_config(preset)
    ecfg = base.engram.replace(**engram_changes)
    cfg = base.replace(engram=ecfg)
    model = build_model(cfg, dtype, dev)
    init_random_weights(model, 0)
    dirs = ensure_preset_tables(ecfg, 0, progress=False)
    return LoadedModel(model, cfg, ecfg, Tokenizer.from_file(str(TOKENIZER_FILE)),
                       CompressedTokenizer.from_file(TOKENIZER_FILE), open_tables(dirs, ecfg, "gpu", dev),
                       cfg.eos_token_id, None, name, table_dirs=dict(dirs), dtype=dtype, device=dev)


def mixed_graphs_eager(engine):
    """Replace ``engine``'s captured mixed-step GraphRunner by one that runs the same callables on the same static
    inputs eagerly; returns the engine."""
    from engram.engine.runners.graphs import GraphRunner

    w = engine.executor.worker
    mixed = next(r for r in w.runners if r.name == "mixed-graph")
    w.runners[w.runners.index(mixed)] = GraphRunner(w.model, w.kv, w.ecfg, w.tables, mixed.io, w.device,
                                                    name="mixed-graph", capture=False)
    return engine


def verify_graphs_eager(engine):
    """Give ``engine``'s Worker the verify runner run eagerly on its static inputs (``capture=False``), first among
    its runners, in place of a captured one (CUDA) or before the others (the CPU, which captures none); returns the
    engine."""
    from engram.engine.runners.verify_graphs import verify_runner

    w = engine.executor.worker
    runner = verify_runner(w.model, w.kv, w.ecfg, w.tables, w.config, engine.max_model_len, w.memory.num_blocks,
                           w.device, w.dtype, w.eager.conv_states, capture=False)
    w.runners = [runner] + [r for r in w.runners if r.name != "verify-graph"]
    return engine


def verify_pieces_eager(engine):
    """Give ``engine``'s Worker the host-read verify runner (verify pieces, rows copied in) run uncaptured
    (``capture=False``), first among its runners, in place of a verify runner it has; returns the engine."""
    from engram.engine.runners.verify_pieces import verify_pieces_runner

    w = engine.executor.worker
    runner = verify_pieces_runner(w.model, w.kv, w.ecfg, w.tables, w.lookup, w.config, engine.max_model_len,
                                  w.memory.num_blocks, w.device, w.dtype, w.eager.conv_states, capture=False)
    w.runners = [runner] + [r for r in w.runners if not r.name.startswith("verify-")]
    return engine


def assert_verified_in_buckets(engine, route: str = "verify-graph") -> dict:
    """Every verify step of ``engine`` ran through the verify runner of ``route`` (none eager) -> its
    ``verify_graph`` counters."""
    stats = engine.stats()
    s, vg = stats["speculative"], stats["verify_graph"]
    assert vg["replays"] >= 3 and vg["rows"] >= s["draft_tokens"], vg
    assert stats["steps_by_route"].get(route, 0) == vg["replays"], (stats["steps_by_route"], vg)
    assert set(stats["steps_by_route"]) <= {route, "eager"}, stats["steps_by_route"]
    # the trace's LM-head rows of the verify steps (the serving roofline's) are the rows the runner verified
    assert sum(r.sampled for r in engine.step_trace() if r.route == route) == vg["rows"], vg
    assert not eager_verify_steps(engine), eager_verify_steps(engine)
    return vg


def eager_verify_steps(engine) -> list:
    """The traced steps that ran eager though verify-shaped: drafts verified (more LM-head rows than sequences) and
    every token sampled (no prefill chunk beside them; a step with one runs as a mixed step)."""
    return [r for r in engine.step_trace()
            if r.route == "eager" and r.sampled == r.num_tokens > r.num_seqs]


def run_with_failing_decodes(engine, monkeypatch, request_id: str, prompt_len: int) -> tuple[dict, list[str]]:
    """Drain ``engine`` while the lookups of ``request_id`` raise OSError whenever it decodes (a step reaching past
    its ``prompt_len`` prompt tokens); failed requests are aborted -> (finished request id -> token ids, the ids the
    engine failed)."""
    from engram.engine.lookup import LookupExecutor
    from engram.engine.engine import StepError

    bad, real = engine._seqs[request_id].seq_id, LookupExecutor.submit

    def submit(self, step, patch=None, project=True):
        s = step.seq_ids.index(bad) if bad in step.seq_ids else -1
        if s >= 0 and step.start_positions[s] >= prompt_len:
            raise OSError("planted read error")
        return real(self, step, patch, project)

    monkeypatch.setattr(LookupExecutor, "submit", submit)
    out, failed = {}, []
    while engine.has_unfinished():
        try:
            outs = engine.step()
        except StepError as e:
            failed += e.request_ids
            outs = e.outputs
            for rid in e.request_ids:
                engine.abort_request(rid)
        out.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    monkeypatch.undo()
    return out, failed
