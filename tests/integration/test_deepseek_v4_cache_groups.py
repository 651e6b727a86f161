"""DeepSeek-V4 through its paged cache groups in the engine (CPU, float64, a transformers save_pretrained checkpoint
with Engram): chunk sizes 1, 7, 97 and a whole prompt (chunk boundaries anywhere inside compressor windows) give
transformers' greedy tokens; so do preemptions forced by a pool of the fewest pages one sequence needs, and 16
concurrent mixed-length requests (synchronous and async scheduling) equal each run alone. After every step each group's
pages in use equal what the running sequences' positions need (counted here from the layout, not from the manager);
aborted, preempted and finished sequences give back every page of every group; a failing request fails alone (its step
run again in halves) and the others commit the tokens of a run without it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.parity.deepseek_v4_fixtures import ENGRAM, Pair, prompt  # noqa: E402

import engram  # noqa: E402
from engram.engine.cache_groups import GroupBlockManager  # noqa: E402

pytestmark = pytest.mark.timeout(900)
PROMPT_LENS = (300, 131, 45)  # past the window (32), CSA (4) and HCA (16) windows, several entry pages
NEW = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("v4groups"), ENGRAM)


@pytest.fixture(scope="module")
def prompts_and_reference(pair):
    prompts = [prompt(n, seed=40 + i) for i, n in enumerate(PROMPT_LENS)]
    return prompts, [pair.greedy_logprobs(p, NEW) for p in prompts]


def _llm(pair, tmp_path, **options):
    return engram.LLM(model=str(pair.path), dtype="float64", device="cpu", cache_dir=str(tmp_path / "cache"),
                      **options)


def _greedy(n: int = NEW, logprobs: int | None = None) -> engram.SamplingParams:
    return engram.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def _matches_reference(llm, prompts, reference) -> None:
    """Greedy tokens equal and logprobs within float32 rounding of the float64 reference (the engine's logits are
    float32): a window key or entry read wrong moves them by far more, even where the argmax survives."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=0), use_tqdm=False)
    for out, (tokens, lps) in zip(outs, reference):
        assert out.outputs[0].token_ids == tokens
        got = [lp.logprob for lp in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 2e-5, (got, lps)


def expected_pages(layout, position: int) -> dict[str, int]:
    """Pages a sequence holds after a collected step left it at ``position`` (synchronous scheduling): the sliding
    pages its window touches, the entry pages of its entries, its state pages."""
    out = {}
    for g in layout.groups:
        if g.name == "sliding":
            lo, hi = layout.window_range(position)
            out[g.name] = len(range(lo // layout.block_size, -(-hi // layout.block_size))) if hi > lo else 0
        elif g.name == "state":
            out[g.name] = g.pages_per_sequence if position else 0
        else:
            out[g.name] = -(-layout.rows_for(g, position) // g.rows_per_page)
    return out


def _all_back(llm) -> None:
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert {g: c["blocks"] for g, c in stats["cache_groups"].items()} == {"sliding": 0, "csa": 0, "hca": 0,
                                                                           "state": 0}


@pytest.mark.parametrize("chunk", [1, 7, 97, None], ids=["chunk1", "chunk7", "chunk97", "whole"])
def test_chunk_sizes_give_transformers_greedy_tokens(pair, prompts_and_reference, tmp_path, chunk):
    prompts, reference = prompts_and_reference
    tokens = chunk or 512
    llm = _llm(pair, tmp_path, max_num_batched_tokens=tokens, max_num_seqs=min(3, tokens))
    assert isinstance(llm.engine.scheduler.blocks, GroupBlockManager)
    _matches_reference(llm, prompts, reference)
    steps = llm.engine.num_steps
    assert steps >= (sum(PROMPT_LENS) // tokens if chunk else NEW)  # chunked as asked
    _all_back(llm)


def test_preemption_by_a_tiny_pool_recomputes_the_same_tokens(pair, prompts_and_reference, tmp_path):
    prompts, reference = prompts_and_reference
    probe = _llm(pair, tmp_path)
    least = probe.engine.scheduler.blocks.layout.max_blocks_per_sequence(probe.engine.max_model_len)
    with pytest.raises(ValueError, match=f"KV memory too small: engine.num_kv_blocks={least - 1}.* needs {least}"):
        _llm(pair, tmp_path, num_kv_blocks=least - 1)
    llm = _llm(pair, tmp_path, num_kv_blocks=least, max_num_batched_tokens=64, max_num_seqs=3)
    _matches_reference(llm, prompts, reference)
    assert llm.engine.num_preemptions > 0
    _all_back(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sixteen_concurrent_mixed_requests_equal_each_alone(pair, tmp_path, async_scheduling):
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 260, (16,), generator=g).tolist()
    news = torch.randint(1, 10, (16,), generator=g).tolist()
    prompts = [prompt(n, seed=100 + i) for i, n in enumerate(lens)]
    alone_llm = _llm(pair, tmp_path, max_num_batched_tokens=512, max_num_seqs=1)
    alone = [alone_llm.generate([{"prompt_token_ids": p}], _greedy(n, 0), use_tqdm=False)[0].outputs[0]
             for p, n in zip(prompts, news)]
    llm = _llm(pair, tmp_path, max_num_batched_tokens=128, max_num_seqs=16, async_scheduling=async_scheduling)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_greedy(n, 0) for n in news], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [a.token_ids for a in alone]
    gap = max(abs(x.logprob - y.logprob) for o, a in zip(outs, alone) for x, y in zip(o.outputs[0].logprobs,
                                                                                       a.logprobs))
    assert gap < 1e-6  # float64 hidden states, float32 logits: one rounding apart at most
    assert max(lens) > 200 and min(lens) < 40
    _all_back(llm)


def test_pages_in_use_equal_the_running_sequences_needs_after_every_step(pair, tmp_path):
    pages = 24  # a few more than one sequence's most (19): sequences get preempted
    llm = _llm(pair, tmp_path, max_num_batched_tokens=40, max_num_seqs=4, num_kv_blocks=pages)
    engine = llm.engine
    bm = engine.scheduler.blocks
    assert engine.stats()["kv_bytes"] == pages * bm.layout.page_bytes == engine.executor.worker.group_pool.nbytes
    lens = [150, 70, 233, 9, 101]
    for i, n in enumerate(lens):
        engine.add_request(f"r{i}", prompt(n, seed=200 + i), _greedy(12))
    checked = preempted = 0
    while engine.has_unfinished():
        engine.step()
        want = {"sliding": 0, "csa": 0, "hca": 0, "state": 0}
        for seq in engine.scheduler.running:
            need = expected_pages(bm.layout, seq.num_computed_tokens)
            assert bm.held(seq) == need, (seq.request_id, seq.num_computed_tokens)
            for k, v in need.items():
                want[k] += v
        for seq in engine.scheduler.waiting:
            assert bm.held(seq) == {}  # preempted or not started: nothing held
        stats = engine.stats()
        assert {k: v["blocks"] for k, v in stats["cache_groups"].items()} == want
        assert stats["kv_blocks_free"] == pages - sum(want.values())
        assert stats["cache_groups"]["sliding"]["bytes"] == want["sliding"] * bm.layout.page_bytes
        checked += 1
        preempted = max(preempted, stats["preemptions"])
        if checked == 6:  # one request aborted mid-prefill gives back every page at once
            victim = next(s for s in engine.scheduler.running if s.num_computed_tokens)
            held = sum(bm.held(victim).values())
            free = engine.stats()["kv_blocks_free"]
            assert engine.abort_request(victim.request_id)
            assert bm.held(victim) == {} and engine.stats()["kv_blocks_free"] == free + held
    assert checked > 20 and preempted > 0
    _all_back(llm)


def test_abort_with_async_scheduling_gives_every_page_back(pair, tmp_path):
    llm = _llm(pair, tmp_path, max_num_batched_tokens=64, max_num_seqs=4, async_scheduling=True)
    engine = llm.engine
    for i, n in enumerate((120, 300, 33)):
        engine.add_request(f"a{i}", prompt(n, seed=300 + i), _greedy(20))
    for _ in range(5):
        engine.step()
    assert engine.stats()["kv_blocks_free"] < engine.stats()["kv_blocks_total"]
    for i in range(3):
        engine.abort_request(f"a{i}")
    while engine.has_unfinished():
        engine.step()
    _all_back(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failing_request_fails_alone_and_commits_nothing(pair, tmp_path, monkeypatch, async_scheduling):
    """A step failing (a planted lookup error whenever r1 decodes) is run again in halves: the others' steps commit
    their pages and give the tokens of a run without r1; r1 fails alone, and every page comes back."""
    from tests.engine_runs import run_with_failing_decodes

    reqs = [prompt(n, seed=400 + i) for i, n in enumerate((90, 140, 61))]
    llm = _llm(pair, tmp_path, max_num_batched_tokens=64, max_num_seqs=3, async_scheduling=async_scheduling)
    engine = llm.engine
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", p, _greedy(6))
    out, failed = run_with_failing_decodes(engine, monkeypatch, "r1", len(reqs[1]))
    assert failed == ["r1"] and set(out) == {"r0", "r2"}
    _all_back(llm)
    clean = _llm(pair, tmp_path, max_num_batched_tokens=64, max_num_seqs=3)
    want = clean.generate([{"prompt_token_ids": reqs[i]} for i in (0, 2)], _greedy(6), use_tqdm=False)
    assert [out["r0"], out["r2"]] == [w.outputs[0].token_ids for w in want]
