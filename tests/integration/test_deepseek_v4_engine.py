"""A DeepSeek-V4 checkpoint (transformers' save_pretrained, with Engram layers) served by the engine on the CPU:
``engram.LLM`` (float64, chunked prefill, several sequences a step, async scheduling on and off) gives transformers'
greedy tokens; ``engram generate`` and ``engram serve`` (a real server process, real HTTP) generate with it; the
Worker keeps one cache per sequence and drops it when the sequence finishes."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

pytest.importorskip("transformers")

from tests.parity.deepseek_v4_fixtures import ENGRAM, Pair, prompt  # noqa: E402

import engram  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("v4"), ENGRAM)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_llm_generates_transformers_greedy_tokens(pair, tmp_path, async_scheduling):
    prompts = [prompt(310, seed=11), prompt(45, seed=12), prompt(131, seed=13)]
    want = [pair.greedy(p, 6) for p in prompts]
    llm = engram.LLM(model=str(pair.path), dtype="float64", device="cpu", cache_dir=str(tmp_path / "cache"),
                     max_num_batched_tokens=96, max_num_seqs=3, async_scheduling=async_scheduling)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        engram.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    worker = llm.engine.executor.worker
    stats = llm.engine.stats()
    assert worker.kv is None and stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every page came back
    assert all(g["blocks"] == 0 for g in stats["cache_groups"].values())
    assert llm.engine.num_steps > 6  # 486 prompt tokens at 96 a step: chunked and batched


def test_cli_generate(pair, tmp_path, capsys):
    from engram.cli import main

    rc = main(["generate", str(pair.path), "--prompt", "def add(a, b):", "--max-tokens", "4", "--ignore-eos",
               "--dtype", "float64", "--json", "--no-progress"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    ids = pair.ours.tokenizer.encode("def add(a, b):").ids
    assert lines[0]["token_ids"] == pair.greedy(ids, 4)


def test_serve_completions(pair, tmp_path):
    from engram.server.launcher import ServerProcess

    s = ServerProcess([str(pair.path), "--dtype", "float64", "--threads", "1"], tmp_path / "cache",
                      tmp_path / "log").wait_ready()
    try:
        name = httpx.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": name, "prompt": "Engram tables are", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        ids = pair.ours.tokenizer.encode("Engram tables are").ids
        want = pair.ours.tokenizer.decode(pair.greedy(ids, 5), skip_special_tokens=False)
        assert r.json()["choices"][0]["text"] == want.rstrip("\ufffd")  # a partial UTF-8 tail is held back
    finally:
        s.stop()


def test_bf16_keeps_transformers_float32_pieces(pair, tmp_path):
    loaded = engram.model.loader.load_model(pair.path, dtype="bfloat16", device="cpu", cache_dir=tmp_path / "c",
                                            progress=False)
    params = dict(loaded.model.named_parameters()) | dict(loaded.model.named_buffers())
    fp32 = [n for n, t in params.items() if t.dtype == torch.float32]
    assert "model.layers.0.hc_attn_fn" in fp32 and "model.layers.1.attn.attn_sink" in fp32
    assert "model.layers.1.attn.compressor.ape" in fp32 and "model.layers.2.ffn.gate.bias" in fp32
    assert "model.norm.weight" in fp32 and "model.layers.1.attn.indexer.compressor.norm.weight" in fp32
    assert params["model.layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    llm_out = engram.LLM(model=str(pair.path), dtype="bfloat16", device="cpu", cache_dir=str(tmp_path / "c"))
    out = llm_out.generate("hello", engram.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_tensor_parallel_is_refused(pair, tmp_path):
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2: deepseek_v4 runs on one device"):
        engram.LLM(model=str(pair.path), dtype="float64", device="cpu", cache_dir=str(tmp_path / "c"),
                   tensor_parallel_size=2)
