"""Running an engine's requests to completion in tests: ``drain(engine)`` steps until nothing is unfinished
and returns each request's (token ids, [(logprob, top-k)] per token). ``engine_wrapping_lookup`` builds an
engine whose Worker wraps its lookup executor (the Worker's ``wrap_lookup`` hook: one that records or fails
steps)."""
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
    from engram.engine.engine import LLMEngine
    from engram.engine.executor import UniProcExecutor
    from engram.engine.worker import Worker

    device = torch.device(loaded.device if device is None else device)
    dtype = loaded.dtype if dtype is None else dtype
    max_model_len = config.max_model_len or loaded.model_config.max_position_embeddings  # as LLMEngine's
    worker = Worker(loaded, config, max_model_len, device, dtype, wrap_lookup=wrap_lookup)
    return LLMEngine(loaded, config, device, dtype, executor=UniProcExecutor(worker))
