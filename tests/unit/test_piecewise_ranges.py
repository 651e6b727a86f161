"""Piecewise decode graphs on the CPU side: the layer ranges cut at every Engram layer, and the decoder's
forward in pieces (begin, ranges of layers, end) equal to its one-call forward, bitwise (float64)."""
from __future__ import annotations

import torch

from engram.engine.runners.pieces import piece_ranges
from engram.engine.engine import LLMEngine
from engram.engine.config import EngineConfig
from engram.model.decoder import EngramDecoder
from engram.model.loader import load_model


def test_ranges_cut_before_every_engram_layer():
    assert piece_ranges((1, 15), 36) == [(0, 1, None), (1, 15, 1), (15, 36, 15)]
    assert piece_ranges((0, 2), 4) == [(0, 2, 0), (2, 4, 2)]
    assert piece_ranges((3, 3), 4) == [(0, 3, None), (3, 4, 3)]
    assert piece_ranges((), 4) == [(0, 4, None)]
    assert piece_ranges((5,), 6) == [(0, 5, None), (5, 6, 5)]


def test_the_forward_in_pieces_equals_the_forward(monkeypatch):
    tiny = load_model("tiny", dtype=torch.float64, device="cpu", progress=False)
    engine = LLMEngine(tiny, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128), "cpu",
                       torch.float64)
    seen = {}
    real = EngramDecoder.forward

    def in_pieces(self, step, kv):
        whole = real(self, step, kv)  # the KV writes of a step are idempotent: run it twice, compare
        state = self.forward_begin(step, kv)
        for lo, hi, _ in piece_ranges(self.config.engram.layer_ids, len(self.model.layers)):
            self.forward_layers(state, lo, hi)
        pieces = self.forward_end(state)
        seen.setdefault("steps", []).append(torch.equal(whole.view(torch.uint8), pieces.view(torch.uint8)))
        return pieces

    monkeypatch.setattr(EngramDecoder, "forward", in_pieces)
    from engram.engine.sampling_params import SamplingParams

    engine.add_request("a", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("b", [11, 12], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert seen["steps"] and all(seen["steps"])
