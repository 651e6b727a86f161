"""``engram bench placement``: table placements and engine settings A/B'd in one process, interleaved, with an A/A
control, over forced natural decoding. The model loads once, each placement's tables open once, every arm
(placement_arms.py) is its own engine for the whole run; every sample must emit the same forced ids (forced_windows.py)
and, on CUDA, replay a graph unless eager. Comparisons: placement_compare.py; disk bounds: disk_bound.py."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from engram.bench.disk_bound import (BOUND_FACTOR, DISK_COLUMNS, NO_HOST_ARM, add_bounds, disk_rows,
                                     measure_lookup_reads, measure_raw_reads, read_depth, sample_rate)
from engram.bench.placement_arms import DEFAULT_A, DEFAULT_B, merged_config, parse_arm, parse_shared, placement_name
from engram.bench.stats import ORDERS

HELP = "Engram table placements / engine settings A/B'd in one process over forced natural decoding (A/A, CI)."
CUDA_MODEL, CPU_MODEL = "4b-like", "tiny"
DEFAULT_CORPUS_NAME = "bench/corpus/natural-v1.jsonl"  # serve_load.DEFAULT_CORPUS, as the result records it
TABLE_COLUMNS = ["batch", "arm B", "tok/s A", "tok/s B", "B/A", "B/A CI", "A/A CI", "verdict", "B hit rate",
                 "B reads/step"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"preset (default: {CUDA_MODEL} on CUDA, {CPU_MODEL} on the CPU)")
    p.add_argument("--engram-config", default=None, metavar="JSON",
                   help='options every arm shares, e.g. \'{"tables_in_memory": true, "table_rows": 131000000}\'; '
                        "an arm's engram_config overrides its table options and lookup_overlap")
    p.add_argument("--a", default=DEFAULT_A, metavar="JSON",
                   help=f'arm A (the baseline): keys tier (gpu|host|disk), engram_config (e.g. {{"cache_rows": '
                        f'200000, "io": "direct"}}) and engine (EngineConfig fields, e.g. {{"enforce_eager": true}}) '
                        f'(default {DEFAULT_A})')
    p.add_argument("--b", action="append", default=None, metavar="JSON",
                   help=f"an arm B, repeatable (--b[1] is the first); each is A/B'd against A in its own "
                        f"interleaved run (default one: {DEFAULT_B})")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where the preset's table files are generated and read (the disk tier's disk; default: "
                        "$ENGRAM_CACHE_DIR, else ~/.cache/engram)")
    p.add_argument("--raw-read-seconds", type=float, default=2.0, metavar="S",
                   help="disk arms: seconds of plain random 4 KiB reads of the table's file before each comparison "
                        "(the disk's read rate in the bound; default 2)")
    p.add_argument("--raw-read-sample-seconds", type=float, default=0.25, metavar="S",
                   help="O_DIRECT disk arms: seconds of the same raw reads right before and right after each of "
                        "the arm's samples (the paired and bracketed bounds; 0: off; default 0.25)")
    p.add_argument("--raw-read-pages", type=int, default=16384, metavar="N",
                   help="disk arms: pages per raw read call (default 16384 = 64 MiB)")
    p.add_argument("--batch-sizes", default="1,64", help="decode batch sizes, comma-separated")
    p.add_argument("--context-len", type=int, default=512, help="prompt tokens per sequence (a corpus window)")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per sample")
    p.add_argument("--warmup-tokens", type=int, default=3, help="tokens every sequence decodes before timing")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="engine token budget per step (prefill chunks), raised to the largest batch")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="sequences every arm's engine is built for (its decode graphs' buckets, default KV "
                        "budget); default: the largest batch; at least that")
    p.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                   help="one KV budget for every arm's engine: bytes, or with a unit (512MiB, 8GiB); default: "
                        "sized for the largest batch at full length plus Engram staging and hot-row caches")
    p.add_argument("--repeats", type=int, default=10, metavar="N", help="recorded runs per arm (default 10)")
    p.add_argument("--warmup", type=int, default=1, metavar="K", help="unrecorded runs per arm (default 1)")
    p.add_argument("--order", choices=ORDERS, default="abba", help="abba (default) cancels linear drift")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="request corpus (engram bench corpus; default: the committed bench/corpus/natural-v1.jsonl)")
    p.add_argument("--enforce-eager", action="store_true", help="every arm without CUDA graphs (vLLM's name)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file in a temporary directory)")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="PNG of samples in run order, one per comparison (FILE's stem suffixed -b<k>-batch<B>)")
    p.add_argument("--quiet", action="store_true", help="no per-run progress on stderr")


def table_info(tables: dict) -> dict:
    """Per Engram layer: the table's type, rows, device and bytes of its storage (a shared buffer once) and cache."""
    out = {}
    for lid, t in tables.items():
        storages = {}
        for x in (getattr(t, "values", None), getattr(t, "scales", None)):
            if x is not None:
                s = x.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        cache, values = getattr(t, "cache", None), getattr(t, "values", None)
        out[str(lid)] = {"type": type(t).__name__, "rows": t.rows,
                         "device": str(values.device) if values is not None else str(t.device),
                         "bytes": sum(storages.values()), "cache_bytes": cache.nbytes if cache is not None else 0}
    return out


def default_kv_budget(cfg, ecfg, dtype, tables_by_placement: dict) -> int:
    """Bytes for the largest batch at max_model_len, a step's Engram staging and the largest hot-row cache."""
    from engram.engine.lookup import staging_bytes
    from engram.model.kv_cache import KVCache

    per_block = KVCache.for_model(cfg, 1, ecfg.block_size, dtype, "meta").bytes_per_block()
    staging = staging_bytes(cfg.engram, ecfg.max_num_batched_tokens, dtype) if cfg.engram else 0
    cache = max((sum(t.cache.nbytes for t in tabs.values() if getattr(t, "cache", None) is not None)
                 for tabs in tables_by_placement.values()), default=0)
    blocks = ecfg.max_num_seqs * -(-ecfg.max_model_len // ecfg.block_size)
    return staging + cache + blocks * per_block


def _checked_settings(args: argparse.Namespace, device, seed: int):
    """The run's Settings, AB config, preset and KV budget, checked before anything loads."""
    from engram.bench import stats
    from engram.bench.engine_steps import Settings, parse_ints
    from engram.config import parse_bytes
    from engram.model.presets import MODEL_PRESETS

    model = args.model or (CUDA_MODEL if device.type == "cuda" else CPU_MODEL)
    if model not in MODEL_PRESETS:
        raise SystemExit(f"--model: {model!r} is not among the presets {MODEL_PRESETS}")
    for option in ("context_len", "decode_steps", "warmup_tokens", "max_num_batched_tokens"):
        if getattr(args, option) < 1:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)} must be >= 1")
    if args.raw_read_seconds <= 0 or args.raw_read_pages < 1 or args.raw_read_sample_seconds < 0:
        raise SystemExit(f"--raw-read-seconds={args.raw_read_seconds} must be > 0, --raw-read-sample-seconds="
                         f"{args.raw_read_sample_seconds} >= 0 and --raw-read-pages={args.raw_read_pages} >= 1")
    try:
        ab_cfg = stats.ABConfig(repeats=args.repeats, order=args.order, warmup=args.warmup, higher_is_better=True,
                                seed=args.seed)
        kv_budget = parse_bytes(args.kv_cache_memory, "--kv-cache-memory") if args.kv_cache_memory else None
    except ValueError as e:
        raise SystemExit(f"engram bench placement: {e}") from None
    s = Settings(parse_ints(args.batch_sizes, "--batch-sizes"), args.context_len, args.decode_steps,
                 args.warmup_tokens, profile_steps=0, prefill_shapes=(), prefill_repeats=1,
                 max_num_batched_tokens=args.max_num_batched_tokens, seed=seed, enforce_eager=args.enforce_eager)
    return s, ab_cfg, model, kv_budget


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from engram.bench import stats
    from engram.bench.corpus import CorpusError, encode_corpus, load_corpus, load_tokenizer, token_stats
    from engram.bench.engine_steps import decode_max_tokens, engine_config, free_memory, runtime_options
    from engram.bench.forced_windows import corpus_stream, cut_windows
    from engram.bench.placement_compare import GraphFallback, run_comparison, table_row
    from engram.bench.report import args_config, format_table, write_result
    from engram.bench.serve_load import DEFAULT_CORPUS
    from engram.engine import lookup
    from engram.engine.engine import LLMEngine
    from engram.engine.heap import freeze_startup_heap, thaw_heap
    from engram.model.loader import random_model, resolve_dtype
    from engram.model.presets import preset_config

    # Everything the command line says is checked before anything loads.
    shared = parse_shared(args.engram_config)
    arm_a = parse_arm(args.a, "--a", shared)
    arms_b = [parse_arm(text, f"--b[{k}]", shared) for k, text in enumerate(args.b or [DEFAULT_B], start=1)]
    options_of = {arm: (option, runtime_options(merged_config(shared, arm.engram_config), option))
                  for option, arm in [("--a", arm_a)] + [(f"--b[{k}]", b) for k, b in enumerate(arms_b, start=1)]}
    opts = runtime_options(shared, "--engram-config")
    for arm, (option, arm_opts) in options_of.items():
        try:
            arm_opts.tier(arm.tier)
        except ValueError as e:
            raise SystemExit(f"{option}: {e}") from None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    s, ab_cfg, model, kv_budget = _checked_settings(args, device, opts.seed)
    try:
        cfg = preset_config(model, table_rows=opts.table_rows, seed=opts.seed)
    except ValueError as e:
        raise SystemExit(f"--engram-config: {e}") from None
    if cfg.engram is None:
        raise SystemExit(f"--model {model}: the preset has no Engram layers to place")
    ecfg = engine_config(s, cfg.max_position_embeddings)  # refuses a context too long for the model
    if args.max_num_seqs is not None:
        if args.max_num_seqs < ecfg.max_num_seqs:
            raise SystemExit(f"--max-num-seqs={args.max_num_seqs} must be at least the largest batch "
                             f"({ecfg.max_num_seqs})")
        ecfg = dataclasses.replace(ecfg, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=max(ecfg.max_num_batched_tokens, args.max_num_seqs))
    engine_of = {arm: dataclasses.replace(ecfg, **arm.engine) for arm in options_of}
    for arm, arm_cfg in engine_of.items():
        if device.type == "cuda" and not arm_cfg.enforce_eager and max(s.batch_sizes) > arm_cfg.max_graph_batch:
            raise GraphFallback(f"arm {arm.name}: batch {max(s.batch_sizes)} is above max_graph_batch="
                                f"{arm_cfg.max_graph_batch}, so its decode steps would run eagerly; give the arm "
                                f'"engine": {{"enforce_eager": true}} to compare eager steps')
    corpus_path = Path(args.corpus) if args.corpus else DEFAULT_CORPUS
    try:
        if not corpus_path.is_file():
            raise CorpusError(f"corpus {corpus_path}: no such file")
        corpus = load_corpus(corpus_path)  # SHA-256 checked
    except CorpusError as e:
        raise SystemExit(f"--corpus: {e}") from None

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"engram bench placement: {msg}", file=sys.stderr, flush=True)

    arms = list(options_of)  # distinct arms, one engine each
    placement_of = {arm: placement_name(arm.tier, options_of[arm][1].store, opts.store) for arm in arms}
    placements = {placement_of[arm]: (arm.tier, options_of[arm][1].store) for arm in arms}
    say(f"loading {model} ({dtype}, {device}); placements {list(placements)}; {len(arms)} engines")
    base = random_model(cfg, arms[0].tier, dtype, device, opts.seed, cache_dir=args.cache_dir, opts=opts,
                        progress=not args.quiet)
    tables: dict[str, dict] = {}
    engines: dict = {}
    frozen = False
    try:
        for name, (tier, store) in placements.items():  # each placement's tables once: at ~33 GiB a layer
            tables[name] = dataclasses.replace(base, tables={}, tier=tier, store_options=store).open_tables()
        tables_info = {name: table_info(tabs) for name, tabs in tables.items()}  # before they close
        stream = corpus_stream(encode_corpus(corpus, load_tokenizer("builtin")), cfg.vocab_size)
        kv_source = "--kv-cache-memory" if kv_budget is not None else "sized for the largest batch"
        kv_budget = kv_budget or default_kv_budget(cfg, ecfg, dtype, tables)
        for arm in arms:
            arm_opts = options_of[arm][1]
            loaded = dataclasses.replace(base, tables=tables[placement_of[arm]], tier=arm.tier,
                                         store_options=arm_opts.store, lookup_overlap=arm_opts.lookup_overlap)
            engines[arm] = LLMEngine(loaded, dataclasses.replace(engine_of[arm], kv_cache_memory=kv_budget),
                                     device, dtype)
        freeze_startup_heap()  # as engram serve does (engine/heap.py); thawed before the tables close
        frozen = True

        comparisons, windows_info, rows = [], {}, []
        n_cols = cfg.engram.n_cols  # row ids per token per table: a decode step's b * n_cols
        for b in s.batch_sizes:
            max_tokens = decode_max_tokens(b, s.context_len, ecfg.max_num_batched_tokens, s.warmup_tokens,
                                           s.decode_steps, 0)
            win = cut_windows(stream, b, s.context_len, max_tokens)
            windows_info[str(b)] = {"max_tokens": max_tokens, "offsets": win.offsets,
                                    "token_stats": token_stats([(np.asarray(p), np.asarray(f))
                                                                for p, f in zip(win.prompts, win.forced)])}
            for k, arm_b in enumerate(arms_b, start=1):
                disk = {}
                for label, arm in (("A", arm_a), ("B", arm_b)):  # the disk's read rate right before the run
                    if arm.tier == "disk":
                        tabs = tables[placement_of[arm]]
                        fresh = all(t.stats()["lookups"] == 0 for t in tabs.values())
                        together = lookup.reads_together(b * n_cols, lookup.read_queue_depth(tabs[min(tabs)]))
                        raw = measure_raw_reads(tabs, args.raw_read_seconds, args.raw_read_pages, opts.seed,
                                                read_depth(tabs, together))
                        say(f"batch {b}: raw random reads for {label} {arm.name}: {raw['read_ops_per_s']:.4g} ops/s "
                            f"({raw['io']}, queue depth {raw['queue_depth']})")
                        disk[label] = (raw, fresh, placement_of[arm])
                rates = {label: sample_rate(tables[placement], args.raw_read_sample_seconds, args.raw_read_pages,
                                            opts.seed, raw["queue_depth"])
                         for label, (raw, _, placement) in disk.items()
                         if args.raw_read_sample_seconds > 0 and raw["io"] == "direct"}  # buffered: it would drop
                say(f"batch {b}: A {arm_a.name} vs B {arm_b.name}")  # the page cache before every sample
                graphs = {arm: device.type == "cuda" and not engine_of[arm].enforce_eager for arm in (arm_a, arm_b)}
                cached = {arm: any(getattr(t, "cache", None) is not None for t in tables[placement_of[arm]].values())
                          for arm in (arm_a, arm_b)}
                result, comparison = run_comparison(engines, arm_a, arm_b, k, b, win, s, ab_cfg, args.quiet, graphs,
                                                    cached, disk, rates)
                for label, d in comparison.get("disk", {}).items():  # one lookup's reads as a raw call, after
                    d["lookup_reads"] = measure_lookup_reads(tables[disk[label][2]], d["read_ops_per_step_median"],
                                                             args.raw_read_seconds / 4, opts.seed)
                comparisons.append(comparison)
                rows.append(table_row(result, comparison))
                if args.plot:
                    p = Path(args.plot)
                    png = p.with_name(f"{p.stem}-b{k}-batch{b}{p.suffix or '.png'}")
                    stats.plot_runs(result, str(png), title=f"batch {b}: A {arm_a.name}\nB {arm_b.name}")
                    say(f"plot: {png}")
        kv_blocks = {arm.name: engines[arm].stats()["kv_blocks_total"] for arm in arms}
        add_bounds(comparisons, ab_cfg)
    finally:
        if frozen:
            thaw_heap()
        engines.clear()
        for tabs in tables.values():
            for t in tabs.values():
                t.close()
        free_memory(device)

    result = {"model": {"name": model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                        "engram_layers": list(cfg.engram.layer_ids),
                        "table_rows": {str(l): cfg.engram.table_rows(l) for l in cfg.engram.layer_ids}},
              "arms": {"A": arm_a.to_dict(), "B": [a.to_dict() for a in arms_b]},
              "engram_config": json.loads(json.dumps(dataclasses.asdict(opts), default=str)),
              "tables": tables_info,
              "placements": {"arms": {arm.name: placement_of[arm] for arm in arms},
                             "store_options": {name: store.to_dict() for name, (_, store) in placements.items()}},
              "engine_config": dataclasses.asdict(ecfg),
              "engine_configs": {arm.name: dataclasses.asdict(engine_of[arm]) for arm in arms},
              "kv_cache_memory": {"bytes": kv_budget, "source": kv_source, "kv_blocks": kv_blocks},
              "settings": {"batch_sizes": list(s.batch_sizes), "context_len": s.context_len,
                           "decode_steps": s.decode_steps, "warmup_tokens": s.warmup_tokens,
                           "enforce_eager": args.enforce_eager, "ab": dataclasses.asdict(ab_cfg),
                           "raw_read_seconds": args.raw_read_seconds, "raw_read_pages": args.raw_read_pages,
                           "raw_read_sample_seconds": args.raw_read_sample_seconds, "bound_factor": BOUND_FACTOR},
              "corpus": {"path": args.corpus or DEFAULT_CORPUS_NAME, "sha256": corpus.sha256,
                         "requests": len(corpus.requests), "stream_tokens": int(stream.size)},
              "windows": windows_info, "comparisons": comparisons}
    path = write_result(f"placement-{model}", args_config(args), result, out=args.out)
    print(format_table(rows, TABLE_COLUMNS))
    drows = disk_rows(comparisons)
    if drows:
        print()
        print(format_table(drows, DISK_COLUMNS))
        if any(r["bound ms"] is None for r in drows):
            print(f"disk arms: {NO_HOST_ARM} (add an arm with tier host)")
        else:
            print(f"disk arms: bound = host step ms + read ops/step / raw reads/s; target ratio <= {BOUND_FACTOR}; "
                  "paired ratio: each sample against the raw rate right before it; bracketed: against the harmonic "
                  "mean of the rates before and after it; floor = host step ms + one lookup's reads as a raw call")
    for c in comparisons:
        for w in c["ab"]["warnings"]:
            print(f"warning: batch {c['batch']} b{c['b_index']}: {w}")
    print(f"result: {path}")
    return 0
