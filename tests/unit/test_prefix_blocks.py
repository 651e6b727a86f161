"""The prefix cache's pieces: the block-key chain, the block manager's reference counts, registration, LRU eviction,
lookup limits and reset; the conv pool's tail rows and the history it rebuilds (block_size above and below L = 9)."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from engram.commands.options import add_engine_arguments, engine_options
from engram.config import EngramConfig
from engram.engine.block_manager import BlockManager
from engram.engine.config import EngineConfig
from engram.engine.prefix_cache import block_key, extend_keys
from engram.engine.runners.conv_blocks import ConvBlockStore
from tests.unit.test_scheduler import make_seq

ROOT = b"r" * 16


def seq_of(i: int, tokens: list[int]):
    seq = make_seq(i, len(tokens))
    seq.token_ids = list(tokens)
    return seq


def run_prompt(bm: BlockManager, seq) -> list[int]:
    """Admit ``seq`` with its cached prefix, compute the rest, commit it as a collected step would -> its hits."""
    hits = bm.lookup(seq)
    n = seq.num_scheduled_tokens - len(hits) * bm.block_size
    assert bm.can_admit(seq, hits, n)
    bm.admit(seq, hits, n)
    seq.num_computed_tokens += n
    bm.commit(seq, seq.num_computed_tokens)
    return hits


def test_keys_chain_on_the_parent_and_the_tokens():
    a = extend_keys([], list(range(12)), 4, ROOT)
    assert len(a) == 3 and a[1] == block_key(a[0], [4, 5, 6, 7])
    assert extend_keys([], list(range(12)), 4, b"x" * 16)[0] != a[0]  # another model or table: other keys
    b = extend_keys([], [0, 1, 2, 99] + list(range(4, 12)), 4, ROOT)
    assert b[1:] != a[1:]  # a different earlier block changes every later key


def test_shared_prefix_is_reused_and_reference_counted():
    bm = BlockManager(16, 4, ROOT)
    a = seq_of(0, list(range(10)))  # blocks [0..3] [4..7] and a partial one
    assert run_prompt(bm, a) == []
    b = seq_of(1, list(range(8)) + [50, 51, 52])
    hits = run_prompt(bm, b)
    assert hits == a.block_table[:2] and b.num_cached_tokens == 8 and b.block_table[:2] == hits
    assert bm.num_free_blocks == 16 - 3 - 1
    bm.free(a)
    assert bm.num_free_blocks == 16 - 3  # the shared blocks are still b's
    bm.free(b)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2
    s = bm.stats.snapshot(bm.num_cached_blocks)
    assert (s["queries"], s["queried_blocks"], s["hit_blocks"], s["hit_tokens"]) == (2, 4, 2, 8)


def test_the_last_token_is_always_computed():
    bm = BlockManager(16, 4, ROOT)
    run_prompt(bm, seq_of(0, list(range(8))))
    again = seq_of(1, list(range(8)))
    assert len(bm.lookup(again)) == 1  # 8 tokens: at most 7 cached, so one block


def test_lru_evicts_the_block_freed_longest_ago_tail_first():
    bm = BlockManager(4, 4, ROOT)
    a = seq_of(0, list(range(9)))  # blocks 0, 1 (full, registered) and 2 (partial); block 3 never used
    run_prompt(bm, a)
    assert a.block_table == [0, 1, 2]
    bm.free(a)  # freed last-first: the free list is now 3, 2, 1, 0
    c = seq_of(1, list(range(100, 109)))  # 3 blocks: 3, the unregistered 2, then the prefix's tail block 1
    run_prompt(bm, c)
    assert c.block_table == [3, 2, 1]
    assert bm.lookup(seq_of(2, list(range(9)))) == [0]  # the head of the prefix survived its tail


def test_duplicate_blocks_keep_the_first_registration_and_reset_forgets():
    bm = BlockManager(16, 4, ROOT)
    a, b = seq_of(0, list(range(9))), seq_of(1, list(range(9)))
    for s in (a, b):  # admitted together: neither finds the other's blocks
        bm.admit(s, [], 9)
        s.num_computed_tokens = 9
    bm.commit(a, 9)
    bm.commit(b, 9)
    assert bm.num_cached_blocks == 2 and bm.lookup(seq_of(2, list(range(9)))) == a.block_table[:2]
    assert bm.reset() == 2 and bm.lookup(seq_of(3, list(range(9)))) == []
    bm.commit(a, 9)  # blocks computed before the reset are not offered again
    assert bm.num_cached_blocks == 0


def test_can_admit_counts_idle_hits_against_the_free_list():
    bm = BlockManager(3, 4, ROOT)
    a = seq_of(0, list(range(9)))
    run_prompt(bm, a)
    bm.free(a)
    b = seq_of(1, list(range(8)) + [1, 2, 3, 4, 5])  # 13 tokens: 2 cached blocks + 5 tokens = 2 more blocks
    hits = bm.lookup(b)
    assert len(hits) == 2 and not bm.can_admit(b, hits, 5) and bm.can_admit(b, hits, 4)


def test_off_registers_nothing():
    bm = BlockManager(8, 4, None)
    a = seq_of(0, list(range(9)))
    run_prompt(bm, a)
    assert bm.num_cached_blocks == 0 and bm.lookup(seq_of(1, list(range(9)))) == []
    assert bm.stats.snapshot(0)["queries"] == 0


def test_cli_flag_reaches_the_engine_config():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert EngineConfig(**engine_options(p.parse_args([]))).enable_prefix_caching is True
    assert EngineConfig(**engine_options(p.parse_args(["--no-enable-prefix-caching"]))).enable_prefix_caching is False
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes")


@pytest.mark.parametrize("block_size", [4, 16])  # rows a block keeps: min(9, block_size)
def test_conv_pool_history_is_the_inputs_of_the_nine_positions_before_the_start(block_size):
    ecfg = EngramConfig.preset("tiny").replace(variant="paper", row_dtype="fp32")
    store = ConvBlockStore(ecfg, 12, block_size, torch.float64, torch.device("cpu"))
    table = np.array([7, 2, 9, 4, 11, 0, 5, 3, 1, 6, 8], dtype=np.int64)
    positions = np.arange(40)
    slots = torch.from_numpy(table[positions // block_size] * block_size + positions % block_size)
    channels = ecfg.hc_mult * ecfg.hidden_size
    inputs = torch.arange(40, dtype=torch.float64)[:, None].expand(40, channels) + 1  # input of position p: p + 1
    rows, dest = store.tail(slots)
    for lid in ecfg.layer_ids:
        store.write(lid, inputs[rows], dest)
    for start in range(block_size, 40, block_size):
        state = store.history(torch.from_numpy(table), start)[ecfg.layer_ids[0]].conv[0]  # [9, C]
        want = [float(q + 1) if q >= 0 else 0.0 for q in range(start - 9, start)]
        assert state[:, 0].tolist() == want
    with pytest.raises(RuntimeError, match="block boundary"):
        store.history(torch.from_numpy(table), block_size + 1)


def test_deepseek_v4_refuses_prefix_caching_with_a_log_line(caplog):
    import logging
    from types import SimpleNamespace

    from engram.engine.engine import _prefix_cache_root

    v4 = SimpleNamespace(model_config=SimpleNamespace(architecture="deepseek_v4"))
    with caplog.at_level(logging.INFO, logger="engram.engine.engine"):
        assert _prefix_cache_root(v4, EngineConfig()) is None
    assert "prefix caching is off" in caplog.text and "deepseek_v4" in caplog.text
    assert _prefix_cache_root(v4, EngineConfig(enable_prefix_caching=False)) is None
