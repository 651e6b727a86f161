"""Host time of the engine's side of a decode step (schedule, pack, hash, describe, postprocess,
detokenize) with an executor that does no device work, so it runs anywhere and measures only the Python
the engine adds per step; with and without the start-up heap frozen (engram/engine/heap.py).

    python -m benchmarks.engine_host [--preset 4b-like] [--batch-sizes 64,256] [--steps 200]

Each batch decodes ``--context``-token prompts; the fake executor returns a token per sampling sequence at
once. Prints a JSON line per point and a table: per-step mean / median / p90 / max milliseconds, and the
cyclic collector's share (all collections, and the longest full one).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from tokenizers import Tokenizer

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.executor import Executor
from engram.engine.heap import freeze_startup_heap, thaw_heap
from engram.engine.sampling_params import SamplingParams
from engram.engine.step import StepResult
from engram.model.loader import LoadedModel
from engram.model.presets import TOKENIZER_FILE, preset_config
from engram.tokenizer import CompressedTokenizer


class NoDeviceExecutor(Executor):
    """Returns one token per sampling sequence at once (a function of the step and the row)."""

    num_kv_blocks = 1 << 20

    def launch(self, step):
        return step

    def collect(self, step):
        n = len(step.sample_rows)
        return StepResult(step.step_id, [(7 * i + step.step_id) % 4000 + 3 for i in range(n)], [None] * n)

    def takes_pending_tokens(self) -> bool:
        return True

    def stats(self):
        return {"tables": {}, "kv_bytes": 0, "graph_replays": 0}


class GcClock:
    """Time spent in the cyclic collector while it is installed (gc.callbacks)."""

    def __init__(self):
        self.total, self.count, self.longest_full, self._t0 = 0.0, 0, 0.0, 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.total += dt
        self.count += 1
        if info["generation"] == 2:
            self.longest_full = max(self.longest_full, dt)


def measure(preset: str, batch: int, context: int, steps: int, freeze: bool, asynchronous: bool) -> dict:
    cfg = preset_config(preset)
    loaded = LoadedModel(None, cfg, cfg.engram, Tokenizer.from_file(str(TOKENIZER_FILE)),
                         CompressedTokenizer.from_file(TOKENIZER_FILE), {}, cfg.eos_token_id, None, preset,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch),
                                            max_model_len=context + steps + 64, async_scheduling=asynchronous),
                       torch.device("cpu"), torch.bfloat16, executor=NoDeviceExecutor())
    if freeze:
        freeze_startup_heap()
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(3, 4096, (context,), generator=g).tolist(), params)
    while min((len(s.output_token_ids) for s in engine._seqs.values()), default=0) < 2:  # prefill, then warm up
        engine.step()
    clock = GcClock()
    gc.callbacks.append(clock)
    walls = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(clock)
        if freeze:
            thaw_heap()
    walls.sort()
    ms = [w * 1e3 for w in walls]
    return {"preset": preset, "batch": batch, "context": context, "steps": steps, "async": asynchronous,
            "heap_frozen": freeze, "ms_mean": statistics.fmean(ms), "ms_median": statistics.median(ms),
            "ms_p90": ms[int(0.9 * (len(ms) - 1))], "ms_max": ms[-1], "gc_share": clock.total / sum(walls),
            "gc_collections": clock.count, "gc_longest_full_ms": clock.longest_full * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="4b-like")
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sync", action="store_true", help="synchronous scheduling (default: async)")
    args = ap.parse_args()
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for freeze in (False, True):
            row = measure(args.preset, batch, args.context, args.steps, freeze, not args.sync)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"{'batch':>5} {'frozen':>6} {'mean':>7} {'median':>7} {'p90':>7} {'max':>7} {'gc %':>5} "
          f"{'longest full gc':>15}")
    for r in rows:
        print(f"{r['batch']:>5} {str(r['heap_frozen']):>6} {r['ms_mean']:7.2f} {r['ms_median']:7.2f} "
              f"{r['ms_p90']:7.2f} "
              f"{r['ms_max']:7.2f} {100 * r['gc_share']:5.1f} {r['gc_longest_full_ms']:13.1f} ms")


if __name__ == "__main__":
    main()
