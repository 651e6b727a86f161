"""The L2-prefetch plumbing on the CPU, with a recording stand-in for the CUDA side stream: at steps of a few
tokens every layer starts a prefetch of its o projection's weight after q/k/v and finishes it before o
reads it; longer steps do not; outputs are bitwise the plain path's. What only CUDA can show (the kernel,
graphs, equal outputs on the H200) is in tests/gpu/test_l2_prefetch.py."""
from __future__ import annotations

import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.layers import attention
from engram.model.loader import load_model
from tests.engine_runs import drain

CPU, F64 = torch.device("cpu"), torch.float64


class RecordingPrefetcher:
    def __init__(self, o_weights):
        self.names = {id(w): i for i, w in enumerate(o_weights)}
        self.calls: list[tuple] = []
        self.open = False

    def start(self, weight):
        assert not self.open, "start() twice without finish()"
        self.open = True
        self.calls.append(("start", self.names[id(weight)]))

    def finish(self):
        assert self.open, "finish() without start()"
        self.open = False
        self.calls.append(("finish",))


def generate(loaded, prefetcher=None):
    if prefetcher is not None:
        loaded.model.prefetch_into_l2(prefetcher)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32), CPU, F64)
    g = torch.Generator().manual_seed(5)
    for i, n in enumerate((5, 40, 17)):
        engine.add_request(f"r{i}", torch.randint(3, 4096, (n,), generator=g).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2))
    return drain(engine)


def test_small_steps_prefetch_each_layers_o_weight_and_outputs_do_not_change(monkeypatch):
    plain = generate(load_model("tiny", dtype=F64, device=CPU, progress=False))
    loaded = load_model("tiny", dtype=F64, device=CPU, progress=False)
    layers = loaded.model.model.layers
    rec = RecordingPrefetcher([layer.self_attn.o_proj.weight for layer in layers])
    seen_tokens = []
    real = attention.paged_attention

    def spy(q, *a, **k):
        seen_tokens.append(q.shape[0])
        return real(q, *a, **k)

    monkeypatch.setattr(attention, "paged_attention", spy)
    assert generate(loaded, rec) == plain
    small = [t for t in seen_tokens if t <= attention.L2_PREFETCH_MAX_TOKENS]
    assert small and len(small) < len(seen_tokens)  # prefill chunks of 32 tokens and decode steps of <= 3
    starts = [c for c in rec.calls if c[0] == "start"]
    assert len(starts) == len(small) and len(rec.calls) == 2 * len(small) and not rec.open
    # each small step: layer 0's o weight, then layer 1's, ... (a layer's start is finished before the next)
    assert [c[1] for c in starts[:len(layers)]] == list(range(len(layers)))
