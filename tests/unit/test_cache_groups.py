"""DeepSeek-V4's cache groups without an engine: the layout's page rule and fields, the group block manager's pages
(taken when scheduled, sliding pages given back behind the window only by a collected step, all of them at free), and
the Worker's pool: a chain of packed steps through the pool gives the caches and logits of the same steps carried
per sequence, bitwise; a state page holding another position is refused."""
from __future__ import annotations

import pytest
import torch

from engram.engine.cache_groups import NO_PAGE, GroupBlockManager
from engram.engine.runners.group_pool import GroupPool
from engram.model.deepseek_v4.cache_layout import ALIGN, cache_layout
from engram.model.deepseek_v4.config import V4Config
from engram.model.deepseek_v4.decoder import DeepseekV4Model, pack_sequences
from tests.parity.deepseek_v4_fixtures import SHAPE, pool_step
from tests.unit.test_scheduler import make_seq

CFG = V4Config.from_hf_dict(dict(SHAPE, model_type="deepseek_v4"))  # W 32, CSA 4 (layers 1, 3), HCA 16 (layer 2)


def test_layout_pages_and_fields():
    lay = cache_layout(CFG, torch.float64, 16)
    assert lay.page_bytes == 16 * 4 * 32 * 8  # block_size tokens of every layer's keys
    names = [g.name for g in lay.groups]
    assert names == ["sliding", "csa", "hca", "state"]
    csa, hca, state = lay.group("csa"), lay.group("hca"), lay.group("state")
    assert csa.layers == (1, 3) and csa.rows_per_page == lay.page_bytes // (2 * (32 + 16) * 8)  # 21 entries
    assert hca.layers == (2,) and hca.rows_per_page == 64 and hca.tokens_per_row == 16
    for g in lay.groups:  # fields inside the page, aligned, never overlapping
        spans = sorted((f.page, f.offset, f.offset + f.nbytes) for f in g.fields)
        assert all(s[1] % ALIGN == 0 and s[2] <= lay.page_bytes for s in spans)
        assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))
    assert state.field(2, "compressor.buffer_kv").shape == (15, 32)  # ratio - 1 unclosed tokens
    assert state.field(1, "indexer.overlap_gate").shape == (4, 16)
    assert state.field(1, "compressor.buffer_gate").dtype == torch.float64  # the work dtype of float64
    assert cache_layout(CFG, torch.bfloat16, 16).group("state").field(1, "compressor.buffer_gate").dtype == \
        torch.float32
    with pytest.raises(ValueError, match="block_size is too small .* layer 1's compressor.buffer_kv takes 1536 bytes"):
        cache_layout(CFG, torch.float64, 1)


def test_a_stage_gets_the_groups_of_its_layers_only():
    assert [g.name for g in cache_layout(CFG, torch.bfloat16, 16, layers=[0]).groups] == ["sliding"]
    two = cache_layout(CFG, torch.bfloat16, 16, layers=[2, 3])
    assert [(g.name, g.layers) for g in two.groups] == [("sliding", (2, 3)), ("csa", (3,)), ("hca", (2,)),
                                                        ("state", (2, 3))]
    with pytest.raises(ValueError, match=r"layers=\[4\]"):
        cache_layout(CFG, torch.bfloat16, 16, layers=[4])


def test_pages_taken_when_scheduled_and_given_back():
    lay = cache_layout(CFG, torch.float64, 8)
    bm = GroupBlockManager(100, lay)
    seq = make_seq(0, 300)
    bm.allocate(seq, 100)  # keeps positions 69..99 -> sliding blocks 8..12; entries 25 (csa), 6 (hca)
    assert bm.held(seq) == {"sliding": 5, "csa": -(-25 // lay.group("csa").rows_per_page), "hca": 1,
                            "state": lay.group("state").pages_per_sequence}
    assert seq.block_table[:8] == [NO_PAGE] * 8 and len(seq.block_table) == 13
    seq.num_computed_tokens = 100
    bm.allocate(seq, 1)  # the next token's block is the same: nothing new
    assert bm.held(seq)["sliding"] == 5
    bm.commit(seq, 101)  # window 70..100: block 8 (64..71) is still in it
    assert bm.held(seq)["sliding"] == 5
    seq.num_computed_tokens = 101
    bm.allocate(seq, 30)  # keeps 100..130
    before = bm.held(seq)["sliding"]
    bm.commit(seq, 131)  # window 100..130: blocks 8..11 (64..95) left it
    assert bm.held(seq)["sliding"] == before - 4
    used = sum(g["blocks"] for g in bm.group_stats().values())
    assert used == sum(bm.held(seq).values()) == 100 - bm.num_free_blocks
    bm.free(seq)
    assert bm.num_free_blocks == 100 and all(g["blocks"] == 0 for g in bm.group_stats().values())
    tiny = GroupBlockManager(3, lay)
    assert not tiny.can_allocate(make_seq(1, 50), 50)
    with pytest.raises(RuntimeError, match="needs .* cache-group pages, 3 are free"):
        tiny.allocate(make_seq(1, 50), 50)


@torch.no_grad()
def test_the_pool_gives_the_caches_carried_per_sequence_bitwise():
    torch.manual_seed(0)
    model = DeepseekV4Model(CFG).double()
    lay = cache_layout(CFG, torch.float64, 8)
    bm = GroupBlockManager(200, lay)
    pool = GroupPool(CFG, lay, 200, torch.float64, "cpu")
    seqs = [make_seq(i, 400) for i in range(3)]
    tokens = [torch.randint(3, CFG.vocab_size, (400,)).tolist() for _ in seqs]
    carried = [model.empty_cache() for _ in seqs]
    chunks = [[97, 5, 1, 30, 7, 1, 1, 60], [1, 1, 40, 3, 100, 16, 1, 9], [37, 37, 37, 1, 1, 1, 2, 64]]
    for k in range(len(chunks[0])):
        starts, ns = [s.num_computed_tokens for s in seqs], [c[k] for c in chunks]
        for seq, n in zip(seqs, ns):
            bm.allocate(seq, n)
        step = pool_step(k, seqs, starts, ns, bm.group_tables(seqs))
        gathered = pool.gather(step, model.empty_cache)
        for got, want in zip(gathered, carried):
            assert got.position == want.position
            for a, b in zip(got.layers, want.layers):
                _same(a.window, b.window)
                for x, y in ((a.compressor, b.compressor), (a.indexer, b.indexer)):
                    assert (x is None) == (y is None)
                    if x is not None:
                        for f in ("buffer_kv", "buffer_gate", "entries", "overlap_kv", "overlap_gate"):
                            _same(getattr(x, f), getattr(y, f))
        inputs = pack_sequences([t[s:s + n] for t, s, n in zip(tokens, starts, ns)], starts)
        hidden_pool, after = model(inputs, gathered)
        hidden_carried, carried = model(inputs, carried)
        _same(hidden_pool, hidden_carried)
        pool.write(step, after)
        for seq, n in zip(seqs, ns):
            seq.num_computed_tokens += n
            bm.commit(seq, seq.num_computed_tokens)
    assert [s.num_computed_tokens for s in seqs] == [202, 171, 180]  # past windows, HCA closes and several entry pages


def _same(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_state_page_holding_another_position_is_refused():
    model = DeepseekV4Model(CFG).double()
    lay = cache_layout(CFG, torch.float64, 8)
    bm, pool = GroupBlockManager(50, lay), GroupPool(CFG, lay, 50, torch.float64, "cpu")
    seq = make_seq(0, 40)
    bm.allocate(seq, 10)
    step = pool_step(0, [seq], [0], [10], bm.group_tables([seq]))
    with torch.no_grad():
        _, after = model(pack_sequences([list(range(3, 13))], [0]), pool.gather(step, model.empty_cache))
    pool.write(step, after)
    seq.num_computed_tokens = 10
    bm.allocate(seq, 1)
    assert pool.gather(pool_step(1, [seq], [10], [1], bm.group_tables([seq])), model.empty_cache)[0].position == 10
    with pytest.raises(RuntimeError, match="continues it at position 11 but its state pages hold position 10"):
        pool.gather(pool_step(2, [seq], [11], [1], bm.group_tables([seq])), model.empty_cache)
