"""Host time of one engine step's hashing: NgramHasher.hash_step (numpy on CPU tensors) against
hash_step_reference (the torch ops), on a preset's Engram layout.

    python -m benchmarks.hash_step [--preset 4b-like] [--shapes 1x1,64x64,2048x1,2048x8]

A shape TxS is T tokens over S sequences of equal chunk lengths (64x64 = a decode step of batch 64,
2048x1 = one prefill chunk). Prints the best of --repeat timeit rounds, in microseconds per call.
"""
from __future__ import annotations

import argparse
import timeit

import torch

from engram.config import EngramConfig
from engram.hashing import NgramHasher
from engram.model.presets import MODEL_PRESETS, preset_config


def engram_config(name: str) -> EngramConfig:
    return preset_config(name).engram if name in MODEL_PRESETS else EngramConfig.preset(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="4b-like", help="a model preset (tiny, small, 4b-like, 8b-like) or an "
                                                        "EngramConfig preset (deepseek-v4.1-flash, paper-demo)")
    ap.add_argument("--shapes", default="1x1,64x64,2048x1,2048x8", help="comma-separated TxS")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    cfg = engram_config(args.preset)
    h = NgramHasher(cfg, pad_id=0)
    g = torch.Generator().manual_seed(0)
    print(f"{args.preset}: {len(cfg.layer_ids)} layers x {cfg.n_cols} columns, lookback {h.window}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'T':>6} {'S':>4} {'reference us':>13} {'numpy us':>9} {'speedup':>8}")
    for shape in args.shapes.split(","):
        t, s = (int(v) for v in shape.split("x"))
        ids = torch.randint(0, cfg.compressed_vocab_size, (t,), generator=g)
        cu = torch.arange(s + 1) * (t // s)
        cu[-1] = t
        lb = torch.randint(0, cfg.compressed_vocab_size, (s, h.window), generator=g)
        ref_rows, ref_lb = h.hash_step_reference(ids, cu, lb)
        rows, nlb = h.hash_step(ids, cu, lb)
        assert torch.equal(nlb, ref_lb) and all(torch.equal(rows[k], ref_rows[k]) for k in rows)
        number = max(1, 20000 // max(t, 50))
        per_call = {}
        for name, fn in (("reference", h.hash_step_reference), ("numpy", h.hash_step)):
            best = min(timeit.repeat(lambda: fn(ids, cu, lb), number=number, repeat=args.repeat))
            per_call[name] = best / number * 1e6
        print(f"{t:>6} {s:>4} {per_call['reference']:>13.1f} {per_call['numpy']:>9.1f} "
              f"{per_call['reference'] / per_call['numpy']:>7.1f}x")


if __name__ == "__main__":
    main()
