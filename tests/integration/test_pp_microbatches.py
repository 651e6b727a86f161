"""Microbatches of pipeline parallelism keep their own Engram rows: with two stages, real spawned processes over gloo
(engine/microbatches.py, engine/multiproc.py), the last stage's lookups of one microbatch are delayed while the first
stage already runs the other microbatch; every layer of every step must consume exactly its own step's rows (checked
on the rank against the table), and the tokens must equal PP1's. The same scheduling in one process
(``MicrobatchPipeline`` over an in-process Worker) gives PP1's tokens too."""
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
from engram.engine.microbatches import MicrobatchPipeline
from engram.engine.multiproc import MultiprocExecutor, RankSpec, free_port
from engram.model.loader import load_model
from engram.model.options import RuntimeOptions
from tests.engine_runs import drain

PROMPTS = ["hello world", "the cat sat on the mat", [5, 17, 17, 300, 2], "one more prompt of a few words"]
ENGINE = dict(num_kv_blocks=48, max_model_len=256, max_num_seqs=4)
DELAY_S = 0.3
pytestmark = pytest.mark.timeout(120)  # a stage that hangs fails here, never hangs CI


def _params() -> engram.SamplingParams:
    return engram.SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)


def _run(engine: LLMEngine) -> dict:
    """Each request's (token ids, [(logprob, top-k)] per token), PROMPTS run to completion on ``engine``."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, _params())
    return drain(engine)


def _assert_close(want: dict, got: dict) -> None:
    """Greedy tokens equal, every logprob (own and top-k) within a relative 1e-9."""
    assert want.keys() == got.keys()
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        for (lw, top_w), (lg, top_g) in zip(logprobs, got[rid][1], strict=True):
            assert [t for t, _ in top_g] == [t for t, _ in top_w]
            assert all(abs(a - b) <= 1e-9 * abs(a) for (_, a), (_, b) in zip(top_w, top_g))
            assert abs(lw - lg) <= 1e-9 * abs(lw)


def _pp1() -> dict:
    loaded = load_model("tiny", dtype=torch.float64, device="cpu", progress=False)
    return _run(LLMEngine(loaded, EngineConfig(**ENGINE), torch.device("cpu"), torch.float64))


class CheckedRows:
    """A step's staged rows as a rank consumes them: the first ``rows`` of each layer is delayed (``delay_s``) and
    compared with the table's own rows of this step's ids; one JSON line per layer goes to ``log``."""

    def __init__(self, staged, step, tables, rank: int, delay_s: float, log: Path, patch=None):
        self.staged, self.step, self.tables, self.rank, self.delay_s, self.log = staged, step, tables, rank, delay_s, log
        self.patch = patch  # the step's tokens in flight (relayed from the last stage): their rows' ids

    def rows(self, layer_id: int, step_id: int) -> torch.Tensor:
        begin = time.monotonic()
        time.sleep(self.delay_s)
        rows = self.staged.rows(layer_id, step_id)
        ids = self.step.engram_row_ids[layer_id]  # [T, n_cols]
        if self.patch is not None:  # the pending rows' ids, hashed from the relayed tokens
            ids = self.patch.patched(ids, self.patch.row_ids[layer_id].to(ids.device))
        own = self.tables[layer_id].gather(ids.reshape(-1), dtype=torch.float32).to(rows.dtype).reshape(rows.shape)
        record = {"rank": self.rank, "step": self.step.step_id, "layer": layer_id, "begin": begin,
                  "end": time.monotonic(), "own_rows": bool(torch.equal(own.view(torch.uint8),
                                                                        rows.view(torch.uint8)))}
        with self.log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return rows

    def release(self) -> None:
        self.staged.release()


class WatchedLookup:
    """The rank's lookup executor, its steps' staged rows wrapped in ``CheckedRows``; on rank ``slow_rank`` every even
    step's (one microbatch of two) are delayed by DELAY_S. ``log``: where ``CheckedRows`` writes."""

    def __init__(self, inner, rank: int, slow_rank: int, log: Path):
        self.inner, self.rank, self.slow_rank, self.log = inner, rank, slow_rank, log

    def submit(self, step, patch=None, **kwargs):
        delay = DELAY_S if self.rank == self.slow_rank and step.step_id % 2 == 0 else 0.0
        return CheckedRows(self.inner.submit(step, patch, **kwargs), step, self.inner.tables, self.rank, delay,
                           self.log, patch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@dataclass(frozen=True)
class OnEveryRank:
    """``RankSpec.wrap_lookup`` (picklable): ``wrapper(lookup, rank, slow_rank, log)`` on every rank (``wrapper``: a
    module-level class such as ``WatchedLookup``)."""

    wrapper: type
    slow_rank: int
    log: str

    def __call__(self, rank: int, lookup):
        return self.wrapper(lookup, rank, self.slow_rank, Path(self.log))


def run_pp2(wrap_lookup, tp: int = 1) -> tuple[dict, int, list[dict]]:
    """PROMPTS on tiny in float64 over two spawned stages (layers 0-1 | 2-3) of ``tp`` ranks each, each rank's lookups
    wrapped by ``wrap_lookup`` -> (outputs as ``_run`` gives them, the most microbatches in flight, each stage's
    stats)."""
    cfg = EngineConfig(**ENGINE, pipeline_parallel_size=2, tensor_parallel_size=tp)
    loaded = load_model("tiny", dtype=torch.float64, device="cpu", progress=False)
    spec = RankSpec("tiny", "gpu", torch.float64, RuntimeOptions(), None, cfg, 256, f"tcp://127.0.0.1:{free_port()}",
                    1, partition=(2, 2), wrap_lookup=wrap_lookup)
    executor = MultiprocExecutor(spec, [(1,), (3,)])
    try:
        engine = LLMEngine(loaded, cfg, torch.device("cpu"), torch.float64, executor=executor)
        got = _run(engine)  # a stage that hangs fails the test by its timeout
        return got, engine.pipeline.max_in_flight, executor.stats()["stages"]
    finally:
        executor.close()


def test_a_delayed_microbatch_leaves_the_others_rows_untouched(tmp_path):
    want = _pp1()
    log = tmp_path / "rows.jsonl"
    got, in_flight, stages = run_pp2(OnEveryRank(WatchedLookup, 1, str(log)))
    assert in_flight == 3  # two microbatches, and a third launched before the oldest is read (tokens relayed)
    _assert_close(want, got)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {(r["rank"], r["layer"]) for r in records} == {(0, 1), (1, 3)}  # each stage reads its own layer only
    assert all(r["own_rows"] for r in records), [r for r in records if not r["own_rows"]]
    # while the last stage waited for a delayed microbatch's rows, the first stage ran the other microbatch
    slow = [r for r in records if r["rank"] == 1 and r["step"] % 2 == 0]
    first = {r["step"]: r for r in records if r["rank"] == 0}
    assert any(first.get(r["step"] + 1, {}).get("begin", float("inf")) < r["end"] for r in slow), records


def test_microbatches_in_one_process_match_one_batch():
    """The scheduling alone: two microbatches in flight over an in-process Worker (it runs each at launch)."""
    want = _pp1()
    cfg = EngineConfig(**ENGINE, pipeline_parallel_size=2)
    loaded = load_model("tiny", dtype=torch.float64, device="cpu", progress=False)
    engine = LLMEngine(loaded, cfg, torch.device("cpu"), torch.float64)
    assert isinstance(engine.pipeline, MicrobatchPipeline) and engine.pipeline.share == 2
    got = _run(engine)
    assert engine.pipeline.max_in_flight == 2
    _assert_close(want, got)
