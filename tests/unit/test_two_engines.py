"""Two engines with different settings side by side in one process (float32, CPU, the tiny model): each is
built with its own settings passed down to its Worker, and nothing they hold is a module global, so stepping
them in turn gives each the tokens and logprobs it gives when it is the only engine in the process.

A: tier gpu, lookup_overlap, four sequences a step, synchronous scheduling, sampling seed 1. B: tier disk
behind a 64-row hot-row cache, a read queue of one id (every step's lookups read together), enforce_eager, two
sequences a step, chunked prefill of 16 tokens, async scheduling, sampling seed 2.
"""
from __future__ import annotations

import gc
import sys

import torch

import engram
from engram.engine.sampling_params import SamplingParams

SETTINGS = {
    "a": dict(tier="gpu", engram_config={"lookup_overlap": True}, max_num_seqs=4, async_scheduling=False, seed=1),
    "b": dict(tier="disk", engram_config={"io": "buffered", "cache_rows": 64, "queue_depth": 1}, enforce_eager=True,
              max_num_seqs=2, max_num_batched_tokens=16, async_scheduling=True, seed=2),
}


def _engine(tmp_path, name: str):
    llm = engram.LLM("tiny", dtype=torch.float32, device="cpu", cache_dir=str(tmp_path), **SETTINGS[name])
    return llm.engine


def _add_requests(engine) -> None:
    """Greedy and sampled requests, seeded and not (the unseeded ones draw from the engine's own generator)."""
    g = torch.Generator().manual_seed(5)
    for i, n in enumerate((3, 21, 9, 40, 6)):
        prompt = torch.randint(3, 4096, (n,), generator=g).tolist()
        params = (SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2) if i % 3 == 0 else
                  SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, ignore_eos=True, logprobs=2,
                                 seed=None if i % 3 == 1 else 40 + i))
        engine.add_request(f"r{i}", prompt, params)


def _step(engine, out: dict) -> None:
    for o in engine.step():
        if o.finished:
            c = o.outputs[0]
            out[o.request_id] = (c.token_ids, [(lp.logprob, lp.top) for lp in c.logprobs])


def _alone(tmp_path, name: str) -> dict:
    engine = _engine(tmp_path, name)
    _add_requests(engine)
    out: dict = {}
    while engine.has_unfinished():
        _step(engine, out)
    return out


def test_two_engines_with_different_settings_each_give_their_own_tokens(tmp_path):
    switch_interval = sys.getswitchinterval()
    want = {}
    for name in SETTINGS:  # each the only engine alive while it runs
        want[name] = _alone(tmp_path, name)
        gc.collect()
        sys.setswitchinterval(switch_interval)  # a disk Worker shortens it: each run starts from the same
    assert want["a"] != want["b"]  # the settings (the seeds, at least) make a difference
    engines = {name: _engine(tmp_path, name) for name in SETTINGS}  # built side by side
    worker_a, worker_b = (engines[n].executor.worker for n in ("a", "b"))
    assert worker_a.runners == [worker_a.eager] and worker_b.runners == [worker_b.eager]  # CPU: eager only
    assert worker_b.tables[1].cache is not None and getattr(worker_a.tables[1], "cache", None) is None
    assert engines["a"].config.max_num_seqs == 4 and engines["b"].config.max_num_seqs == 2
    for engine in engines.values():
        _add_requests(engine)
    got: dict = {name: {} for name in SETTINGS}
    steps = 0
    while any(e.has_unfinished() for e in engines.values()):  # one step of each in turn
        for name, engine in engines.items():
            if engine.has_unfinished():
                _step(engine, got[name])
        steps += 1
    assert steps > 10
    assert got == want
