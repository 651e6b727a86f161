"""``EarlyLookups`` (engine/early_lookups.py) over real tables: a step's lookups started early are the rows its launch
gets (bitwise those of a plain submit), each started step keeps its own rows (consuming another step's raises), a
failed start fails that step's own submit only, and the bound on steps started ahead holds with a message. (Steps
started with their tokens in flight patched in run in tests/integration/test_pp_microbatches.py, on real stages.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.engine.early_lookups import EarlyLookups
from engram.engine.lookup import LookupExecutor
from engram.engine.prefetch_stage import PrefetchStaging
from tests.integration.test_row_dedup import CPU, F64, repeating_step, tiny  # noqa: F401 (tiny: a fixture)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture
def lookups(tiny):  # noqa: F811
    tables = dataclasses.replace(tiny, tables={}).open_tables()  # its own tables, closed after
    inner = LookupExecutor(tables, tiny.engram_config, F64, CPU)
    early = EarlyLookups(inner, limit=2)
    early.staging = PrefetchStaging(tables, 1 << 20, CPU)  # set through to the wrapped executor
    assert inner.staging is early.staging
    yield early, inner, tiny
    for t in tables.values():
        t.close()


def _steps(loaded):
    """Steps 7 and 8: the same tokens, step 8's row ids offset by one row, so the two stage different rows."""
    a, _ = repeating_step(loaded, dedup=False)
    b = dataclasses.replace(a, step_id=8, engram_row_ids={l: ids + 1 for l, ids in a.engram_row_ids.items()})
    return a, b


def test_started_rows_are_the_launch_rows_and_each_step_keeps_its_own(lookups):
    early, inner, loaded = lookups
    a, b = _steps(loaded)
    early.start(a)
    early.start(b)  # started while step 7's rows are still unconsumed
    assert early.pending == [7, 8]
    got_b, got_a = early.submit(b), early.submit(a)
    for lid in a.engram_row_ids:
        assert torch.equal(_bits(got_a.rows(lid, 7)), _bits(inner.submit(a).rows(lid, 7)))
        assert torch.equal(_bits(got_b.rows(lid, 8)), _bits(inner.submit(b).rows(lid, 8)))
        assert not torch.equal(_bits(got_a.rows(lid, 7)), _bits(got_b.rows(lid, 8)))
        with pytest.raises(RuntimeError, match="staged for step 8, consumed by step 7"):
            got_b.rows(lid, 7)
    assert early.counts == {"started_early": 2, "submitted_at_launch": 0}
    early.submit(a)  # handed out once: a second launch of step 7 submits anew
    assert early.counts == {"started_early": 2, "submitted_at_launch": 1} and early.pending == []


def test_a_failed_start_fails_its_own_step_only(lookups):
    early, _, loaded = lookups
    a, b = _steps(loaded)
    rows = {l: t.rows for l, t in early.tables.items()}
    bad = dataclasses.replace(b, engram_row_ids={l: ids + rows[l] for l, ids in b.engram_row_ids.items()})
    early.start(bad)  # past the end of every table: raises nothing here
    early.start(a)
    lid = next(iter(a.engram_row_ids))
    assert early.submit(a).rows(lid, 7).shape[0] == a.num_tokens  # the step started after it is unaffected
    with pytest.raises(IndexError, match=r"row id \d+ \(position 0\) is out of range for table"):
        early.submit(bad)
    assert early.pending == []


def test_steps_started_ahead_are_bounded_and_a_patched_launch_is_refused(lookups):
    early, _, loaded = lookups
    a, b = _steps(loaded)
    early.start(a)
    early.start(b)
    c = dataclasses.replace(a, step_id=9)
    with pytest.raises(RuntimeError, match=r"step 9: 2 steps' lookups were started and not launched yet \(steps "
                                           r"\[7, 8\], limit 2\)"):
        early.start(c)
    with pytest.raises(RuntimeError, match="step 7: its lookups were started early without a pending-token patch, "
                                           "but its launch asks otherwise"):
        early.submit(a, patch=object())
    pending = dataclasses.replace(c, pending_rows=[0])
    assert not EarlyLookups.can_start(pending)  # its tokens in flight are not here: no patch
    early.start(pending)  # left to its launch: nothing started
    assert early.pending == [8]
    with pytest.raises(ValueError, match="limit=0"):
        EarlyLookups(early.inner, limit=0)
