"""``engram bench paper``: the Engram paper's offload experiment (arXiv 2601.07372 §6.4, Table 4) with a control.
Sequences as nano-vLLM's bench draws them (input and output lengths each Uniform(100, 1024), seeded; serve_workload.py),
prompts cut from the committed natural corpus and outputs forced to the text's own continuation, so every arm does the
same work. Offline throughput = output tokens / wall time of the whole set through one engine. Arms: ``none`` (the
backbone without Engram, the paper's baseline, built as ``engram bench engine`` builds "engram-off"), ``gpu``,
``host``, ``disk`` and ``disk-cache`` (disk with a hot-row cache); every arm is its own engine for the whole run. Each
pair A:B is A/B'd over interleaved blocks (stats.run_interleaved, A/A control); round r of every arm runs block r, a
fresh draw from the same distribution. Then one full run per arm gives the headline number, and the Engram arms'
greedy argmax and logprobs over one block must agree bitwise (TierMismatch otherwise)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from engram.bench.stats import ORDERS

HELP = "the Engram paper's offload experiment: offline throughput without Engram / gpu / host / disk, A/A, CI."
CUDA_MODEL, CPU_MODEL = "4b-like", "tiny"
ARMS = ("none", "gpu", "host", "disk", "disk-cache")
PAPER_H800 = {"4b-like": {"none": 9031.62, "host": 8858.28}, "8b-like": {"none": 6315.52, "host": 6140.02}}
TABLE_COLUMNS = ["pair", "tok/s A", "tok/s B", "B/A", "B/A CI", "A/A CI", "verdict"]


class TierMismatch(AssertionError):
    """Two Engram arms computed different argmax tokens or logprobs for the same forced sequences."""


@dataclasses.dataclass(frozen=True)
class Seq:
    """One sequence: its prompt ids and the ids it must emit (its drawn output length of them)."""

    prompt_ids: list[int]
    forced_ids: list[int]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"preset (default: {CUDA_MODEL} on CUDA, {CPU_MODEL} on the CPU)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"arms to build, comma-separated, of {ARMS}")
    p.add_argument("--pairs", default=None, metavar="A:B,...",
                   help="interleaved comparisons (default: none:X for every other arm, and gpu:host)")
    p.add_argument("--engram-config", default=None, metavar="JSON",
                   help='table options every Engram arm shares, e.g. \'{"table_rows": 131000000}\'')
    p.add_argument("--cache-rows", type=int, default=200000, help="hot-row cache of the disk-cache arm (rows)")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="where table files are generated and read")
    p.add_argument("--num-seqs", type=int, default=512, help="sequences of the headline run (default 512)")
    p.add_argument("--no-headline", action="store_true",
                   help="only the pairs: no headline run and no tier check (a pair and the headlines in separate "
                        "commands, each within a time limit; --pairs '' runs only the headlines)")
    p.add_argument("--block-seqs", type=int, default=128, help="sequences per interleaved block (default 128)")
    p.add_argument("--repeats", type=int, default=10, metavar="N", help="blocks (rounds) per pair (default 10)")
    p.add_argument("--warmup", type=int, default=1, metavar="K", help="unrecorded block runs per arm (default 1)")
    p.add_argument("--order", choices=ORDERS, default="abba")
    p.add_argument("--input-len", default="100:1024", metavar="LO:HI", help="prompt tokens, uniform (default 100:1024)")
    p.add_argument("--output-len", default="100:1024", metavar="LO:HI", help="output tokens, uniform")
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine batch limit (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="engine token budget per step")
    p.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                   help="one KV budget for every arm's engine (default: every sequence of a batch at full length)")
    p.add_argument("--enforce-eager", action="store_true", help="every arm without CUDA graphs")
    p.add_argument("--seed", type=int, default=0, help="workload and bootstrap seed")
    p.add_argument("--corpus", default=None, metavar="FILE", help="request corpus (default: the committed one)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default=None)
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file in a temporary directory)")
    p.add_argument("--quiet", action="store_true", help="no per-run progress on stderr")


def draw(stream, num: int, input_len, output_len, seed: int) -> list[Seq]:
    """``num`` sequences from ``make_requests`` over the stream rolled to a seeded offset; each prompt's forced output
    is the stream's next ``output_len`` ids (make_requests lays prompts one after another from the stream's start)."""
    import numpy as np

    from engram.bench.serve_workload import make_requests

    n = stream.ids.size
    ids = np.roll(stream.ids, -int(np.random.default_rng(seed).integers(n)))
    out, cursor = [], 0
    for r in make_requests(dataclasses.replace(stream, ids=ids), num, input_len, output_len, seed):
        p = len(r.prompt_ids)
        out.append(Seq(r.prompt_ids, ids[(cursor + p + np.arange(r.output_len)) % n].tolist()))
        cursor = (cursor + p) % n
    return out


def generate(engine, seqs: list[Seq], tag: str, logprobs: int | None = None) -> tuple[float, list]:
    """Every sequence through ``engine`` at once (greedy, forced, ignore_eos) -> (output tok/s, outputs in order);
    OutputMismatch unless each emitted exactly its forced ids. Every run starts with the prefix cache empty (the
    engine keeps its default, caching on): A and A' share one engine, and a block it has just run must not be found
    again, else the A/A control and B/A measure cache hits, not the tiers."""
    from engram.bench.forced_windows import Windows, check_forced
    from engram.engine.sampling_params import SamplingParams

    ids = [f"{tag}-{i}" for i in range(len(seqs))]
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    for rid, s in zip(ids, seqs):
        engine.add_request(rid, s.prompt_ids, SamplingParams(temperature=0.0, max_tokens=len(s.forced_ids),
                                                             ignore_eos=True, forced_token_ids=s.forced_ids,
                                                             logprobs=logprobs, detokenize=False))
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    wall = time.perf_counter() - t0
    outs = [done[rid] for rid in ids]
    win = Windows([0] * len(seqs), [s.prompt_ids for s in seqs], [s.forced_ids for s in seqs])
    emitted = check_forced(argparse.Namespace(token_ids=[o.token_ids for o in outs]), win,
                           min(len(s.forced_ids) for s in seqs), tag)
    if emitted != sum(len(s.forced_ids) for s in seqs):
        raise AssertionError(f"{tag}: {emitted} ids emitted, {sum(len(s.forced_ids) for s in seqs)} forced")
    return emitted / wall, outs


def check_tiers(outs_of: dict[str, list]) -> dict:
    """The Engram arms' per-token argmax (top-1 id) and forced-token logprob, bitwise against the first arm's."""
    names = list(outs_of)
    ref = names[0]
    key = lambda o: [(lp.top[0][0], lp.top[0][1], lp.logprob) for lp in o.logprobs]  # noqa: E731
    for name in names[1:]:
        for i, (a, b) in enumerate(zip(outs_of[ref], outs_of[name])):
            ka, kb = key(a), key(b)
            if ka != kb:
                j = next(k for k, (x, y) in enumerate(zip(ka, kb)) if x != y)
                raise TierMismatch(f"arms {ref} and {name}: sequence {i} token {j}: (argmax, its logprob, forced "
                                   f"logprob) {ka[j]} vs {kb[j]}")
    return {"arms": names, "sequences": len(outs_of[ref]),
            "tokens": sum(len(o.logprobs) for o in outs_of[ref]), "equal": True}


def parse_pairs(text: str | None, arms: list[str]) -> list[tuple[str, str]]:
    """--pairs as (A, B) arm names, each among --arms ('' for none); SystemExit naming the pair otherwise."""
    if text is not None and not text.strip():
        return []
    if text is None:
        pairs = [("none", a) for a in arms if a != "none"] if "none" in arms else []
        return pairs + ([("gpu", "host")] if {"gpu", "host"} <= set(arms) else [])
    out = []
    for item in text.split(","):
        a, sep, b = item.strip().partition(":")
        if not sep or a not in arms or b not in arms or a == b:
            raise SystemExit(f"--pairs: {item!r} must be A:B with two different arms of --arms {arms}")
        out.append((a, b))
    return out


def _checked(args: argparse.Namespace, device):
    """Arms, pairs, lengths and the AB config, checked before anything loads."""
    from engram.bench import stats
    from engram.bench.corpus import LengthRange

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms or len(set(arms)) != len(arms):
        raise SystemExit(f"--arms: {args.arms!r} must name distinct arms of {ARMS}")
    for option in ("num_seqs", "block_seqs", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, option) < 1:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)} must be >= 1")
    if args.cache_rows < 1:
        raise SystemExit(f"--cache-rows={args.cache_rows} must be >= 1")
    try:
        lengths = LengthRange.parse(args.input_len, "--input-len"), LengthRange.parse(args.output_len, "--output-len")
        ab_cfg = stats.ABConfig(repeats=args.repeats, order=args.order, warmup=args.warmup, higher_is_better=True,
                                seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"engram bench paper: {e}") from None
    model = args.model or (CUDA_MODEL if device.type == "cuda" else CPU_MODEL)
    return arms, parse_pairs(args.pairs, arms), lengths, ab_cfg, model


def _engines(args, arms, model, lengths, device, dtype, stack):
    """One engine per arm, every one with the same EngineConfig and KV budget; ``stack`` closes the tables."""
    from engram.bench.engine_steps import runtime_options
    from engram.bench.placement_ab import default_kv_budget
    from engram.bench.placement_arms import merged_config, parse_shared
    from engram.config import parse_bytes
    from engram.engine.config import EngineConfig
    from engram.engine.engine import LLMEngine
    from engram.model.loader import random_model
    from engram.model.presets import MODEL_PRESETS, preset_config

    if model not in MODEL_PRESETS:
        raise SystemExit(f"--model: {model!r} is not among the presets {MODEL_PRESETS}")
    shared = parse_shared(args.engram_config)
    own = {"none": {}, "gpu": {}, "host": {}, "disk": {"cache_rows": 0}, "disk-cache": {"cache_rows": args.cache_rows}}
    opts_of = {a: runtime_options(merged_config(shared, own[a]), "--engram-config" if a != "disk-cache"
                                  else "--cache-rows") for a in arms}
    opts = runtime_options(shared, "--engram-config")
    try:
        cfg = preset_config(model, table_rows=opts.table_rows, seed=opts.seed)
        kv_budget = parse_bytes(args.kv_cache_memory, "--kv-cache-memory") if args.kv_cache_memory else None
        ecfg = EngineConfig.from_options({
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": lengths[0].high + lengths[1].high, "enforce_eager": args.enforce_eager,
            "seed": args.seed})
    except ValueError as e:
        raise SystemExit(f"engram bench paper: {e}") from None
    if cfg.engram is None and arms != ["none"]:
        raise SystemExit(f"--model {model}: the preset has no Engram layers")
    tier_of = {"gpu": "gpu", "host": "host", "disk": "disk", "disk-cache": "disk"}
    tables, loaded_of = {}, {}
    engram_arms = [a for a in arms if a != "none"]
    if engram_arms:
        base = random_model(cfg, tier_of[engram_arms[0]], dtype, device, opts.seed, cache_dir=args.cache_dir,
                            opts=opts, progress=not args.quiet)
        for a in engram_arms:
            store = opts_of[a].store
            tables[a] = dataclasses.replace(base, tables={}, tier=tier_of[a], store_options=store).open_tables()
            stack.callback(lambda tabs=tables[a]: [t.close() for t in tabs.values()])
            loaded_of[a] = dataclasses.replace(base, tables=tables[a], tier=tier_of[a], store_options=store,
                                               lookup_overlap=opts_of[a].lookup_overlap)
    if "none" in arms:  # the paper's baseline: the same backbone without Engram layers
        loaded_of["none"] = random_model(cfg.replace(engram=None), "gpu", dtype, device, opts.seed, opts=opts,
                                         progress=False)
    kv_budget = kv_budget or default_kv_budget(cfg, ecfg, dtype, tables)
    ecfg = dataclasses.replace(ecfg, kv_cache_memory=kv_budget)
    engines = {a: LLMEngine(loaded_of[a], ecfg, device, dtype) for a in arms}
    return engines, ecfg, cfg, {a: tier_of.get(a) for a in arms}


def _row(pair: str, result) -> dict:
    from engram.bench.stats import AA_LABEL

    ab, aa = result.comparisons["B/A"], result.comparisons.get(f"{AA_LABEL}/A")
    ci = lambda c: f"{1 + c.ci_lo:.4f}…{1 + c.ci_hi:.4f}" if c is not None else ""  # noqa: E731
    return {"pair": pair, "tok/s A": result.stats["A"].median, "tok/s B": result.stats["B"].median,
            "B/A": 1 + ab.estimate, "B/A CI": ci(ab), "A/A CI": ci(aa), "verdict": result.verdict}


def run(args: argparse.Namespace) -> int:
    import contextlib

    import torch

    from engram.bench import stats
    from engram.bench.corpus import CorpusError
    from engram.bench.engine_steps import free_memory
    from engram.bench.report import args_config, format_table, write_result
    from engram.bench.serve_workload import model_tokenizer, token_stream
    from engram.model.loader import resolve_dtype

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    arms, pairs, lengths, ab_cfg, model = _checked(args, device)
    try:
        stream = token_stream(model_tokenizer(model), args.corpus, args.seed)
    except CorpusError as e:
        raise SystemExit(f"--corpus: {e}") from None

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"engram bench paper: {msg}", file=sys.stderr, flush=True)

    def seqs(num: int, seed: int) -> list[Seq]:
        return draw(stream, num, *lengths, seed)

    say(f"{model} ({dtype}, {device}); arms {arms}; pairs {pairs}")
    with contextlib.ExitStack() as stack:
        stack.callback(free_memory, device)
        engines, ecfg, cfg, tiers = _engines(args, arms, model, lengths, device, dtype, stack)
        blocks = [seqs(args.block_seqs, args.seed + 1 + r) for r in range(ab_cfg.repeats)]
        comparisons, rows = [], []
        for a, b in pairs:
            labels = stats.arm_labels(ab_cfg.aa)
            calls = iter([(label, -1) for label in labels for _ in range(ab_cfg.warmup)]
                         + stats.schedule(labels, ab_cfg.repeats, ab_cfg.order))

            def measure(arm: str) -> float:  # round r of every label runs block r; warm-ups run block 0
                label, rnd = next(calls)
                if {"A": a, stats.AA_LABEL: a, "B": b}[label] != arm:
                    raise AssertionError(f"schedule: call for {label} reached arm {arm}")
                return generate(engines[arm], blocks[max(rnd, 0)], f"{arm}-{label}-{rnd}")[0]

            say(f"pair {a}:{b}: {ab_cfg.repeats} blocks of {args.block_seqs} sequences")
            result = stats.run_interleaved(stats.Arm(a, lambda a=a: measure(a)), stats.Arm(b, lambda b=b: measure(b)),
                                           ab_cfg, None if args.quiet else lambda r: say(f"  {r.arm} round {r.round}: "
                                                                                          f"{r.value:.1f} tok/s"))
            comparisons.append({"a": a, "b": b, "ab": result.to_dict()})
            rows.append(_row(f"{a}:{b}", result))
        full = seqs(args.num_seqs, args.seed)
        headline = {}
        for arm in arms if not args.no_headline else ():
            headline[arm] = {"tok_s": generate(engines[arm], full, f"{arm}-full")[0],
                             "tables": engines[arm].stats().get("tables")}
            say(f"full run {arm}: {headline[arm]['tok_s']:.1f} output tok/s over {len(full)} sequences")
        engram_arms = [x for x in arms if x != "none"]
        check = None
        if len(engram_arms) >= 2 and not args.no_headline:
            check = check_tiers({x: generate(engines[x], blocks[0], f"{x}-check", logprobs=1)[1]
                                 for x in engram_arms})
    ratios = {f"{x}/none": headline[x]["tok_s"] / headline["none"]["tok_s"] - 1
              for x in arms if "none" in headline and x != "none"}
    result = {"model": {"name": model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                        "engram_layers": list(cfg.engram.layer_ids) if cfg.engram else [],
                        "table_rows": {str(i): cfg.engram.table_rows(i) for i in cfg.engram.layer_ids}
                        if cfg.engram else {}},
              "arms": {x: {"tier": tiers[x], "cache_rows": args.cache_rows if x == "disk-cache" else None}
                       for x in arms},
              "engine_config": dataclasses.asdict(ecfg),
              "workload": {"num_seqs": args.num_seqs, "block_seqs": args.block_seqs, "input_len": args.input_len,
                           "output_len": args.output_len, "output_tokens": sum(len(s.forced_ids) for s in full),
                           "corpus_sha256": stream.corpus_sha256, "tokenizer": stream.tokenizer},
              "comparisons": comparisons, "headline": headline, "headline_ratios": ratios, "tier_check": check,
              "paper_h800": {name: {**v, "host/none": v["host"] / v["none"] - 1} for name, v in PAPER_H800.items()}}
    path = write_result(f"paper-{model}", args_config(args), result, out=args.out)
    if rows:
        print(format_table(rows, TABLE_COLUMNS))
    paper = PAPER_H800.get(model)
    if headline:
        print(format_table([{"arm": x, "output tok/s": headline[x]["tok_s"], "vs none": ratios.get(f"{x}/none", ""),
                             "paper H800": paper.get(x, "") if paper else ""} for x in arms]))
    if check is not None:
        print(f"tiers {check['arms']}: argmax and logprobs bitwise equal over {check['tokens']} tokens")
    print(f"result: {path}")
    return 0
