"""The batched static-shape DeepSeek-V4 decode step (model/deepseek_v4/batched_decode.py) captured in a CUDA graph
(skipped without CUDA): bf16 on the GPU (the routed experts take torch's grouped kernel there, no host read), the tiny
fixture model of tests/unit/test_v4_batched_decode.py with windows closing for some sequences and not others. Replays
of one captured step give bitwise what the same step gives uncaptured, step after step (the cache updated in place at
fixed addresses), and the eager per-sequence path's greedy choices wherever its top-2 logit gap is wider than bf16's
rounding."""
from __future__ import annotations

import copy

import pytest
import torch

from engram.model.deepseek_v4.batched_decode import decode_step
from engram.model.deepseek_v4.batched_state import BatchedCache
from engram.model.deepseek_v4.decoder import pack_sequences
from tests.parity.deepseek_v4_fixtures import random_decoder
from tests.unit.test_v4_batched_decode import CFG, E_MAX, LENGTHS, STEPS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_GAP = 0.05  # top-2 logit gap below which bf16 may pick another token than float32 eager


def _on_gpu(model):
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.keep_fp32()
    return m.cuda().eval().requires_grad_(False)


def _prefilled(m):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    _, caches = m(pack_sequences(prompts, [0] * len(prompts), device="cuda"), [m.empty_cache() for _ in prompts])
    tokens = torch.randint(3, CFG.vocab_size, (STEPS, len(LENGTHS)), generator=g).cuda()
    return caches, tokens


def _clone(cache: BatchedCache) -> BatchedCache:
    return copy.deepcopy(cache)


def test_captured_batched_step_replays_bitwise_and_keeps_eager_choices():
    m = _on_gpu(random_decoder(CFG))
    caches, tokens = _prefilled(m)
    ropes = m.ropes("cuda")
    graph_cache = BatchedCache.from_caches(m, caches, E_MAX)
    plain_cache = _clone(graph_cache)
    warm_cache = _clone(graph_cache)
    static_ids = tokens[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, on a copy (the step updates its cache in place)
        decode_step(m, static_ids, warm_cache, ropes=ropes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the step; the cache is untouched until a replay
        static_hidden = decode_step(m, static_ids, graph_cache, ropes=ropes)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(graph_cache), _tensors(plain_cache)))
    eager = caches
    for k in range(STEPS):
        static_ids.copy_(tokens[k])
        graph.replay()
        plain = decode_step(m, tokens[k].clone(), plain_cache, ropes=ropes)
        torch.cuda.synchronize()
        assert torch.equal(static_hidden, plain), k
        assert all(torch.equal(a, b) for a, b in zip(_tensors(graph_cache), _tensors(plain_cache))), k
        hidden, eager = m(pack_sequences([[t] for t in tokens[k].tolist()], [c.position for c in eager], device="cuda"),
                          eager)
        want = m.compute_logits(hidden).float()
        got = m.compute_logits(static_hidden).float()
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > BF16_GAP
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), k


def _tensors(cache: BatchedCache) -> list[torch.Tensor]:
    """Every tensor of the cache in a fixed order: positions, then each layer's state."""
    return [cache.positions] + [t for st in cache.layers for t in st.tensors()]
