"""DeepSeek-V4 decode CUDA graphs in the engine (engram/engine/runners/v4_graphs.py; skipped without CUDA), bf16 on a
transformers save_pretrained checkpoint with Engram: the Worker captures its V4 decode graphs, and 16 concurrent
mixed-length requests give bitwise the tokens and logprobs of the same engine whose graphs' callables run uncaptured
on the same static inputs; with the tables in HBM, in pinned host memory (UVA gathers inside the graphs) and on disk
(rows staged by the lookup executor and copied in) the outputs are bitwise equal."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.parity.deepseek_v4_fixtures import ENGRAM, Pair, decode_heavy_requests  # noqa: E402

import engram  # noqa: E402
from tests.engine_runs import engine_with_worker  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("v4graphsgpu"), ENGRAM)


@pytest.fixture(scope="module")
def requests():
    return decode_heavy_requests()


def _llm(pair, tmp_path, tier: str = "gpu"):
    return engram.LLM(model=str(pair.path), dtype="bfloat16", device="cuda", tier=tier,
                      cache_dir=str(tmp_path / "cache"), max_num_batched_tokens=128, max_num_seqs=16)


def _generate(llm, requests):
    prompts, news = requests
    params = [engram.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in news]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]


def _graph_steps(llm) -> int:
    runner = llm.engine.executor.worker.runners[0]
    assert runner.name == "graph" and type(runner).__name__ == "V4GraphRunner", runner
    stats = llm.engine.stats()
    assert stats["steps_by_route"].get("graph", 0) == stats["graph_replays"]
    return stats["graph_replays"]


def test_captured_v4_decode_graphs_equal_their_uncaptured_callables(pair, tmp_path, requests):
    llm = _llm(pair, tmp_path)
    assert llm.engine.executor.worker.runners[0].captured
    captured = _generate(llm, requests)
    assert _graph_steps(llm) >= 15
    llm.engine = engine_with_worker(llm.loaded, llm.engine.config, graph_capture=False)
    assert not llm.engine.executor.worker.runners[0].captured
    assert _generate(llm, requests) == captured
    assert _graph_steps(llm) >= 15


def test_v4_tiers_through_decode_graphs_are_bitwise_equal(pair, tmp_path, requests):
    outs = {}
    for tier in ("gpu", "host", "disk"):
        llm = _llm(pair, tmp_path, tier)
        outs[tier] = _generate(llm, requests)
        assert _graph_steps(llm) >= 15
        assert llm.engine.stats()["v4_graph"]["rows_in_graph"] == (tier != "disk")
        del llm
    assert outs["host"] == outs["gpu"] and outs["disk"] == outs["gpu"]
