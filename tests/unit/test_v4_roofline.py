"""The DeepSeek-V4 decode roofline (engram/bench/v4_roofline.py): the weights split by name add up to every
parameter; a step's cache bytes counted by hand (sliding windows filling, CSA entries below and above the top-k, HCA
entries); and on a V4 engine (CPU float64, a transformers checkpoint with Engram) `engine_points` gives decode points
with a roofline whose routed experts come from one probed eager step (between top-k and all experts a layer)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.parity.deepseek_v4_fixtures import ENGRAM, Pair  # noqa: E402

import engram  # noqa: E402
from engram.bench.engine_bench import engine_points  # noqa: E402
from engram.bench.engine_steps import Settings  # noqa: E402
from engram.bench.roofline import Ceilings  # noqa: E402
from engram.bench.v4_roofline import decode_cost, v4_weights  # noqa: E402

CEILINGS = Ceilings(device="cpu", dtype="float64", memory_GBps=10.0, matmul_TFLOPs=0.1, link_GBps=None,
                    copy_bytes=1 << 20, matmul_n=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("v4roof"), ENGRAM)


def test_the_weights_split_adds_up_to_every_parameter(pair):
    model, cfg = pair.model, pair.model.config
    w = v4_weights(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed.weight
    assert w.dense_bytes + cfg.n_routed_experts * sum(w.expert_bytes) + embed.numel() * embed.element_size() == total
    assert w.embed_row_bytes == cfg.hidden_size * 8 and w.head_params == model.head.weight.numel()
    assert all(b == 3 * cfg.hidden_size * cfg.moe_intermediate_size * 8 for b in w.expert_bytes)


def test_decode_cost_by_hand(pair):
    """Layers sliding, CSA 4, HCA 16, CSA 4; window 32 (31 ring slots), top-k 8, head_dim 32, index_head_dim 16.
    Positions 0, 5, 40: window keys read + the new key 1, 6, 32 a layer (4 layers: 156); CSA entries (p+1)//4 = 0, 1,
    10: indexer keys 11 and top-k 0 + 1 + 8 = 9 a layer (two layers: 22 and 18); HCA (p+1)//16 = 0, 0, 2."""
    cfg, w = pair.model.config, v4_weights(pair.model)
    experts = [2, 3, 4, 1]
    cost = decode_cost(cfg, w, [0, 5, 40], experts, itemsize=8, tier="gpu")
    assert cost.kv_bytes == ((156 + 18 + 2) * 32 + 22 * 16) * 8
    assert cost.weight_bytes == w.dense_bytes + sum(n * b for n, b in zip(experts, w.expert_bytes)) + 3 * 64 * 8
    rows = 3 * ENGRAM.n_cols * ENGRAM.row_bytes * len(ENGRAM.layer_ids)
    assert cost.engram_bytes == rows and cost.memory_bytes == cost.weight_bytes + cost.kv_bytes + rows
    host = decode_cost(cfg, w, [0, 5, 40], experts, itemsize=8, tier="host")
    assert host.link_bytes == rows and host.memory_bytes == cost.memory_bytes - rows
    with pytest.raises(ValueError, match="experts lists 3 layers"):
        decode_cost(cfg, w, [0], [1, 1, 1], itemsize=8)


def test_engine_points_of_a_v4_model_have_a_roofline(pair, tmp_path):
    llm = engram.LLM(model=str(pair.path), dtype="float64", device="cpu", cache_dir=str(tmp_path / "cache"))
    s = Settings(batch_sizes=(1, 4), context_len=40, decode_steps=2, warmup_tokens=1, profile_steps=0,
                 prefill_shapes=(), prefill_repeats=1, max_num_batched_tokens=256, seed=0)
    points = engine_points(llm.loaded, "engram", "gpu", s, torch.device("cpu"), torch.float64, CEILINGS, None)
    cfg = pair.model.config
    assert [p["batch"] for p in points] == [1, 4]
    for p in points:
        k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
        assert len(p["routed_experts"]) == cfg.num_layers
        assert all(k <= n <= min(e, k * p["batch"]) for n in p["routed_experts"]), p["routed_experts"]
        assert p["roofline_ms"] > 0 and p["bound"] in ("memory", "compute") and p["kv_bytes"] > 0
        assert p["ratio"] == pytest.approx(p["ms_wall"] / p["roofline_ms"])
