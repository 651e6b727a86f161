"""The model on CUDA: tiny agrees with the CPU run; 4b-like / 8b-like build and run prefill + decode in bf16.
Skipped without a GPU (run on the device machine)."""
from __future__ import annotations

import pytest
import torch

from engram.model.inputs import make_step_inputs
from engram.model.kv_cache import KVCache
from engram.model.loader import load_model
from tests.oracles.reference import StepRows, greedy_generate, hasher_for, prefill_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = "Return a new list containing all items from the iterable in ascending order."


def test_tiny_cuda_matches_cpu(tmp_path):
    cpu = load_model("tiny", tier="host", dtype="float32", device="cpu", cache_dir=tmp_path, progress=False)
    gpu = load_model("tiny", tier="gpu", dtype="float32", device="cuda", cache_dir=tmp_path, progress=False)
    ids = cpu.tokenizer.encode(PROMPT).ids
    torch.testing.assert_close(prefill_logits(gpu, ids).cpu(), prefill_logits(cpu, ids), rtol=0, atol=5e-4)


def _packed_step(loaded, seqs: list[list[int]], kv_blocks: list[list[int]], block_size: int):
    """Prefill of several sequences in one packed step (rows hashed and gathered per layer)."""
    dev = loaded.device
    hasher = hasher_for(loaded)
    comp = torch.cat([loaded.compressed_tokenizer.compress(torch.tensor(s), ()) for s in seqs]).long().to(dev)
    cu = torch.tensor([0] + [len(s) for s in seqs], device=dev).cumsum(0)
    rows = StepRows(loaded.open_tables(), hasher, comp, cu, hasher.initial_lookback(len(seqs), dev), loaded.dtype)
    return make_step_inputs(seqs, [0] * len(seqs), kv_blocks, block_size, rows, device=dev)


@pytest.mark.parametrize("name", ["4b-like", "8b-like"])
def test_large_presets_build_and_run(tmp_path, name):
    loaded = load_model(name, tier="gpu", dtype="bfloat16", device="cuda", engram_config={"table_rows": 1 << 16},
                        cache_dir=tmp_path, progress=False)
    cfg = loaded.model_config
    assert loaded.model.lm_head.weight.shape == (151936, cfg.hidden_size)
    a = loaded.tokenizer.encode(PROMPT).ids
    b = a[:9]
    kv = KVCache.for_model(cfg, 16, 16, torch.bfloat16, "cuda")
    hidden = loaded.model(_packed_step(loaded, [a, b], [[0, 1], [2]], 16), kv)
    logits = loaded.model.compute_logits(hidden)
    assert logits.shape == (2, cfg.vocab_size) and bool(torch.isfinite(logits).all())
    alone = prefill_logits(loaded, b)[-1]
    assert int(alone.argmax()) == int(logits[1].argmax()) or float(alone.topk(2).values.diff().abs()) < 0.5
    out = greedy_generate(loaded, a, 4, stop_at_eos=False)
    assert len(out) == 4 and all(0 <= t < cfg.vocab_size for t in out)
    del loaded, kv
    torch.cuda.empty_cache()
