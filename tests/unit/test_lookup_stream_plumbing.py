"""The lookup-overlap plumbing on the CPU, with a recording stand-in for the CUDA lookup stream: every layer's
rows (or, for eager steps, their projection: the WKV run-ahead) are staged inside ``issue()``, ``done(layer)``
follows each layer's work, the consuming layer calls ``wait(layer)`` before it reads, and the outputs equal
the plain executor's, bitwise (float64). What only CUDA can show — the streams really overlapping, the
race detector — is in tests/gpu/test_lookup_overlap.py."""
from __future__ import annotations

import contextlib

import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.engine.worker import _projectors
from engram.model.loader import load_model
from tests.engine_runs import drain
from engram.module import Projected

CPU, F64 = torch.device("cpu"), torch.float64


class RecordingStream:
    def __init__(self):
        self.calls: list[tuple] = []
        self.issuing = False

    @contextlib.contextmanager
    def issue(self, *inputs):
        self.calls.append(("issue",))
        self.issuing = True
        yield self
        self.issuing = False

    def done(self, layer_id):
        assert self.issuing, "done() outside issue()"
        self.calls.append(("done", layer_id))

    def wait(self, layer_id, *tensors, tag=None):
        assert not self.issuing
        self.calls.append(("wait", layer_id, tuple(t.dim() for t in tensors)))

    def pop_exposed(self, tag):
        return 0.0


def generate(loaded, stream=None):
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32), CPU, F64)
    lookup = engine.executor.worker.lookup
    if stream is not None:
        lookup.stream = stream
        lookup.projectors = _projectors(loaded.model, loaded.engram_config.layer_ids, F64)
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate((5, 40, 17, 2)):
        engine.add_request(f"r{i}", torch.randint(3, 4096, (n,), generator=g).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
    return drain(engine)


def test_staged_projections_through_a_lookup_stream_equal_the_plain_path():
    loaded = load_model("tiny", dtype=F64, device=CPU, progress=False)
    want = generate(loaded)
    stream = RecordingStream()
    assert generate(loaded, stream) == want
    layers = list(loaded.engram_config.layer_ids)
    steps, i = 0, 0
    calls = stream.calls
    while i < len(calls):  # per step: issue, done per layer in order, then a wait per layer before its use
        assert calls[i] == ("issue",)
        assert [c[1] for c in calls[i + 1:i + 1 + len(layers)]] == layers
        assert all(c[0] == "done" for c in calls[i + 1:i + 1 + len(layers)])
        waits = calls[i + 1 + len(layers):i + 1 + 2 * len(layers)]
        assert [(c[0], c[1]) for c in waits] == [("wait", lid) for lid in layers]
        assert all(c[2] == (2,) for c in waits)  # a projection's [T, (hc+1)*H], handed to the main stream
        i += 1 + 2 * len(layers)
        steps += 1
    assert steps >= 8


def test_projectors_are_each_layers_engram_project():
    loaded = load_model("tiny", dtype=F64, device=CPU, progress=False)
    proj = _projectors(loaded.model, loaded.engram_config.layer_ids, F64)
    assert sorted(proj) == sorted(loaded.engram_config.layer_ids)
    ecfg = loaded.engram_config
    rows = torch.randn(3, ecfg.n_cols, ecfg.head_dim, dtype=F64)
    out = proj[ecfg.layer_ids[0]](rows)
    assert isinstance(out, Projected) and out.num_tokens == 3 and out.tensors[0].dtype == F64

