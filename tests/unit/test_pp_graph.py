"""Sharing graph of engram.parallel.pp_graph: edges from DeepSeek-V4.1 and our decoder's configs, and every
config error named by its field."""
import json

import pytest

from engram.parallel.pp_graph import SharingEdge, sharing_graph
from tests.pp_configs import V41_FLASH as V41_FLASH_BASE

V41_FLASH = {**V41_FLASH_BASE, "compress_ratios": V41_FLASH_BASE["compress_ratios"] + [1]}  # + the MTP layer's ratio


def v41(**changes):
    return {**V41_FLASH, **changes}


def pairs(graph, kind):
    return [(e.source, e.consumer) for e in graph.edges_by_kind()[kind]]


def test_v41_flash_edges_by_kind():
    g = sharing_graph(V41_FLASH)
    kv_src = [2, 8, 14, 20]
    expect_kv = [(max(s for s in kv_src if s <= c), c) for c in range(2, 40) if c not in kv_src]
    assert pairs(g, "kv") == expect_kv
    idx_src = [2, 8, 14, 20, 24, 28, 32, 36]
    expect_index = [(max(s for s in idx_src if s <= c), c) for c in range(2, 40) if c not in idx_src]
    assert pairs(g, "index") == expect_index
    assert pairs(g, "index_k") == [(20, 24), (20, 28), (20, 32), (20, 36)]
    assert pairs(g, "candidate") == [(20, 24), (20, 28), (20, 32), (20, 36)]
    assert not [e for e in g.edges if e.source < 2 or e.consumer < 2]  # sliding-window-only layers 0, 1
    assert g.engram_layers == (1, 14)
    assert g.compress_ratios == tuple([0, 0] + [2] * 18 + [1] * 20)  # the MTP entry is dropped
    assert g.legal_cut_points() == [1, 2, 8, 14, 20]


def test_edges_are_sorted_and_cross_only_between_source_and_consumer():
    g = sharing_graph(V41_FLASH)
    assert list(g.edges) == sorted(g.edges, key=SharingEdge.sort_key)
    e = SharingEdge("kv", 8, 10)
    assert [p for p in range(0, 12) if e.crosses(p)] == [9, 10]


def test_candidate_edges_need_a_source_and_blocks():
    assert pairs(sharing_graph(v41(candidate_topk_blocks=0)), "candidate") == []
    assert pairs(sharing_graph(v41(candidate_source_layer_id=-1)), "candidate") == []
    assert pairs(sharing_graph(v41(candidate_source_layer_id=None, candidate_topk_blocks=None)), "candidate") == []
    assert pairs(sharing_graph(v41(candidate_source_layer_id=28)), "candidate") == [(28, 32), (28, 36)]


def test_index_k_only_for_index_sources_that_are_not_kv_sources():
    g = sharing_graph(v41(kv_source_layer_ids=[2, 8, 14, 20, 28]))
    assert pairs(g, "index_k") == [(20, 24), (28, 32), (28, 36)]


def test_our_decoder_kv_sharing_every_layer_reads_nearest_earlier_source():
    g = sharing_graph({"num_hidden_layers": 6, "kv_source_layer_ids": [0, 3], "engram_layer_ids": [1, 4]})
    assert not g.v41
    assert pairs(g, "kv") == [(0, 1), (0, 2), (3, 4), (3, 5)]
    assert g.legal_cut_points() == [3]
    assert g.kv_source_of(5) == 3 and g.kv_source_of(3) == 3


def test_no_sharing_fields_means_every_cut_is_legal_and_engram_never_blocks():
    g = sharing_graph({"num_hidden_layers": 5, "engram_layer_ids": [1, 3]})
    assert g.edges == ()
    assert g.legal_cut_points() == [1, 2, 3, 4]


def test_config_read_from_file_directory_and_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x", "text_config": V41_FLASH}))
    from_dir = sharing_graph(tmp_path)
    from_file = sharing_graph(tmp_path / "config.json")
    assert from_dir == from_file == sharing_graph(V41_FLASH)


def test_bad_json_names_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{\"num_hidden_layers\": 4,")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON at line 1"):
        sharing_graph(p)


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": None}, r"'num_hidden_layers' is required"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers=0: must be an int >= 1"),
    ({"compress_ratios": [0, 0] + [2] * 18 + [1] * 19}, r"compress_ratios=.*has 39 entries but num_hidden_layers=40"),
    ({"compress_ratios": [0, -1] + [2] * 38}, r"compress_ratios=.*ints >= 0"),
    ({"kv_source_layer_ids": [2, "8", 14, 20]}, r"kv_source_layer_ids=.*entry '8' is not an int"),
    ({"kv_source_layer_ids": [2, 8.0, 14, 20]}, r"kv_source_layer_ids=.*entry 8.0 is not an int"),
    ({"index_source_layer_ids": [2, True, 14]}, r"index_source_layer_ids=.*entry True is not an int"),
    ({"kv_source_layer_ids": 2}, r"kv_source_layer_ids=2: must be a list"),
    ({"kv_source_layer_ids": [2, 14, 8, 20]}, r"kv_source_layer_ids=\[2, 14, 8, 20\]: must be sorted ascending"),
    ({"index_source_layer_ids": [2, 8, 8, 14, 20]}, r"index_source_layer_ids=.*layer 8 is listed more than once"),
    ({"kv_source_layer_ids": [2, 8, 14, 20, 40]}, r"kv_source_layer_ids=.*layer 40 is out of range \[0, 40\)"),
    ({"index_source_layer_ids": [-1, 2, 8, 14, 20]}, r"index_source_layer_ids=.*layer -1 is out of range"),
    ({"kv_source_layer_ids": [1, 2, 8, 14, 20]},
     r"kv_source_layer_ids=.*layer 1 is uncompressed \(compress_ratios\[1\]=0\)"),
    ({"kv_source_layer_ids": [2, 8, 14, 20, 22]},
     r"kv_source_layer_ids=.*kv source layer 22 is not an index source \(index_source_layer_ids="),
    ({"kv_source_layer_ids": [8, 14, 20], "index_source_layer_ids": [8, 14, 20]},
     r"kv_source_layer_ids=\[8, 14, 20\]: layer 2 has no preceding kv source"),
    ({"index_source_layer_ids": [8, 14, 20], "kv_source_layer_ids": None},
     r"index_source_layer_ids=\[8, 14, 20\]: layer 2 has no preceding index source"),
    ({"candidate_source_layer_id": 21}, r"candidate_source_layer_id=21: is not an index source"),
    ({"candidate_source_layer_id": 40}, r"candidate_source_layer_id=40: is out of range"),
    ({"candidate_source_layer_id": -2}, r"candidate_source_layer_id=-2: must be an int layer id, or -1"),
    ({"candidate_source_layer_id": 20, "index_source_layer_ids": None, "kv_source_layer_ids": None},
     r"candidate_source_layer_id=20: is not an index source \(index_source_layer_ids=None\)"),
    ({"candidate_topk_blocks": -5}, r"candidate_topk_blocks=-5: must be an int >= 0"),
    ({"engram_layer_ids": [1, 40]}, r"engram_layer_ids=.*layer 40 is out of range"),
])
def test_config_errors_name_the_field(changes, match):
    cfg = {k: v for k, v in v41(**changes).items() if not (k == "num_hidden_layers" and v is None)}
    with pytest.raises(ValueError, match=match):
        sharing_graph(cfg)


def test_our_decoder_first_layer_must_be_a_source():
    with pytest.raises(ValueError, match=r"kv_source_layer_ids=\[2\]: layer 0 has no preceding kv source$"):
        sharing_graph({"num_hidden_layers": 4, "kv_source_layer_ids": [2]})
