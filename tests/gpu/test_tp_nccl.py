"""Tensor parallelism over NCCL, one GPU a rank (engine/tp_rank.py with ``device="cuda"``; skipped with fewer than two
GPUs): TP2 of tiny in float64 gives TP1's greedy tokens and logprobs within a relative 1e-9, for both WKV layouts,
with the tables sharded by column on the gpu and host tiers; each rank runs with NVLink multicast off."""
from __future__ import annotations

import pytest
import torch

import engram
from engram.engine.tp_rank import NCCL_ENV
from tests.tp_compare import worst_logprob_gap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
PROMPTS = ["hello world", "the cat sat on the mat", [5, 17, 17, 300, 2]]
ENGINE = dict(dtype="float64", device="cuda", num_kv_blocks=48, max_model_len=256, max_num_seqs=4)


def _params() -> engram.SamplingParams:
    return engram.SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tp1():
    return engram.LLM("tiny", **ENGINE, enforce_eager=True)


@pytest.mark.parametrize("tier,wkv", [("gpu", "replicated"), ("gpu", "column"), ("host", "replicated")])
def test_nccl_tp2_matches_tp1(tp1, tier, wkv):
    llm = engram.LLM("tiny", tier=tier, tensor_parallel_size=2, engram_config={"wkv_tp": wkv}, **ENGINE)
    try:
        got = llm.generate(PROMPTS, _params(), use_tqdm=False)
        ranks = llm.engine.executor.rank_bytes
        envs = llm.engine.executor.rank_env
    finally:
        llm.engine.executor.close()
    assert worst_logprob_gap(tp1.generate(PROMPTS, _params(), use_tqdm=False), got) <= 1e-9
    full = engram.parallel.tp.parameter_bytes(tp1.loaded.model)
    assert all(b["sharded"] * 2 == full["sharded"] for b in ranks)
    assert envs == [NCCL_ENV, NCCL_ENV] and NCCL_ENV["NCCL_NVLS_ENABLE"] == "0"  # multicast off in every rank


def _tp2_graphs(capture: bool, wkv: str, overlap: bool) -> tuple[list, dict]:
    """TP2 of tiny in float32 on the gpu tier through the graph runners (captured, or their callables uncaptured on
    the same static inputs) -> (token ids and logprobs per request, engine stats)."""
    from engram.engine.config import EngineConfig
    from engram.engine.engine import LLMEngine
    from engram.engine.multiproc import MultiprocExecutor, RankSpec, free_port
    from engram.model.loader import load_model
    from engram.model.options import RuntimeOptions

    cfg = EngineConfig(num_kv_blocks=48, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                       tensor_parallel_size=2)
    options = RuntimeOptions.from_dict({"wkv_tp": wkv, "lookup_overlap": overlap})
    loaded = load_model("tiny", dtype=torch.float32, device="cpu", engram_config=options, progress=False)
    spec = RankSpec("tiny", "gpu", torch.float32, options, None, cfg, 256, f"tcp://127.0.0.1:{free_port()}", 2,
                    device="cuda", graph_capture=capture)
    executor = MultiprocExecutor(spec)
    try:
        engine = LLMEngine(loaded, cfg, torch.device("cpu"), torch.float32, executor=executor)
        for i, n in enumerate((45, 3, 20, 9, 38, 12)):  # more than max_num_seqs: prompts start beside decodes
            engine.add_request(f"r{i}", list(range(100 * i + 5, 100 * i + 5 + n)), _params())
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: (o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
                         for o in engine.step() if o.finished})
        return [done[f"r{i}"] for i in range(6)], engine.stats()
    finally:
        executor.close()


@pytest.mark.parametrize("wkv,overlap", [("replicated", True), ("replicated", False), ("column", True)])
def test_captured_tp2_graphs_equal_their_uncaptured_callables(wkv, overlap):
    """Each rank captures its decode and mixed graphs (collectives inside, the row all-gathers at the step's fixed
    point, the lookup stream doing rank-local work only) and replays them: bitwise the same callables run
    uncaptured."""
    got, stats = _tp2_graphs(True, wkv, overlap)
    want, _ = _tp2_graphs(False, wkv, False)  # uncaptured on one stream: no eager allocation crosses streams
    assert got == want
    assert stats["graph_replays"] >= 5 and stats["mixed_graph_replays"] >= 1, stats["steps_by_route"]
    assert stats["graph_pool_bytes"] > 0
