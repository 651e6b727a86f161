"""DeepSeek-V4 decode steps through ``V4GraphRunner`` (engram/engine/runners/v4_graphs.py) in the engine, CPU float64,
a transformers save_pretrained checkpoint with Engram, the graphs' callables run uncaptured on their static inputs
(``graph_capture=False``, the CPU's way through them): 16 concurrent mixed-length requests, synchronous and async,
give the eager engine's tokens and logprobs, with padding rows, three context spans and compressor windows closing
for some sequences and not others in the same replay (all counted); the staged-rows path (disk tables) likewise; the
reference's greedy tokens through preemptions forced by a tiny pool; a request whose lookups fail before its replay
fails alone; every page of every group comes back. Mutations: padding rows pointed at a page sequences hold, a
replay whose state positions are not committed."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from tests.parity.deepseek_v4_fixtures import ENGRAM, Pair, decode_heavy_requests, prompt  # noqa: E402

import engram  # noqa: E402
from engram.engine.runners import v4_batched_pages  # noqa: E402
from engram.engine.runners.v4_graphs import V4GraphRunner, context_spans  # noqa: E402
from tests.engine_runs import engine_with_worker  # noqa: E402

pytestmark = pytest.mark.timeout(900)
SPANS = [64, 160, 512]  # max_position_embeddings 512: every span used by the requests below


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("v4graphs"), ENGRAM)


@pytest.fixture(scope="module")
def requests():
    return decode_heavy_requests()


def _greedy(n: int) -> engram.SamplingParams:
    return engram.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)


def _llm(pair, tmp_path, **options):
    return engram.LLM(model=str(pair.path), dtype="float64", device="cpu", cache_dir=str(tmp_path / "cache"),
                      **options)


def _graph_llm(pair, tmp_path, null_page=None, rows_in_graph=None, tier="gpu", **options):
    """An LLM whose Worker has decode graphs (uncaptured) over SPANS; ``null_page``: the padding rows' page (None: the
    Worker's page no sequence holds)."""
    llm = _llm(pair, tmp_path, tier=tier, **options)
    llm.engine = engine_with_worker(llm.loaded, llm.engine.config, graph_capture=False)
    w, cfg = llm.engine.executor.worker, llm.engine.config
    assert [r.name for r in w.runners] == ["graph", "eager"]  # the Worker built it
    runner = V4GraphRunner(w.model, w.group_pool, w.memory.num_blocks if null_page is None else null_page, w.tables,
                           w.lookup, w.ecfg, min(cfg.max_num_seqs, cfg.max_graph_batch), llm.engine.max_model_len,
                           w.device, capture=False, spans=SPANS, rows_in_graph=rows_in_graph)
    w.runners = [runner, w.eager]
    return llm


def _generate(llm, requests):
    prompts, news = requests
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_greedy(n) for n in news], use_tqdm=False)
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]


def _assert_close(want, got) -> None:
    """Tokens equal; own and top logprobs within 1e-9 (float64 hidden states, float32 logits)."""
    for (tw, lw), (tg, lg) in zip(want, got, strict=True):
        assert tg == tw
        for (a, top_a), (b, top_b) in zip(lw, lg, strict=True):
            assert abs(a - b) <= 1e-9 and [t for t, _ in top_a] == [t for t, _ in top_b]


def _all_back(llm) -> None:
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(c["blocks"] == 0 for c in stats["cache_groups"].values())


@pytest.fixture(scope="module")
def eager(pair, tmp_path_factory, requests):
    llm = _llm(pair, tmp_path_factory.mktemp("eager"), max_num_batched_tokens=128, max_num_seqs=16)
    assert [r.name for r in llm.engine.executor.worker.runners] == ["eager"]  # the CPU captures nothing
    return _generate(llm, requests)


def _assert_graphs_ran(llm) -> dict:
    stats = llm.engine.stats()
    vg = stats["v4_graph"]
    assert stats["steps_by_route"]["graph"] == stats["graph_replays"] >= 15, stats["steps_by_route"]
    assert sum(vg["replays_by_span"].values()) == stats["graph_replays"]
    assert sum(1 for n in vg["replays_by_span"].values() if n) >= 2, vg  # short and long contexts
    assert vg["padded_rows"] > 0 and vg["partial_closes"] > 0, vg
    return vg


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sixteen_concurrent_requests_through_decode_graphs_equal_eager(pair, tmp_path, requests, eager,
                                                                        async_scheduling):
    llm = _graph_llm(pair, tmp_path, max_num_batched_tokens=128, max_num_seqs=16, async_scheduling=async_scheduling)
    _assert_close(eager, _generate(llm, requests))
    assert _assert_graphs_ran(llm)["rows_in_graph"]
    _all_back(llm)


@pytest.mark.parametrize("tier", ["gpu", "disk"])
def test_staged_rows_copied_in_equal_eager(pair, tmp_path, requests, eager, tier):
    """The path of tables that do not gather on the device: rows staged by the lookup executor, copied in."""
    llm = _graph_llm(pair, tmp_path, rows_in_graph=False, tier=tier, max_num_batched_tokens=128, max_num_seqs=16)
    _assert_close(eager, _generate(llm, requests))
    assert not _assert_graphs_ran(llm)["rows_in_graph"]


def test_preemptions_through_decode_graphs_give_the_reference_tokens(pair, tmp_path):
    prompts = [prompt(n, seed=40 + i) for i, n in enumerate((300, 131, 45))]
    reference = [pair.greedy_logprobs(p, 8) for p in prompts]
    probe = _llm(pair, tmp_path)
    least = probe.engine.scheduler.blocks.layout.max_blocks_per_sequence(probe.engine.max_model_len)
    llm = _graph_llm(pair, tmp_path, num_kv_blocks=least, max_num_batched_tokens=64, max_num_seqs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(8), use_tqdm=False)
    for out, (tokens, lps) in zip(outs, reference):
        assert out.outputs[0].token_ids == tokens
        assert max(abs(lp.logprob - r) for lp, r in zip(out.outputs[0].logprobs, lps)) < 2e-5
    assert llm.engine.num_preemptions > 0 and llm.engine.stats()["graph_replays"] > 0
    _all_back(llm)


def test_padding_rows_on_a_held_page_change_the_tokens(pair, tmp_path, requests, eager, monkeypatch):
    """Padding rows given the first sequence's pages (a bucket padded by repeating a row's tables): their writes
    (position 0's key, buffer slot 0) land in its pages, and its tokens or logprobs move."""
    real = V4GraphRunner._pad

    def pad_with_row_zero(self, step, size):
        positions, tables, names = real(self, step, size)
        s = step.num_seqs
        for t in tables.values():
            t[s:, :t.shape[1]] = t[0]
        return positions, tables, names

    monkeypatch.setattr(V4GraphRunner, "_pad", pad_with_row_zero)
    llm = _graph_llm(pair, tmp_path, max_num_batched_tokens=128, max_num_seqs=16)
    got = _generate(llm, requests)
    gap = max(abs(a - b) for (_, lw), (_, lg) in zip(eager, got) for (a, _), (b, _) in zip(lw, lg))
    assert [t for t, _ in got] != [t for t, _ in eager] or gap > 1e-6, gap


def test_a_replay_without_its_commit_is_refused(pair, tmp_path, requests, monkeypatch):
    monkeypatch.setattr(v4_batched_pages.BatchedPages, "commit", lambda self, idx, count=None: None)
    llm = _graph_llm(pair, tmp_path, max_num_batched_tokens=128, max_num_seqs=16)
    with pytest.raises(Exception, match="state pages hold position"):
        _generate(llm, requests)


def test_context_spans():
    assert context_spans(512) == [512]
    assert context_spans(4096) == [1024, 4096]
    assert context_spans(65536) == [1024, 4096, 16384, 65536]
    assert context_spans(100_000) == [1024, 4096, 16384, 65536, 100_000]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failing_graph_step_commits_nothing(pair, tmp_path, monkeypatch, async_scheduling):
    """Staged rows (the disk tier's path): r1's lookups fail whenever it decodes, before the replay; its steps are run
    again in halves, r1 fails alone, the others give the tokens of a run without it, and every page comes back."""
    from tests.engine_runs import run_with_failing_decodes

    reqs = [prompt(n, seed=400 + i) for i, n in enumerate((90, 140, 61))]
    llm = _graph_llm(pair, tmp_path, rows_in_graph=False, max_num_batched_tokens=64, max_num_seqs=3,
                     async_scheduling=async_scheduling)
    for i, p in enumerate(reqs):
        llm.engine.add_request(f"r{i}", p, engram.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    out, failed = run_with_failing_decodes(llm.engine, monkeypatch, "r1", len(reqs[1]))
    assert failed == ["r1"] and set(out) == {"r0", "r2"}
    assert llm.engine.stats()["graph_replays"] > 0
    _all_back(llm)
    clean = _llm(pair, tmp_path, max_num_batched_tokens=64, max_num_seqs=3)
    want = clean.generate([{"prompt_token_ids": reqs[i]} for i in (0, 2)],
                          engram.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [out["r0"], out["r2"]] == [w.outputs[0].token_ids for w in want]


def test_the_batched_caches_come_out_of_a_kv_budget(pair, tmp_path):
    """With engine.kv_cache_memory, the graphs' batched caches (counted on the meta device before anything is
    allocated, equal to what the runner allocates) are taken out of it: the pool gets that many fewer pages; a budget
    they leave too small for one sequence names them."""
    from engram.engine.runners.v4_graphs import batched_cache_bytes

    eager = _llm(pair, tmp_path, max_num_seqs=8)
    layout = eager.engine.scheduler.blocks.layout
    need = layout.max_blocks_per_sequence(eager.engine.max_model_len) * layout.page_bytes
    cache = batched_cache_bytes(eager.loaded.model, torch.float64, 8, eager.engine.max_model_len)
    w0 = eager.engine.executor.worker
    fixed = w0.memory.staging_bytes + (w0.prefetch.capacity_bytes if w0.prefetch.active else 0)  # Engram staging
    budget = fixed + 3 * need + cache
    llm = _llm(pair, tmp_path, max_num_seqs=8, kv_cache_memory=budget)
    graphs = engine_with_worker(llm.loaded, llm.engine.config, graph_capture=False)
    w = graphs.executor.worker
    assert w.runners[0].cache_bytes == cache > 0
    page = layout.page_bytes
    assert llm.engine.executor.worker.memory.num_blocks == (budget - fixed) // page  # the eager Worker: all of it
    assert w.memory.num_blocks == (budget - fixed - cache) // page
    short = dataclasses.replace(llm.engine.config, kv_cache_memory=fixed + need + cache // 2)
    with pytest.raises(ValueError, match="CUDA graphs' buffers"):
        engine_with_worker(llm.loaded, short, graph_capture=False)
