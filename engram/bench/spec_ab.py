"""`engram bench engine --speculative-config JSON`: decode output tokens/s with and without speculative decoding, both
engines over the same loaded model and tables, interleaved in one process (ABBA rounds; ``stats.compare``'s paired
bootstrap CI of the speedup), per tier and batch size, with the acceptance length.

The presets have random weights, so their own greedy tokens would almost never match a draft, and repetitive toy
prompts would fake the result: every sequence is forced through a natural window of the benchmark corpus
(``forced_windows``), so a draft token is accepted iff it equals the forced token and the verify work is real.
``--spec-workload`` says what the forced continuation is: ``natural`` (the corpus's own next tokens), ``quote`` (the
window's prompt again from its middle, a summary that quotes its prompt) or ``summary`` (spans of 16 quoted and 16
natural tokens in turn). Timing starts once every sequence has emitted its first token (prefill is not measured)."""
from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np

WORKLOADS = ("natural", "quote", "summary")
SPAN = 16  # tokens per quoted / natural span of the "summary" workload


def forced_continuations(prompts: list[list[int]], natural: list[list[int]], workload: str) -> list[list[int]]:
    """The ids each sequence must emit (as long as its natural continuation) under ``workload``."""
    out = []
    for p, nat in zip(prompts, natural):
        n = len(nat)
        quote = [p[(len(p) // 2 + i) % len(p)] for i in range(n)]
        if workload == "natural":
            out.append(list(nat))
        elif workload == "quote":
            out.append(quote)
        else:
            out.append([quote[i] if (i // SPAN) % 2 == 0 else nat[i] for i in range(n)])
    return out


def _generate(engine, prompts, forced) -> tuple[float, int, list[list[int]]]:
    """Run the batch to the end -> (seconds after the step in which every sequence had its first token, tokens emitted
    in them, each sequence's ids)."""
    from engram.engine.sampling_params import SamplingParams

    ids = [f"spec-{i}" for i in range(len(prompts))]
    for rid, p, f in zip(ids, prompts, forced):
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=len(f), forced_token_ids=list(f),
                                                  ignore_eos=True, output_kind="delta"))
    done: dict[str, list[int]] = {rid: [] for rid in ids}
    started, before = None, 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id].extend(out.outputs[0].token_ids)
            if started is None and all(done.values()):
                started, before = time.perf_counter(), sum(map(len, done.values()))  # tokens of untimed steps
    finally:
        for rid in ids:
            engine.abort_request(rid)
    took = time.perf_counter() - (started or time.perf_counter())
    return took, sum(map(len, done.values())) - before, [done[r] for r in ids]


def run_spec(args, cfg, opts, device, dtype) -> int:
    """The speculative A/B (module docstring) of the first of ``--models``; prints a table, writes the JSON."""
    from engram.bench.corpus import encode_corpus, load_corpus, load_tokenizer
    from engram.bench.engine_steps import free_memory, parse_ints
    from engram.bench.forced_windows import OutputMismatch, corpus_stream, cut_windows
    from engram.bench.report import args_config, format_table, write_result
    from engram.bench.serve_workload import DEFAULT_CORPUS
    from engram.bench.stats import ABConfig, compare
    from engram.engine.config import EngineConfig
    from engram.engine.engine import LLMEngine
    from engram.engine.heap import freeze_startup_heap
    from engram.engine.spec.config import SpeculativeConfig, decode_reservation
    from engram.model.loader import random_model

    if args.spec_workload not in WORKLOADS:
        raise SystemExit(f"--spec-workload={args.spec_workload!r}: one of {WORKLOADS}")
    try:
        spec = SpeculativeConfig.from_dict(_json(args.speculative_config))
    except ValueError as e:
        raise SystemExit(f"--speculative-config: {e}") from None
    batches = parse_ints(args.batch_sizes, "--batch-sizes")
    tiers = list(dict.fromkeys(opts.tier(t.strip()) for t in args.tiers.split(",") if t.strip()))
    ab = ABConfig(repeats=args.spec_repeats, higher_is_better=True, aa=False)
    max_tokens = args.decode_steps
    block = 16
    max_model_len = -(-(args.context_len + max_tokens + spec.num_speculative_tokens + 1) // block) * block
    seqs = max(batches)
    budget = max(args.max_num_batched_tokens, seqs * (spec.rows_per_sequence))
    common = dict(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_model_len, block_size=block,
                  num_kv_blocks=seqs * (max_model_len // block) + 8, enforce_eager=args.enforce_eager, seed=opts.seed)
    stream = corpus_stream(encode_corpus(load_corpus(DEFAULT_CORPUS), load_tokenizer("builtin")), cfg.vocab_size)
    base = random_model(cfg, tiers[0], dtype, device, opts.seed, opts=opts, progress=False)
    points = []
    for tier in tiers:
        loaded = dataclasses.replace(base, tables={}, tier=tier)
        loaded.open_tables()  # once: both engines gather from these
        engines = {"off": LLMEngine(loaded, EngineConfig(**common), device, dtype),
                   "spec": LLMEngine(loaded, EngineConfig(**common, speculative_config=spec), device, dtype)}
        freeze_startup_heap()
        for b in batches:
            win = cut_windows(stream, b, args.context_len, max_tokens)
            forced = forced_continuations(win.prompts, win.forced, args.spec_workload)
            samples: dict[str, list[float]] = {"off": [], "spec": []}
            before = engines["spec"].stats()["speculative"]
            counted = {arm: _counters(e) for arm, e in engines.items()}
            for r in range(ab.warmup + ab.repeats):
                order = ["off", "spec"] if r % 2 == 0 else ["spec", "off"]
                for arm in order:
                    took, tokens, got = _generate(engines[arm], win.prompts, forced)
                    if got != forced:
                        raise OutputMismatch(f"arm {arm}, batch {b}: the sequences did not emit their forced ids")
                    if r >= ab.warmup:
                        samples[arm].append(tokens / took)
            after = engines["spec"].stats()["speculative"]
            steps = after["spec_steps"] - before["spec_steps"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            drafts = after["draft_tokens"] - before["draft_tokens"]
            c = compare(samples["spec"], samples["off"], ab, ("spec", "off"))
            points.append({"model": cfg.name, "tier": tier, "batch": b, "workload": args.spec_workload,
                           "method": spec.method, "K": spec.num_speculative_tokens,
                           "tok_s_off": float(np.median(samples["off"])), "tok_s_spec": float(np.median(samples["spec"])),
                           "speedup": 1.0 + c.estimate, "ci_lo": 1.0 + c.ci_lo, "ci_hi": 1.0 + c.ci_hi,
                           "acceptance_length": 1.0 + accepted / steps if steps else 0.0,
                           "acceptance_rate": accepted / drafts if drafts else 0.0,
                           "device": {arm: _delta(counted[arm], _counters(e)) for arm, e in engines.items()},
                           "samples": samples})
            print(f"bench engine (speculative): {tier} batch {b}: x{points[-1]['speedup']:.3f}, acceptance length "
                  f"{points[-1]['acceptance_length']:.2f}", file=sys.stderr, flush=True)
        del engines, loaded
        free_memory(device)
    ratios = _tier_ratios(points)
    result = {"speculative_config": spec.to_dict(), "decode_reservation": decode_reservation(EngineConfig(
        **common, speculative_config=spec)), "engine": common, "points": points, "tier_ratios": ratios}
    path = write_result("engine-spec-" + cfg.name, args_config(args), result, out=args.out)
    print(format_table([{k: v for k, v in p.items() if k != "samples"} for p in points],
                       ["model", "tier", "batch", "workload", "K", "tok_s_off", "tok_s_spec", "speedup", "ci_lo",
                        "ci_hi", "acceptance_length", "acceptance_rate"]))
    if ratios:
        print(format_table(ratios, ["batch", "tier", "speedup", "gpu_speedup", "ratio"]))
    print(f"result: {path}")
    return 0


def _counters(engine) -> dict:
    """What the device did so far: steps by route, busy / idle seconds, host gaps, the verify graphs' rows."""
    st = engine.stats()
    return {"steps": st["steps"], "steps_by_route": st["steps_by_route"], "gpu_busy_s": st["gpu_busy_s"],
            "gpu_idle_s": st["gpu_idle_s"], "host_gap_s": st["host_gap_s"],
            **{f"verify_graph_{k}": v for k, v in st["verify_graph"].items() if k != "pool_bytes"}}


def _delta(before: dict, after: dict) -> dict:
    """``after - before`` of ``_counters`` (routes key by key), with the device's busy time per step."""
    out = {k: after[k] - before[k] for k in after if k != "steps_by_route"}
    out["steps_by_route"] = {r: n - before["steps_by_route"].get(r, 0) for r, n in after["steps_by_route"].items()
                             if n - before["steps_by_route"].get(r, 0)}
    out["gpu_busy_s_per_step"] = out["gpu_busy_s"] / out["steps"] if out["steps"] else 0.0
    return out


def _tier_ratios(points: list[dict]) -> list[dict]:
    """Each non-gpu tier's speedup against the gpu tier's at the same batch (the issue's "within 2 %")."""
    gpu = {p["batch"]: p["speedup"] for p in points if p["tier"] == "gpu"}
    return [{"batch": p["batch"], "tier": p["tier"], "speedup": p["speedup"], "gpu_speedup": gpu[p["batch"]],
             "ratio": p["speedup"] / gpu[p["batch"]]} for p in points if p["tier"] != "gpu" and p["batch"] in gpu]


def _json(text: str) -> dict:
    from engram.config import parse_json_object

    return parse_json_object(text, "--speculative-config")
