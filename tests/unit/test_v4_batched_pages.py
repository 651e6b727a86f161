"""The batched DeepSeek-V4 decode step straight over the Worker's pool of cache-group pages
(engram/engine/runners/v4_batched_pages.py), float64 on the CPU: sequences prefilled by the eager path's pool moves
(``GroupPool.gather`` -> model -> ``GroupPool.write``, what ``SequenceCacheRunner`` does) into a pool whose every byte
starts as garbage, then copied into a second pool; N decode steps run eagerly on the first and pages -> BatchedCache ->
``decode_step`` -> pages on the second, with the same block tables from one ``GroupBlockManager`` (sliding pages given
back and taken again as windows move, a CSA entry page taken mid-decode). After every step the logits agree within 1e-10,
every page a running sequence holds is within 1e-10 of the eager pool's (batched and eager attention round differently),
the whole batched pool is bitwise what ``GroupPool.write`` makes of the batched step's own state (the write-back stores
exactly what the eager writer would, and nothing else), and the recorded state positions are equal.
CSA (ratio 4) and HCA (ratio 8) windows close on some steps for some sequences and not others. Mutations (the entry of
a window that did not close written back, the new key one page row late) make the pages differ."""
from __future__ import annotations

import pytest
import torch

from engram.engine.cache_groups import GroupBlockManager
from engram.engine.runners import v4_batched_pages
from engram.engine.runners.group_pool import GroupPool
from engram.engine.runners.v4_batched_pages import BatchedPages
from engram.model.deepseek_v4.cache_layout import cache_layout
from engram.model.deepseek_v4.config import V4Config
from engram.model.deepseek_v4.decoder import DeepseekV4Model, pack_sequences
from tests.parity.deepseek_v4_fixtures import SHAPE, pool_step, random_decoder
from tests.unit.test_scheduler import make_seq

CFG = V4Config.from_hf_dict(dict(SHAPE, model_type="deepseek_v4")).replace(hca_ratio=8)  # S, CSA 4, HCA 8, CSA
LENGTHS = (2, 9, 14, 28, 40, 61)  # 2: no entries yet; 28 fills the window (31 keys); 40 takes CSA entry page 1
STEPS, E_MAX, TOL, BLOCK = 6, 20, 1e-10, 8


@pytest.fixture(scope="module")
def model() -> DeepseekV4Model:
    return random_decoder(CFG)


def _eager_step(model, pool, bm, seqs, step_id, chunks):
    """One step of the eager path's pool moves; returns the final-normed hidden of each sequence's last token."""
    starts, ns = [s.num_computed_tokens for s in seqs], [len(c) for c in chunks]
    step = pool_step(step_id, seqs, starts, ns, bm.group_tables(seqs))
    hidden, after = model(pack_sequences(chunks, starts), pool.gather(step, model.empty_cache))
    pool.write(step, after)
    return hidden


def _setup(model, lengths):
    """(manager, eager pool, batched pool, sequences, decode tokens [STEPS, B]) after the prefill."""
    g = torch.Generator().manual_seed(3)
    lay = cache_layout(CFG, torch.float64, BLOCK)
    bm, pool = GroupBlockManager(160, lay), GroupPool(CFG, lay, 160, torch.float64, "cpu")
    pool.pages.view(torch.float64).copy_(torch.randn(pool.pages.view(torch.float64).shape, generator=g))
    seqs = [make_seq(i, 200) for i in range(len(lengths))]
    prompts = [torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    for k, part in enumerate((lambda p: p[:len(p) // 2 + 1], lambda p: p[len(p) // 2 + 1:])):  # two chunks
        todo = [(s, part(p)) for s, p in zip(seqs, prompts) if part(p)]
        for s, c in todo:
            bm.allocate(s, len(c))
        _eager_step(model, pool, bm, [s for s, _ in todo], k, [c for _, c in todo])
        for s, c in todo:
            s.num_computed_tokens += len(c)
            bm.commit(s, s.num_computed_tokens)
    batched = GroupPool(CFG, lay, 160, torch.float64, "cpu")
    batched.pages.copy_(pool.pages)
    for t in bm.group_tables(seqs)["state"][:, 0].tolist():
        batched.hold(t, pool.held_position(t))
    return bm, pool, batched, seqs, torch.randint(3, CFG.vocab_size, (STEPS, len(lengths)), generator=g)


def _run(model, lengths=LENGTHS):
    """(max logit gap over the steps, max gap of the pages in use to the eager pool's as float64, per step: whether
    the batched pool equals, bitwise and whole, the pool before the step written by ``GroupPool.write`` with the
    batched step's own state, and whether the recorded state positions equal the eager pool's)."""
    bm, eager, pool, seqs, tokens = _setup(model, lengths)
    pages, ropes = BatchedPages(model, pool, E_MAX), model.ropes("cpu")
    gap = page_gap = 0.0
    same = []
    for k in range(STEPS):
        for s in seqs:
            bm.allocate(s, 1)
        tables = bm.group_tables(seqs)
        positions = [s.num_computed_tokens for s in seqs]
        want = model.head(_eager_step(model, eager, bm, seqs, 10 + k, [[t] for t in tokens[k].tolist()]))
        written = GroupPool(CFG, pool.layout, pool.pages.shape[0], torch.float64, "cpu")
        written.pages.copy_(pool.pages)
        cache = pages.empty(len(seqs))
        got = model.head(pages.step(tokens[k], positions, tables, ropes=ropes, cache=cache))
        written.write(pool_step(10 + k, seqs, positions, [1] * len(seqs), tables), cache.to_caches(model))
        gap = max(gap, float((got - want).abs().max()))
        used = sorted({p for t in tables.values() for p in t.flatten().tolist() if p >= 0})
        a, b = eager.pages.view(torch.float64)[used], pool.pages.view(torch.float64)[used]
        page_gap = max(page_gap, float((a - b).abs().max()))
        firsts = tables["state"][:, 0].tolist()
        same.append([torch.equal(written.pages, pool.pages),
                     [eager.held_position(f) for f in firsts] == [pool.held_position(f) for f in firsts]])
        for s in seqs:
            s.num_computed_tokens += 1
            bm.commit(s, s.num_computed_tokens)
    return gap, page_gap, same


def test_the_lengths_cover_closing_and_open_windows():
    pos = torch.tensor(LENGTHS).unsqueeze(0) + torch.arange(STEPS).unsqueeze(1)  # [STEPS, B]
    for r in (CFG.csa_ratio, CFG.hca_ratio):
        closes = (pos + 1) % r == 0
        assert (closes.any(1) & ~closes.all(1)).sum() >= 2, f"ratio {r}"
    assert ((pos // CFG.csa_ratio) == 10).any()  # CSA entry 10: row 0 of a second entry page (10 a page here)
    assert cache_layout(CFG, torch.float64, BLOCK).group("csa").rows_per_page == 10
    assert (pos >= CFG.sliding_window - 1).any() and (pos < CFG.sliding_window - 1).any()


@torch.no_grad()
def test_pages_to_pages_equal_the_eager_steps(model):
    gap, page_gap, same = _run(model)
    assert gap <= TOL and page_gap <= TOL
    assert all(all(s) for s in same), same


@torch.no_grad()
def test_writing_the_entry_of_an_open_window_fails(model, monkeypatch):
    monkeypatch.setattr(v4_batched_pages, "closes", lambda position, ratio: True)
    _, page_gap, same = _run(model, (9, 14, 28, 61))  # each holds the entry page of its open windows' entry
    assert not all(s[0] for s in same) and page_gap > 1e-3


@torch.no_grad()
def test_the_new_key_one_row_late_fails(model, monkeypatch):
    monkeypatch.setattr(v4_batched_pages, "key_location", lambda table, p, bs: (table[p // bs], (p + 1) % bs))
    gap, page_gap, same = _run(model)
    assert not all(s[0] for s in same) and page_gap > 1e-3 and gap > 1e-3


@torch.no_grad()
def test_refusals_by_name(model):
    bm, _, pool, seqs, _ = _setup(model, LENGTHS)
    for s in seqs:
        bm.allocate(s, 1)
    tables, positions = bm.group_tables(seqs), [s.num_computed_tokens for s in seqs]
    with pytest.raises(ValueError, match=r"layer 1: sequence 5 has 15 compressed entries .*E_max=12"):
        BatchedPages(model, pool, 12).index(positions, tables)
    with pytest.raises(RuntimeError, match="sequence 2: .* position 15 but its state pages hold position 14"):
        BatchedPages(model, pool, E_MAX).index([p + (i == 2) for i, p in enumerate(positions)], tables)
