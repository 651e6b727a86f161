"""Greedy tokens and logprobs of a fixed workload over every step route, for before/after comparisons.

``python benchmarks/fingerprint.py --out FILE [--preset tiny|4b-like] [--table-rows N]`` runs the same prompts
(batched, chunked prefill, then decode) on each tier (gpu, host, host + hot-row cache, disk, disk + cache),
with CUDA graphs and eager, with lookup overlap on and off, and writes every request's token ids and the
exact bit patterns of their logprobs (float.hex). Two files from two commits are compared with
``--compare A B``: the refactor of a step path must leave them equal. Not a test: it needs a GPU to cover the
graph routes, and its output is compared across commits.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch


def workload(llm_cls, sp_cls, preset: str, tier: str, eager: bool, overlap: bool, cache: bool,
             table_rows: int | None, cache_dir: str, prompts: list[str], max_tokens: int, async_: bool) -> list:
    cfg = {"lookup_overlap": overlap}
    if cache:
        cfg["cache_rows"] = 4096
    if table_rows is not None:
        cfg["table_rows"] = table_rows
    llm = llm_cls(model=preset, tier=tier, engram_config=cfg, enforce_eager=eager, cache_dir=cache_dir,
                  max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=async_)
    params = sp_cls(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        lps = [[float(t.logprob).hex()] + [[i, float(v).hex()] for i, v in t.top] for t in (c.logprobs or [])]
        rows.append({"tokens": list(c.token_ids), "logprobs": lps})
    del llm
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--table-rows", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        bad = [k for k in a if a[k] != b.get(k)] + [k for k in b if k not in a]
        print(json.dumps({"cases": len(a), "differ": bad}))
        return 1 if bad else 0
    import engram
    cuda = torch.cuda.is_available()
    prompts = ["The tables are", "Engram memory hashes the last few tokens into huge static tables " * 3,
               "a b c", "Once upon a time there was a very long prompt that spans several chunks of prefill " * 2,
               "x"]
    cases = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for tier in ("gpu", "host", "disk"):
            for cache in ((False, True) if tier != "gpu" else (False,)):
                for eager in ((False, True) if cuda else (True,)):
                    for overlap in ((True, False) if cuda else (True,)):
                        for async_ in ((True, False) if not cuda else (None,)):
                            key = (f"{tier}{'+cache' if cache else ''}/{'eager' if eager else 'graphs'}"
                                   f"/overlap={overlap}/async={async_}")
                            cases[key] = workload(engram.LLM, engram.SamplingParams, args.preset, tier, eager,
                                                  overlap, cache, args.table_rows, cache_dir, prompts,
                                                  args.max_tokens, async_)
                            print(key, "ok", file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump(cases, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
