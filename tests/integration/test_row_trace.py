"""The engine's row trace (engine/row_trace.py) on tiny disk-tier runs: it holds exactly the distinct ids each step
read, computed here straight from the prompts and outputs (with async scheduling too, where decode tokens' ids are
completed from the tokens the step before sampled), its replay without a cache reads as many pages as the disk tier
did, and bad paths fail at start naming the path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import engram
from engram.bench.page_replay import trace_pages
from engram.cli import main
from engram.engine.row_trace import read_row_trace

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["the quick brown fox jumps over the lazy dog and the cat", "hello world, hello again world", "a b a b a"]
DISK = {"io": "buffered"}


def _run(path, prompts=PROMPTS, max_tokens=6, **engine):
    llm = engram.LLM("tiny", tier="disk", dtype="float32", engram_config=DISK, row_trace=str(path), **engine)
    outs = llm.generate(prompts, engram.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return llm, outs


def _rows(llm, out) -> dict[int, np.ndarray]:
    """Every position's row ids [T, n_cols] per layer of a request's prompt + outputs, hashed from scratch."""
    eng = llm.engine
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    comp = torch.tensor([eng.ctok.compress(ids, eng.ecfg.dead_token_ids)], dtype=torch.int64)
    return {lid: eng.hasher.hash(comp, lid)[0].numpy() for lid in eng.ecfg.layer_ids}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_request_at_a_time_the_trace_holds_each_steps_distinct_ids(tmp_path, async_scheduling):
    llm, outs = _run(tmp_path / "t.trace", max_num_seqs=1, async_scheduling=async_scheduling)
    assert llm.engine.pipeline.async_scheduling() is async_scheduling  # True: decode steps carry pending tokens
    llm.engine.close()
    trace = read_row_trace(tmp_path / "t.trace")
    lids = llm.engine.ecfg.layer_ids
    expected, kinds = [], []  # per step: per layer the distinct ids; request after request (one at a time)
    for out in outs:
        rows = _rows(llm, out)
        p, n = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        spans = [range(p)] + [[p + j] for j in range(n - 1)]  # the prefill, then each fed output token but the last
        expected += [[np.unique(rows[lid][list(s)]) for lid in lids] for s in spans]
        kinds += ["prefill"] + ["decode"] * (n - 1)
    assert trace.steps.shape[0] == len(expected) and trace.kinds == kinds
    for i, lid in enumerate(lids):
        got, bounds = trace.layer(i)
        for s, want in enumerate(expected):
            assert got[bounds[s]:bounds[s + 1]].tolist() == want[i].tolist(), (lid, s)
    records = llm.engine.step_trace()
    assert trace.step_ids.tolist() == [r.step_id for r in records]
    assert trace.steps[:, 2].tolist() == [r.num_tokens for r in records]
    assert [tuple(trace.planned(i)) for i in range(len(lids))] == [tuple(r.ids[i] for r in records)
                                                                   for i in range(len(lids))]


def test_batched_steps_trace_every_fed_position_and_the_replay_reads_the_disk_tiers_pages(tmp_path):
    llm, outs = _run(tmp_path / "t.trace", max_num_seqs=3, max_num_batched_tokens=16)  # prompts in chunks
    stats = llm.engine.stats()["tables"]
    llm.engine.close()
    trace = read_row_trace(tmp_path / "t.trace")
    lids = llm.engine.ecfg.layer_ids
    assert set(trace.kinds) >= {"mixed", "decode"}
    records = llm.engine.step_trace()
    for i, lid in enumerate(lids):
        got, bounds = trace.layer(i)
        assert np.all(np.diff(bounds) == trace.distinct(i))
        assert trace.distinct(i).tolist() == [r.unique_ids[i] for r in records]  # no pending tokens: the plan's
        for a, b in zip(bounds[:-1], bounds[1:]):
            assert np.all(np.diff(got[a:b]) > 0)  # distinct and ascending within a step
        fed = np.unique(np.concatenate([_rows(llm, o)[lid][:-1].reshape(-1) for o in outs]))
        assert np.array_equal(np.unique(got), fed)  # every row of every fed position, nothing else
    files = trace.header["table_files"]
    assert sorted(files) == [str(lid) for lid in lids] and files[str(lids[0])]["cache_rows"] == 0
    replay = trace_pages(trace)
    assert replay["pages"] == sum(stats[lid]["read_ops"] for lid in lids) > 0  # one read per distinct page a step


def test_bad_trace_paths_fail_at_start_naming_the_path(tmp_path, capsys):
    bad = tmp_path / "missing-dir" / "t.trace"
    with pytest.raises(ValueError, match="missing-dir"):
        engram.LLM("tiny", tier="disk", engram_config=DISK, row_trace=str(bad))
    assert main(["serve", "--row-trace", str(tmp_path), "--port", "0"]) == 2
    assert f"--row-trace='{tmp_path}'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="engine.row_trace=.*data_parallel_size=2"):
        engram.engine.config.EngineConfig(row_trace=str(tmp_path / "t"), data_parallel_size=2)
