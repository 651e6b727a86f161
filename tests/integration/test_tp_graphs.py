"""Tensor-parallel ranks through the single-GPU engine's graph runners (engine/runners/graphs.py) on the CPU, real
spawned processes over gloo: ``RankSpec.graph_capture`` False runs each rank's decode and mixed graphs' callables
uncaptured on their static inputs, collectives inside (the Engram rows' all-gather at the step's fixed point,
runners/column_gathers.py). Greedy tokens equal TP1's and logprobs within a relative 1e-9 in float64 (tiny and small,
both WKV layouts), the steps really took the graph routes, one rank's delayed reads change nothing, and every rank
issues the same collectives in the same order through prefill, mixed and decode steps. The captured graphs:
tests/gpu/test_tp_nccl.py."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import engram
from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.multiproc import MultiprocExecutor, RankSpec, free_port
from engram.model.loader import load_model
from tests.integration.test_tp_engram import SlowRank
from tests.tp_compare import worst_logprob_gap

PROMPTS = ["hello world", "the cat sat on the mat", [5, 17, 17, 300, 2]]
ENGINE = dict(num_kv_blocks=48, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)
COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "broadcast_object_list", "all_gather_object")


def _params(max_tokens: int = 6) -> engram.SamplingParams:
    return engram.SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)


@dataclass(frozen=True)
class RecordCollectives:
    """``RankSpec.wrap_lookup``: from the Worker's construction on, append every torch.distributed collective the
    rank issues (name, dtype, shape of its tensor) as a JSON line to ``directory``/rank<r>.jsonl; the collectives
    themselves run unchanged."""

    directory: str

    def __call__(self, rank: int, executor):
        import torch.distributed as dist

        log = Path(self.directory) / f"rank{rank}.jsonl"

        def recording(name, real):
            def run(*args, **kwargs):
                t = args[1] if name == "all_gather" else args[0]  # all_gather(outputs, input): the input
                what = [name, str(t.dtype), list(t.shape)] if isinstance(t, torch.Tensor) else [name]
                with log.open("a") as f:
                    f.write(json.dumps(what) + "\n")
                return real(*args, **kwargs)
            return run

        for name in COLLECTIVES:
            setattr(dist, name, recording(name, getattr(dist, name)))
        return executor


def _run_tp(model: str, prompts, params, dtype=torch.float64, **spec_args) -> tuple[list, dict]:
    """Generate ``prompts`` on TP2 ranks taking the graph path (uncaptured) -> (outputs in order, engine stats)."""
    wkv = spec_args.pop("wkv", "replicated")
    cfg = EngineConfig(**ENGINE, tensor_parallel_size=2)
    options = engram.model.options.RuntimeOptions.from_dict({"wkv_tp": wkv})
    loaded = load_model(model, dtype=dtype, device="cpu", engram_config=options, progress=False)
    spec = RankSpec(model, "gpu", dtype, options, None, cfg, ENGINE["max_model_len"],
                    f"tcp://127.0.0.1:{free_port()}", 1, graph_capture=False, **spec_args)
    executor = MultiprocExecutor(spec)
    try:
        engine = LLMEngine(loaded, cfg, torch.device("cpu"), dtype, executor=executor)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        start, done = time.monotonic(), {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            assert time.monotonic() - start < 120, "no progress: a collective hangs"
        stats = engine.stats()
    finally:
        executor.close()
    return [done[f"r{i}"] for i in range(len(prompts))], stats


def _tp1(model: str, wkv: str, prompts, params):
    llm = engram.LLM(model, dtype="float64", device="cpu", engram_config={"wkv_tp": wkv}, **ENGINE)
    return llm.generate(prompts, params, use_tqdm=False)


def _assert_graph_routes(stats: dict) -> None:
    routes = stats["steps_by_route"]
    assert routes.get("graph", 0) >= 3 and routes.get("mixed-graph", 0) >= 1, routes
    assert stats["graph_replays"] == routes["graph"] and stats["mixed_graph_replays"] == routes["mixed-graph"]


@pytest.mark.parametrize("wkv", ["replicated", "column"])
def test_tp2_graph_path_matches_tp1_tiny(wkv):
    got, stats = _run_tp("tiny", PROMPTS, _params(), wkv=wkv)
    assert worst_logprob_gap(_tp1("tiny", wkv, PROMPTS, _params()), got) <= 1e-9
    _assert_graph_routes(stats)


@pytest.mark.parametrize("wkv", ["replicated", "column"])
def test_tp2_graph_path_matches_tp1_small(wkv):
    params = _params(4)
    got, stats = _run_tp("small", PROMPTS, params, wkv=wkv)
    assert worst_logprob_gap(_tp1("small", wkv, PROMPTS, params), got) <= 1e-9
    _assert_graph_routes(stats)


def test_one_rank_with_delayed_reads_on_the_graph_path_gives_tp1s_tokens():
    got, stats = _run_tp("tiny", PROMPTS, _params(), before_lookup=SlowRank(1, 0.010))
    assert worst_logprob_gap(_tp1("tiny", "replicated", PROMPTS, _params()), got) <= 1e-9
    _assert_graph_routes(stats)


def test_every_rank_issues_the_same_collectives_in_the_same_order(tmp_path):
    # more requests than max_num_seqs (4), some longer than a step's token budget (32): prompts (chunked) start
    # beside running decodes, making mixed steps
    prompts = [list(range(100 * k + 5, 100 * k + 5 + n)) for k, n in enumerate((45, 3, 20, 9, 38, 12, 5))]
    got, stats = _run_tp("tiny", prompts, _params(5), wkv="column", wrap_lookup=RecordCollectives(str(tmp_path)),
                         before_lookup=SlowRank(0, 0.005))
    assert stats["steps_by_kind"].get("mixed", 0) >= 1 and stats["steps_by_kind"].get("decode", 0) >= 3, stats
    _assert_graph_routes(stats)
    assert worst_logprob_gap(_tp1("tiny", "column", prompts, _params(5)), got) <= 1e-9
    logs = [[json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert len(logs[0]) > 100 and logs[0] == logs[1]
    # each step (a control broadcast, then its collectives): the Engram rows' all-gathers (uint8 bytes) come before
    # the forward's first all-reduce (the embedding's), whatever the timing of the reads
    steps, current = [], None
    for entry in logs[0]:
        if entry[0] == "broadcast_object_list":
            current = []
            steps.append(current)
        elif current is not None:
            current.append(entry)
    forwards = [s for s in steps if any(e[0] == "all_reduce" for e in s)]
    assert len(forwards) >= 5
    for s in forwards:
        first_reduce = next(i for i, e in enumerate(s) if e[0] == "all_reduce")
        assert [e for e in s[:first_reduce] if e[0] == "all_gather"] and all(
            e[1] == "torch.uint8" for e in s[:first_reduce] if e[0] == "all_gather"), s[:first_reduce + 1]
