"""Data-parallel replicas on one GPU (skipped without CUDA): LLM(data_parallel_size=2) on the host tier starts the
replicas in turn, each profiling its KV cache into half of gpu_memory_utilization; both map (and cudaHostRegister)
one shared copy of every table, so the node's table memory (the Pss of the segments' mappings over the test's process
tree, engram/bench/node_memory.py) is at most 1.1 x one copy while each replica has every page mapped; and a request
alone in a replica gets the tokens it gets alone in one engine (same batch, same kernels: float32 tokens equal)."""
from __future__ import annotations

import gc
import os

import pytest
import torch

import engram
from engram.bench.node_memory import node_memory, segment_sizes, summary_line

pytestmark = [pytest.mark.whole_gpu, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["hello world", "the tables are", "a b c d e f", "memory is cheap"]


def test_two_replicas_on_one_gpu_share_one_registered_copy_and_split_the_kv(shm_dir):
    config = {"table_rows": 2_000_000, "advanced": {"shm_dir": str(shm_dir)}}
    params = engram.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one = engram.LLM("4b-like", tier="host", dtype="float32", engram_config=config)
    alone = [one.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    one_blocks = one.engine.executor.num_kv_blocks
    del one
    gc.collect()  # the engine's objects form reference cycles: free its KV cache before the replicas profile
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < 2**30, torch.cuda.memory_reserved()
    llm = engram.LLM("4b-like", tier="host", dtype="float32", engram_config=config, data_parallel_size=2)
    try:
        eng = llm.engine
        blocks = [i.num_kv_blocks for i in eng.infos]
        assert abs(blocks[0] - blocks[1]) <= 0.1 * max(blocks), blocks  # each its half of the GPU
        assert sum(blocks) <= 1.1 * one_blocks, (blocks, one_blocks)
        for k in range(0, len(PROMPTS), 2):  # one request alone in each replica
            outs = llm.generate(PROMPTS[k:k + 2], params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == alone[k:k + 2]
        # the test's process tree (itself, the replicas, their helpers): the segments it maps are every one made here
        mem = node_memory(os.getpid(), shm_dir)
        copy = mem["one_copy_bytes"]
        assert copy == sum(segment_sizes(shm_dir).values()) > 0, mem
        rss = dict(zip(mem["pids"], mem["shared_tables_rss_bytes_per_process"]))
        print(summary_line(mem))
        assert mem["shared_tables_pss_bytes"] <= 1.1 * copy
        assert all(rss[pid] >= 0.9 * copy for pid in eng.pids)  # every replica reads every page of the one copy
    finally:
        llm.engine.close()
