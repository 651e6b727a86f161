"""Scheduler + block manager: token budget, chunked prefill, max_num_seqs, preemption by recompute."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import engram
from engram.engine.block_manager import BlockManager
from engram.engine.config import EngineConfig
from engram.engine.detokenizer import IncrementalDetokenizer
from engram.engine.sampling_params import SamplingParams
from engram.engine.scheduler import Scheduler
from engram.engine.sequence import Sequence, SequenceStatus

TOKENIZER = Tokenizer.from_file(str(Path(engram.__file__).parent / "model" / "assets" / "tokenizer.json"))


def make_seq(i: int, prompt_len: int) -> Sequence:
    ids = [(7 * i + j) % 200 + 10 for j in range(prompt_len)]
    lookback = torch.full((2,), 5, dtype=torch.long)
    return Sequence(i, f"r{i}", None, ids, ids, SamplingParams(max_tokens=1000),
                    IncrementalDetokenizer(TOKENIZER, ids, []), lookback)


def advance(batch) -> None:
    """What the engine's postprocess does to the scheduler-visible state."""
    for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.samples()):
        seq.num_computed_tokens += n
        if sample:
            seq.append_token(11, 11)


def make(num_blocks=64, block_size=4, **kw) -> Scheduler:
    return Scheduler(EngineConfig(block_size=block_size, **kw), BlockManager(num_blocks, block_size))


def test_chunked_prefill_respects_token_budget_and_samples_only_at_the_end():
    sched = make(max_num_batched_tokens=32, max_num_seqs=4)
    seq = make_seq(0, 100)
    sched.add(seq)
    chunks, samples = [], []
    for _ in range(5):
        b = sched.schedule()
        chunks.append(b.num_new_tokens[0])
        samples.append(b.samples()[0])
        assert b.start_positions[0] == seq.num_computed_tokens
        advance(b)
    assert chunks == [32, 32, 32, 4, 1]
    assert samples == [False, False, False, True, True]
    assert len(seq.block_table) == -(-seq.num_computed_tokens // 4)


def test_budget_is_shared_decodes_first_then_new_prompts_chunked():
    sched = make(max_num_batched_tokens=10, max_num_seqs=8)
    a, b = make_seq(0, 3), make_seq(1, 30)
    sched.add(a)
    advance(sched.schedule())  # a prefilled, now decoding
    sched.add(b)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["r0", "r1"]
    assert batch.num_new_tokens == [1, 9]
    assert batch.num_tokens == 10


def test_max_num_seqs_caps_admission():
    sched = make(max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(5):
        sched.add(make_seq(i, 3))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["r0", "r1"]
    assert len(sched.waiting) == 3
    advance(batch)
    assert len(sched.schedule().seqs) == 2


def test_preemption_takes_newest_frees_blocks_and_resets_state():
    # 6 blocks of 4 tokens; two sequences of 8-token prompts hold 2 blocks each, then grow.
    sched = make(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    a, b = make_seq(0, 8), make_seq(1, 8)
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())  # both prefilled: 2 blocks each, 2 free
    advance(sched.schedule())  # tokens 8: 3 blocks each, 0 free
    assert sched.blocks.num_free_blocks == 0
    for _ in range(3):
        advance(sched.schedule())  # positions 9..11 still fit block 3
    batch = sched.schedule()  # position 12 needs a 4th block for a -> b preempted
    assert batch.preempted == [b]
    assert [s.request_id for s in batch.seqs] == ["r0"]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.lookback_before(0) == [5, 5] and b.lookback_before(1) == [5, b.compressed_ids[0]]  # from the tokens
    assert b.metrics.num_preemptions == 1
    assert sched.waiting[0] is b
    assert sched.blocks.num_free_blocks == 6 - len(a.block_table)
    advance(batch)
    # b comes back once a finishes; it recomputes prompt + the tokens it had generated
    sched.finish(a)
    batch = sched.schedule()
    assert batch.seqs == [b] and batch.num_new_tokens == [b.num_tokens] and batch.start_positions == [0]


def test_no_admission_in_a_step_that_preempted():
    # A 5-token budget: after a's decode, b's first recompute chunk (4 tokens) fits the block b's own
    # preemption freed, so only the rule keeps b (and c behind it) out of the step that preempted it.
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=5, max_num_seqs=4)
    a, b, c = make_seq(0, 4), make_seq(1, 4), make_seq(2, 1)
    sched.add(a)
    sched.add(b)
    for step in range(5):  # a prefills, b's prompt is chunked behind it, then both decode
        if step == 3:
            sched.add(c)  # arrives once every block is held: it waits
        batch = sched.schedule()
        assert not batch.preempted and c not in batch.seqs
        advance(batch)
    assert sched.blocks.num_free_blocks == 0 and len(a.block_table) == len(b.block_table) == 2
    batch = sched.schedule()  # a needs a 3rd block -> b preempted
    assert batch.preempted == [b] and batch.seqs == [a] and batch.num_new_tokens == [1]
    assert sched.blocks.can_allocate(b, min(b.num_uncomputed_tokens, 5 - 1))  # b's next chunk would fit
    assert list(sched.waiting) == [b, c]


def test_sequence_preempting_itself_when_alone_cannot_happen_with_enough_blocks():
    sched = make(num_blocks=3, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    seq = make_seq(0, 10)
    sched.add(seq)
    for _ in range(2):
        batch = sched.schedule()
        assert not batch.preempted
        advance(batch)
    assert seq.num_computed_tokens == 11 and len(seq.block_table) == 3


def test_finish_returns_blocks():
    sched = make(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    seq = make_seq(0, 9)
    sched.add(seq)
    advance(sched.schedule())
    assert sched.blocks.num_free_blocks == 5
    sched.finish(seq)
    assert sched.blocks.num_free_blocks == 8 and not sched.has_unfinished()


def test_block_manager_allocates_only_missing_blocks_and_refuses_overdraw():
    bm = BlockManager(4, 4)
    seq = make_seq(0, 5)
    assert bm.blocks_needed(seq, 5) == 2
    bm.allocate(seq, 5)
    seq.num_computed_tokens = 5
    assert bm.blocks_needed(seq, 3) == 0 and bm.blocks_needed(seq, 4) == 1
    with pytest.raises(RuntimeError, match="needs 3 KV blocks, 2 are free"):
        bm.allocate(seq, 12)


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("block_size", 0), ("max_model_len", 0),
                                         ("kv_cache_memory", -1), ("num_kv_blocks", 0)])
def test_engine_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"engine.{field}={value}"):
        EngineConfig(**{field: value})


def test_engine_config_budget_must_cover_one_decode_per_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineConfig.from_options({"max_num_seq": 3})
