"""engram.bench.read_cycle: a disk step's time around its reads, from host timestamps. The cycle arithmetic
on made-up marks (exact), then a real engine over disk tables on the CPU (the intervals add up to the
period, every table read in every cycle)."""
from __future__ import annotations

import pytest
import torch

from engram.bench.read_cycle import Marks, cycle_rows, format_summary, record_cycles, summarize


def test_cycles_split_the_period_between_tail_plan_reads_and_hand_offs():
    # three steps; ids at 0, 10, 20 ms; layer 1 reads 1..4 (+10 each step), layer 15 reads 5..8
    ms = 1e-3
    marks = Marks(reads={1: [((1 + 10 * k) * ms, (4 + 10 * k) * ms) for k in range(3)],
                         15: [((5 + 10 * k) * ms, (6 + 10 * k) * ms) for k in range(3)]
                         + [((6.5 + 10 * k) * ms, (8 + 10 * k) * ms) for k in range(3)]},
                  ids=[0.0, 10 * ms, 20 * ms], done=[8.1 * ms, 18.1 * ms], settle=[8.2 * ms, 18.2 * ms],
                  finish=[8.5 * ms, 18.5 * ms], start=[9 * ms, 19 * ms],
                  # each table's admit_probed inside finishing (layer 15's: 0.15 then 0.25 ms: median 0.2), its
                  # cache's admit inside that; a span at 12 ms is after the first window and before the second
                  admits={1: [(8.2 * ms, 8.3 * ms), (18.2 * ms, 18.3 * ms)],
                          15: [(8.3 * ms, 8.45 * ms), (18.3 * ms, 18.55 * ms), (12 * ms, 12.5 * ms)]},
                  caching={1: [(8.22 * ms, 8.28 * ms), (18.22 * ms, 18.28 * ms)]},
                  asked=[9.0 * ms, 9.2 * ms, 19.5 * ms])  # the last ask before the ids: 0.8, 0.5 ms before
    got = summarize(marks)
    assert got["cycles"] == 2
    want = {"tail": 2.0, "plan": 1.0, "read[1]": 3.0, "between[15]": 1.0, "read[15]": 3.0, "period": 10.0,
            "reads": 6.0, "done": 0.1, "settle": 0.2, "finish": 0.5, "start": 1.0, "admit(1)": 0.1,
            "asked": 1.35, "admit(15)": 0.2, "caching(1)": 0.06}
    assert {k: round(v["median"], 9) for k, v in got.items() if k != "cycles"} == want
    assert "tail" in format_summary(got)


def test_no_cycle_without_reads_from_every_table():
    marks = Marks(reads={1: [(0.001, 0.002)], 15: []}, ids=[0.0, 0.01, 0.02])
    assert summarize(marks) == {"cycles": 0}
    assert "none read" in format_summary(summarize(marks))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_disk_engine_on_the_cpu(tmp_path, async_scheduling):
    import engram
    from engram.engine.sampling_params import SamplingParams
    from tests.integration.test_engine import prompts

    llm = engram.LLM("tiny", tier="disk", dtype=torch.float32, device="cpu", cache_dir=str(tmp_path),
                     max_num_seqs=4, async_scheduling=async_scheduling)
    engine = llm.engine
    for i, p in enumerate(prompts(4, seed=5)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    marks = record_cycles(engine, 12)
    got = summarize(marks)
    assert got["cycles"] >= 5, got
    layers = sorted(marks.reads)
    assert len(layers) >= 2 and all(f"read[{lid}]" in got for lid in layers)
    for row in cycle_rows(marks):  # each cycle: the step before's last read, then these, one after the other
        assert row["tail"] > 0 and row["plan"] >= 0 and all(v >= 0 for k, v in row.items() if "[" in k)
        parts = row["tail"] + row["plan"] + sum(v for k, v in row.items() if "[" in k)
        assert parts == pytest.approx(row["period"], rel=1e-9, abs=1e-12)
    # the wrappers are gone: the reader's read is its class's again
    table = engine.executor.worker.tables[layers[0]]
    assert "read" not in vars(table.reader)


def test_switch_ab_flips_per_step_switches_between_samples_of_one_engine(tmp_path, monkeypatch):
    import engram
    import engram.engine.lookup as lookup_mod
    from engram.bench.read_cycle import switch_ab
    from engram.bench.stats import ABConfig
    from engram.engine.sampling_params import SamplingParams
    from tests.integration.test_engine import prompts

    llm = engram.LLM("tiny", tier="disk", dtype=torch.float32, device="cpu", cache_dir=str(tmp_path),
                     max_num_seqs=4)
    engine = llm.engine
    for i, p in enumerate(prompts(4, seed=5)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    engine.step()
    seen = []  # the switch as each step's lookups saw it
    submit = lookup_mod.LookupExecutor.submit
    monkeypatch.setattr(lookup_mod.LookupExecutor, "submit",
                        lambda self, *a, **k: (seen.append(lookup_mod.FIRST_LOOKUP_ALONE), submit(self, *a, **k))[1])
    runs = []
    cfg = ABConfig(repeats=2, warmup=1, n_boot=200)
    result, cycles = switch_ab(engine, {"first_lookup_alone": False}, 4, cfg, on_run=runs.append)
    assert lookup_mod.FIRST_LOOKUP_ALONE is True  # restored
    assert [r.arm for r in runs] == ["A", "A'", "B", "A", "A'", "B", "B", "A'", "A"]
    assert seen == [r.arm != "B" for r in runs for _ in range(4)]  # B's steps, and only those, flipped
    assert {k: len(v) for k, v in result.samples.items()} == {"A": 2, "A'": 2, "B": 2}
    assert all(v > 0 for x in result.samples.values() for v in x)
    assert set(cycles) == {"A", "A'", "B"} and all(c["cycles"] >= 4 for c in cycles.values()), cycles
    assert set(result.comparisons) == {"B/A", "A'/A"}


@pytest.mark.parametrize("switches, cfg_kw, match", [
    ({"pdl": False}, {}, "captured into decode graphs"),
    ({"together_when_deep": 1}, {}, "must be true or false"),
    ({"together_when_deep": False}, {"higher_is_better": True}, "step times"),
])
def test_switch_ab_refuses_what_it_cannot_compare(switches, cfg_kw, match):
    from engram.bench.read_cycle import switch_ab
    from engram.bench.stats import ABConfig

    with pytest.raises(ValueError, match=match):
        switch_ab(None, switches, 4, ABConfig(repeats=2, **cfg_kw))
