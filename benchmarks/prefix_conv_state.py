"""The paper variant's ShortConv state at a prefix-cache hit: storing the conv inputs with each block (what the engine
does, engine/runners/conv_blocks.py) against re-running cached tokens to rebuild them (the alternative issue 51 names).

    python -m benchmarks.prefix_conv_state [--preset small] [--prefix 1040] [--suffix 32] [--repeat 5] [--threads 1]

Re-running needs 9 tokens per Engram layer (an Engram layer's conv inputs of a position depend on the earlier Engram
layers' conv outputs, which need the 9 positions before it): 18 for two layers. Its cost is timed as the same hit with
the last two cached blocks (32 >= 18 tokens) computed again; storing costs the conv pool's bytes per KV block and its
writes, timed as the cold request with the cache on against off. Prints a JSON object: memory per block for the
presets' layouts and the wall seconds of each arm (best of --repeat)."""
from __future__ import annotations

import argparse
import json
import time

import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.runners.conv_blocks import bytes_per_block
from engram.engine.sampling_params import SamplingParams
from engram.model.kv_cache import KVCache
from engram.model.loader import LoadedModel, build_model
from engram.model.presets import TOKENIZER_FILE, init_random_weights, preset_config
from engram.model.tables import ensure_preset_tables, open_tables
from engram.tokenizer import CompressedTokenizer

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def paper_model(preset: str, dtype: torch.dtype) -> LoadedModel:
    from tokenizers import Tokenizer

    base = preset_config(preset)
    ecfg = base.engram.replace(variant="paper", row_dtype="fp32")
    cfg = base.replace(engram=ecfg)
    model = build_model(cfg, dtype, torch.device("cpu"))
    init_random_weights(model, 0)
    tables = open_tables(ensure_preset_tables(ecfg, 0, progress=False), ecfg, "gpu", torch.device("cpu"))
    return LoadedModel(model, cfg, ecfg, Tokenizer.from_file(str(TOKENIZER_FILE)),
                       CompressedTokenizer.from_file(TOKENIZER_FILE), tables, cfg.eos_token_id, None,
                       f"{preset}-paper", dtype=dtype, device=torch.device("cpu"))


def memory_rows(block_size: int) -> list[dict]:
    """Conv-pool and KV bytes per block: the presets with paper-variant Engram layers (bf16), hc_mult as given."""
    rows = []
    for preset, hc in (("small", None), ("4b-like", 1), ("4b-like", 4)):
        cfg = preset_config(preset)
        ecfg = cfg.engram.replace(variant="paper", row_dtype="fp32", hc_mult=hc or cfg.engram.hc_mult)
        kv = KVCache.for_model(cfg, 1, block_size, torch.bfloat16, "meta").bytes_per_block()
        conv = bytes_per_block(ecfg, block_size, torch.bfloat16)
        rows.append({"preset": preset, "hc_mult": ecfg.hc_mult, "engram_layers": len(ecfg.layer_ids),
                     "kv_bytes_per_block": kv, "conv_bytes_per_block": conv, "conv_share": conv / (kv + conv)})
    return rows


def timed(engine: LLMEngine, prompt: list[int], rid: str) -> float:
    engine.add_request(rid, prompt, ONE)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prefix", type=int, default=1040, help="cached prefix tokens (a multiple of 16)")
    ap.add_argument("--suffix", type=int, default=32, help="each request's own tokens after the prefix")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = paper_model(args.preset, torch.float32)
    gen = torch.Generator().manual_seed(0)

    def fresh(n: int) -> list[int]:
        return torch.randint(3, 4096, (n,), generator=gen).tolist()

    prefix = fresh(args.prefix)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=2048)
    on = LLMEngine(loaded, EngineConfig(**cfg), loaded.device, loaded.dtype)
    off = LLMEngine(loaded, EngineConfig(enable_prefix_caching=False, **cfg), loaded.device, loaded.dtype)
    arms: dict[str, list[float]] = {k: [] for k in ("cold_cache_on", "cold_cache_off", "hit_stored_state",
                                                    "hit_rerun_32_tokens")}
    timed(on, prefix + fresh(args.suffix), "fill")
    for r in range(args.repeat):
        cold = fresh(args.prefix + args.suffix)
        arms["cold_cache_on"].append(timed(on, cold, f"cold-on-{r}"))
        arms["cold_cache_off"].append(timed(off, cold, f"cold-off-{r}"))
        arms["hit_stored_state"].append(timed(on, prefix + fresh(args.suffix), f"hit-{r}"))
        # the last two cached blocks replaced by other tokens: 32 more tokens computed over the same context
        arms["hit_rerun_32_tokens"].append(timed(on, prefix[:-32] + fresh(32 + args.suffix), f"rerun-{r}"))
    print(json.dumps({"preset": args.preset, "dtype": "float32", "threads": args.threads, "prefix": args.prefix,
                      "suffix": args.suffix, "memory": memory_rows(16),
                      "best_s": {k: min(v) for k, v in arms.items()}, "all_s": arms}, indent=2))


if __name__ == "__main__":
    main()
