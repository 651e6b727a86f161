"""PP planner of engram.parallel.pp: accepted and rejected cuts on the DeepSeek-V4.1-Flash sharing config,
the exact rejection format, partition sources, minimax optimality against brute force, local allocation."""
import dataclasses
import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.parallel.pp import (PARTITION_ENV, Stage, best_partition, crossing_edges, layer_costs,
                                local_allocation, plan_pipeline)
from engram.parallel.pp_graph import sharing_graph
from tests.pp_configs import V41_FLASH

EDGE_LINE = re.compile(r"^  (kv|index|index_k|candidate) source layer (\d+) \(stage (\d+)\) "
                       r"-> layer (\d+) \(stage (\d+)\)$")


def plan(pp, partition=None, env=None, **kw):
    return plan_pipeline(V41_FLASH, pp, partition=partition, env={} if env is None else env, **kw)


def test_single_stage_holds_everything():
    p = plan(1)
    assert p.partition == (40,) and p.legal_cut_points == (1, 2, 8, 14, 20)
    a = local_allocation(p, 0)
    assert a.kv_cache_layers == (2, 8, 14, 20) and a.layers == tuple(range(40))


@pytest.mark.parametrize("partition", [(20, 20), (8, 6, 6, 20), "8,6,6,20", [2, 6, 12, 20]])
def test_aligned_partitions_are_accepted(partition):
    p = plan(len(partition) if not isinstance(partition, str) else 4, partition)
    assert p.origin == "partition"
    assert p.partition == tuple(int(x) for x in (partition.split(",") if isinstance(partition, str) else partition))
    assert [s.start for s in p.stages] == [0, *itertools.accumulate(p.partition)][:-1]


def test_planner_choices_on_v41_flash():
    assert plan(2).partition == (20, 20)
    assert plan(4).partition == (8, 6, 6, 20)
    assert plan(4).max_stage_cost == 20.0
    assert plan(4).origin == "planner"


def test_equal_four_way_split_is_rejected_with_crossing_edges_and_suggestion():
    with pytest.raises(NotImplementedError) as info:
        plan(4, (10, 10, 10, 10))
    lines = str(info.value).splitlines()
    edges = [m.groups() for m in map(EDGE_LINE.match, lines) if m]
    assert lines[1] == "  kv source layer 8 (stage 0) -> layer 10 (stage 1)"
    assert 1 <= len(edges) <= 4
    stage_of = [i // 10 for i in range(40)]
    for kind, s, ss, c, cs in edges:  # every named edge is real and really crosses
        assert (int(s), int(c)) in {(e.source, e.consumer) for e in sharing_graph(V41_FLASH).edges if e.kind == kind}
        assert (stage_of[int(s)], stage_of[int(c)]) == (int(ss), int(cs)) and ss != cs
    assert {(ss, cs) for _, _, ss, _, cs in edges} == {("0", "1"), ("2", "3")}  # both offending cuts are named
    total = len(crossing_edges(sharing_graph(V41_FLASH), (10, 10, 10, 10)))
    assert f"{total} sharing edge(s)" in lines[0]
    assert lines[-2] == f"  ... and {total - len(edges)} more"
    assert lines[-1] == "suggested partition: 8,6,6,20"
    assert plan(4, "8,6,6,20").partition == (8, 6, 6, 20)  # the suggestion is accepted


def test_few_crossing_edges_are_all_listed_without_ellipsis():
    cfg = {"num_hidden_layers": 4, "kv_source_layer_ids": [0, 2]}
    with pytest.raises(NotImplementedError) as info:
        plan_pipeline(cfg, 2, (1, 3), env={})
    assert str(info.value).splitlines() == [
        "pipeline partition 1,3 separates layers that share state; 1 sharing edge(s) cross a stage boundary:",
        "  kv source layer 0 (stage 0) -> layer 1 (stage 1)",
        "suggested partition: 2,2",
    ]


@pytest.mark.parametrize("pp, partition, match", [
    (2, (20, 19), r"partition=\[20, 19\]: stage ranges cover 39 layers but num_hidden_layers=40"),
    (2, (20, 21), r"cover 41 layers"),
    (4, (8, 6, 26), r"partition=\[8, 6, 26\]: has 3 stages but pp=4"),
    (4, (40, 0, 0, 0), r"every stage needs at least 1 layer"),
    (4, "8,6,x,20", r"partition='8,6,x,20': expected comma-separated layer counts"),
])
def test_malformed_partitions_raise_value_error(pp, partition, match):
    with pytest.raises(ValueError, match=match):
        plan(pp, partition)


def test_environment_partition_is_used_and_argument_wins():
    env = {PARTITION_ENV: "20,20"}
    p = plan(2, env=env)
    assert p.partition == (20, 20) and p.origin == PARTITION_ENV
    assert plan(2, (8, 32), env=env).partition == (8, 32)
    with pytest.raises(NotImplementedError, match=rf"partition 10,30 \(from {PARTITION_ENV}\) separates"):
        plan(2, env={PARTITION_ENV: "10,30"})
    with pytest.raises(ValueError, match=rf"{PARTITION_ENV}=\[20, 20\]: has 2 stages but pp=4"):
        plan(4, env=env)
    with pytest.raises(ValueError, match=rf"{PARTITION_ENV}='twenty': expected"):
        plan(2, env={PARTITION_ENV: "twenty"})


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, "2,6,12,20")
    assert plan_pipeline(V41_FLASH, 4).partition == (2, 6, 12, 20)


def test_too_many_stages():
    with pytest.raises(NotImplementedError, match=r"pp=7 needs 6 cut points but only 5 .*\n"
                                                  r"suggested partition: 1,1,6,6,6,20 \(pp=6"):
        plan(7)
    with pytest.raises(ValueError, match=r"pp=41: more stages than num_hidden_layers=40"):
        plan(41)
    with pytest.raises(ValueError, match=r"pp=0: must be an int >= 1"):
        plan(0)


def test_costs_move_the_cut():
    cfg = {"num_hidden_layers": 4}
    assert plan_pipeline(cfg, 2, env={}).partition == (2, 2)
    assert plan_pipeline(cfg, 2, costs=[3, 1, 1, 1], env={}).partition == (1, 3)
    # Engram layers cost more by default: an Engram layer at 0 and 1 pulls the cut earlier.
    heavy = {"num_hidden_layers": 5, "engram_layer_ids": [0, 1]}
    assert layer_costs(sharing_graph(heavy)) == [1.5, 1.5, 1.0, 1.0, 1.0]
    assert plan_pipeline(heavy, 2, env={}).partition == (2, 3)
    assert plan_pipeline(heavy, 2, engram_cost=0.0, env={}).partition == (2, 3)
    assert plan_pipeline(heavy, 2, engram_cost=4.0, env={}).partition == (1, 4)
    with pytest.raises(ValueError, match=r"layer_costs\[1\]=-1.0: must be a finite number > 0"):
        plan_pipeline(cfg, 2, costs=[1, -1, 1, 1], env={})
    with pytest.raises(ValueError, match=r"layer_costs has 3 values but num_hidden_layers=4"):
        plan_pipeline(cfg, 2, costs=[1, 1, 1], env={})


def test_minimax_beats_the_most_even_split():
    # The split with the smallest sum of squares (4,9 | 3,5 | 3,2: stages 13, 8, 5) is not minimax:
    # 4 | 9,3 | 5,3,2 has a largest stage of 12.
    p = plan_pipeline({"num_hidden_layers": 6}, 3, costs=[4, 9, 3, 5, 3, 2], env={})
    assert p.max_stage_cost == 12.0 and p.partition == (1, 2, 3)


def test_plan_is_a_pure_function(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(V41_FLASH))
    assert plan_pipeline(tmp_path, 4, env={}) == plan(4) == plan_pipeline(sharing_graph(V41_FLASH), 4, env={})


def test_local_allocation_lists_only_local_layers():
    p = plan(4)
    allocs = [local_allocation(p, s) for s in range(4)]
    assert [a.kv_cache_layers for a in allocs] == [(2,), (8,), (14,), (20,)]
    assert [a.index_cache_layers for a in allocs] == [(2,), (8,), (14,), (20, 24, 28, 32, 36)]
    assert [a.candidate_buffer_layers for a in allocs] == [(), (), (), (20,)]
    assert [a.engram_layers for a in allocs] == [(1,), (), (14,), ()]
    assert [a.needs_token_ids for a in allocs] == [True, False, True, False]
    assert allocs[0].window_cache_layers == tuple(range(8))
    assert allocs[3].kv_source[39] == 20 and 0 not in allocs[0].kv_source  # layer 0 has no compressed KV
    for a in allocs:
        assert set(a.kv_source.values()) <= set(a.layers)
    with pytest.raises(ValueError, match=r"stage=4: out of range \[0, 4\)"):
        local_allocation(p, 4)


def test_local_allocation_refuses_a_plan_built_around_the_checks():
    good = plan(4)
    bad = dataclasses.replace(good, partition=(10, 10, 10, 10),
                              stages=tuple(Stage(i, 10 * i, 10 * i + 10, 10.0) for i in range(4)))
    assert local_allocation(bad, 0).kv_cache_layers == (2, 8)
    with pytest.raises(NotImplementedError, match=r"stage 1: kv source layer 8 \(stage 0\) -> layer 10 \(stage 1\)"):
        local_allocation(bad, 1)


def test_local_allocation_for_our_decoder():
    cfg = {"num_hidden_layers": 6, "kv_source_layer_ids": [0, 3], "engram_layer_ids": [4]}
    p = plan_pipeline(cfg, 2, env={})
    assert p.partition == (3, 3)
    a0, a1 = local_allocation(p, 0), local_allocation(p, 1)
    assert (a0.kv_cache_layers, a1.kv_cache_layers) == ((0,), (3,))
    assert a0.window_cache_layers == () and a0.index_cache_layers == ()
    assert (a0.needs_token_ids, a1.needs_token_ids) == (False, True)
    no_sharing = local_allocation(plan_pipeline({"num_hidden_layers": 4}, 2, env={}), 1)
    assert no_sharing.kv_cache_layers == (2, 3)


# ------------------------------------------------------------------- brute force over random configs
@st.composite
def random_configs(draw):
    n = draw(st.integers(1, 11))
    ratios = draw(st.lists(st.sampled_from([0, 1, 4]), min_size=n, max_size=n))
    compressed = [i for i in range(n) if ratios[i]]
    cfg = {"num_hidden_layers": n, "compress_ratios": ratios}
    if compressed and draw(st.booleans()):
        rest = compressed[1:]
        kv = sorted({compressed[0], *draw(st.lists(st.sampled_from(rest), max_size=4) if rest else st.just([]))})
        extra = draw(st.lists(st.sampled_from(rest), max_size=4) if rest else st.just([]))
        index = sorted(set(kv) | set(extra))
        cand = draw(st.sampled_from([-1, *index]))
        cfg.update(kv_source_layer_ids=kv, index_source_layer_ids=index, candidate_source_layer_id=cand,
                   candidate_topk_blocks=draw(st.sampled_from([0, 2048])))
    cfg["engram_layer_ids"] = draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True))
    costs = draw(st.none() | st.lists(st.integers(1, 9), min_size=n, max_size=n))
    return cfg, costs


def naive_sources(cfg, layer):
    """Every layer whose state ``layer`` reads, straight from the raw fields (no graph code)."""
    ratios, out = cfg["compress_ratios"], set()
    if not ratios[layer] or "kv_source_layer_ids" not in cfg:
        return out
    kv, index = cfg["kv_source_layer_ids"], cfg["index_source_layer_ids"]
    out.add(max(s for s in kv if s <= layer))
    out.add(max(s for s in index if s <= layer))
    if layer in index and layer not in kv:
        out.add(max(s for s in kv if s < layer))
    if layer in index and 0 <= cfg["candidate_source_layer_id"] < layer and cfg["candidate_topk_blocks"] > 0:
        out.add(cfg["candidate_source_layer_id"])
    return out - {layer}


@settings(max_examples=150, deadline=None)
@given(random_configs(), st.integers(1, 5))
def test_planner_is_minimax_optimal_against_brute_force(case, pp):
    cfg, costs = case
    n = cfg["num_hidden_layers"]
    if pp > n:
        return
    per_layer = layer_costs(sharing_graph(cfg), costs)

    def legal(cuts):  # no layer may be on a different stage than a layer it reads
        stage = [sum(c <= i for c in cuts) for i in range(n)]
        return all(stage[s] == stage[c] for c in range(n) for s in naive_sources(cfg, c))

    def worst(cuts):
        bounds = [0, *cuts, n]
        return max(sum(per_layer[a:b]) for a, b in zip(bounds, bounds[1:]))

    feasible = [worst(c) for c in itertools.combinations(range(1, n), pp - 1) if legal(c)]
    if not feasible:
        with pytest.raises(NotImplementedError, match=r"suggested partition: "):
            plan_pipeline(cfg, pp, costs=costs, env={})
        return
    p = plan_pipeline(cfg, pp, costs=costs, env={})
    cuts = tuple(itertools.accumulate(p.partition))[:-1]
    assert legal(cuts)
    assert p.max_stage_cost == worst(cuts) == min(feasible)
    assert p.partition == best_partition(sharing_graph(cfg), pp, per_layer)
