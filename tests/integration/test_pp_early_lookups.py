"""Pipeline stages start a step's Engram lookups as soon as they learn of the step (engine/stage_inbox.py,
engine/early_lookups.py), while they still compute the microbatch before it: with two stages in real spawned
processes over gloo, the last stage's rows are consumed slowly (0.2 s a layer), the lookups each rank submits and the
rows each step consumes are recorded with their times (``RankSpec.wrap_lookup``), and

* the last stage submits some step's lookups before the step before it (the other microbatch) finished its forward
  there (the forward's end: the runner's ``release`` of that step's rows);
* each stage's ``early_lookups`` counter says lookups started early were consumed by their own step;
* every step consumed exactly its own rows (against the table), and the tokens equal PP1's in float64."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.integration.test_pp_microbatches import CheckedRows, OnEveryRank, _assert_close, _pp1, run_pp2

SLOW_S = 0.2
pytestmark = pytest.mark.timeout(120)  # a stage that hangs fails here, never hangs CI


class TimedRows(CheckedRows):
    """``CheckedRows`` (each layer's rows checked against the table, delayed, logged with begin and end) whose
    ``release`` — the runner's, once the step's forward on this stage is over — is logged with its time."""

    def release(self) -> None:
        super().release()
        with self.log.open("a") as f:
            f.write(json.dumps({"rank": self.rank, "released": self.step.step_id, "at": time.monotonic()}) + "\n")


class RecordedLookup:
    """The rank's lookup executor: each ``submit`` logged with its time; its rows are ``TimedRows``, consumed SLOW_S
    late on ``slow_rank``."""

    def __init__(self, inner, rank: int, slow_rank: int, log: Path):
        self.inner, self.rank, self.slow_rank, self.log = inner, rank, slow_rank, log

    def submit(self, step, patch=None, **kwargs):
        with self.log.open("a") as f:
            f.write(json.dumps({"rank": self.rank, "submit": step.step_id, "at": time.monotonic()}) + "\n")
        return TimedRows(self.inner.submit(step, patch, **kwargs), step, self.inner.tables, self.rank,
                         SLOW_S if self.rank == self.slow_rank else 0.0, self.log, patch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_stage_starts_the_next_microbatch_lookups_while_it_computes_the_one_before(tmp_path):
    want = _pp1()
    log = tmp_path / "lookups.jsonl"
    got, _, stages = run_pp2(OnEveryRank(RecordedLookup, 1, str(log)))
    _assert_close(want, got)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    consumed = [r for r in records if "layer" in r]
    assert consumed and all(r["own_rows"] for r in consumed), [r for r in consumed if not r["own_rows"]]
    # on the last stage, some step's lookups were submitted before the step before it there finished its forward
    submits = {r["submit"]: r["at"] for r in records if r.get("rank") == 1 and "submit" in r}
    released = sorted((r["at"], r["released"]) for r in records if r.get("rank") == 1 and "released" in r)
    assert len(released) == len(submits)
    early = [(prev, step) for (end, prev), (_, step) in zip(released, released[1:]) if submits[step] < end]
    assert early, (submits, released)
    # and those lookups were the ones that step consumed: the counter of lookups started early and used
    counts = [st["early_lookups"] for st in stages]
    assert counts[1]["started_early"] >= len(early), counts
    assert sum(c["started_early"] + c["submitted_at_launch"] for c in counts) == 2 * len(submits), counts


class SlowLastStage:
    """``RankSpec.wrap_lookup`` for PP2 x TP2: on both ranks of the last stage (2 and 3) every layer's rows are
    consumed SLOW_S late, so the next microbatch is on the stage's pipe before the one in its layers finishes."""

    def __call__(self, rank: int, lookup):
        return _Delayed(lookup, SLOW_S if rank >= 2 else 0.0)


class _Delayed:
    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def submit(self, step, patch=None, **kwargs):
        return _DelayedRows(self.inner.submit(step, patch, **kwargs), self.delay_s)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _DelayedRows:
    def __init__(self, staged, delay_s: float):
        self.staged, self.delay_s = staged, delay_s

    def rows(self, layer_id: int, step_id: int):
        time.sleep(self.delay_s)
        return self.staged.rows(layer_id, step_id)

    def release(self) -> None:
        self.staged.release()


def test_both_tp_ranks_of_a_stage_start_the_next_microbatch_lookups_early():
    """PP2 x TP2: the last stage's two ranks start a step's lookups early at the same point of their message streams
    (their column shards' row all-gathers match, or the run would hang or mix rows), and the tokens are PP1's."""
    want = _pp1()
    got, in_flight, stages = run_pp2(SlowLastStage(), tp=2)
    assert in_flight == 3
    _assert_close(want, got)
    counts = [st["early_lookups"] for st in stages]
    assert counts[1]["started_early"] >= 1, counts
    assert counts[0]["started_early"] + counts[0]["submitted_at_launch"] == \
        counts[1]["started_early"] + counts[1]["submitted_at_launch"], counts
