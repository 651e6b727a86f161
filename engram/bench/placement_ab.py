"""`engram bench placement`: Engram table placements and lookup options A/B'd in one process, interleaved,
with an A/A control, over forced natural decoding.

Why in one process: a large model's tables take minutes of device time to build (two ~33 GiB tables in
pinned host memory, two more on the GPU); ``engram bench ab`` runs a shell command per sample, so every
sample would rebuild them. Here the model is loaded once (``random_model``), the tables of each distinct
placement, a (tier, store options) pair, are opened once (a ``LoadedModel`` with ``tables={}``, that tier
and those options, ``open_tables()``), and one ``LLMEngine`` per distinct arm runs over
``dataclasses.replace(base, tables=<the placement's tables>, tier=..., lookup_overlap=...)``: every engine
shares the model weights, engines of one placement share its table objects (a placement's tables are
never opened twice), and all of them exist for the whole run, since the arms interleave. Each engine
has its own KV cache of the same fixed budget (``--kv-cache-memory``, default sized for the largest
batch: staging + hot-row caches + every sequence at full length), its own CUDA graphs and, with
``lookup_overlap``, its own lookup stream. Tables shared by two arms share their hot-row
cache (if the options give one) and counters. The start-up heap is frozen once the engines exist
(engine/heap.py) and thawed at the end; the tables are closed at the end.

Arms: ``--a`` (default ``{"tier": "gpu"}``) and one or more ``--b`` (default one,
``{"tier": "host", "lookup_overlap": true}``). What an arm is (``tier``, ``lookup_overlap``, ``options``),
how the arms and ``--engram-config`` (what they share; its table options are the base an arm's
``options`` override) are checked before anything loads, and how a placement is named:
engram/bench/placement_arms.py. Each B is compared with A in its own interleaved run
(engram/bench/placement_compare.py: one comparison, its samples and checks).

The disk tier reads the preset's table files, generated into ``--cache-dir`` (``random_model``; default the
project's cache): a disk arm with ``tables_in_memory`` in ``--engram-config`` stops the command before
anything loads. Right before each comparison that involves a disk arm, the disk's random 4 KiB read rate is
measured for ``--raw-read-seconds`` (``--raw-read-pages`` pages per call), and again for
``--raw-read-sample-seconds`` right before and right after each of an O_DIRECT disk arm's samples (the paired
and bracketed ratios). Every sample records the deltas of its tables' counters over the timed steps, with
hit_rate and read_ops_per_step; per disk arm and comparison the hit rates cold and warm, and, when the run
has a host-tier arm, the bound
bound_ms = host step ms + read ops per step / raw read ops/s x 1000 with ratio = disk step ms / bound_ms and
target_met = ratio <= 1.1, and after the comparison one lookup's reads timed as a raw call for
``--raw-read-seconds`` / 4, which gives the latency floor (floor_ms, floor_ratio): engram/bench/disk_bound.py.
On CUDA the disk tier's decode steps replay CUDA graphs too (its rows are copied in before the replay), so the
graph-replay check below holds for every tier.

Forced natural decoding: the corpus (``--corpus``, default the committed bench/corpus/natural-v1.jsonl,
SHA-256 checked) is tokenized with the loaded model's tokenizer into one token stream; for batch size B
sequence i decodes the window at offset i * len(stream) // B: ``--context-len`` prompt ids, then the next
max_tokens ids (``engine_steps.decode_max_tokens``), which it is forced to emit. The same windows serve
every arm and every sample of a batch size (paired samples): engram/bench/forced_windows.py.

One sample = ``engine_steps.measure_decode(engine, prompts, --decode-steps, --warmup-tokens,
forced=...)``: prefill, warm-up, then ``--decode-steps`` timed pure decode steps (each sequence gains
exactly one token per step, asserted there); the value is decode tokens/s = B * steps / sum(step wall
seconds), higher is better. After every sample the bench checks (``forced_windows.check_forced``,
``OutputMismatch`` otherwise) that every sequence's generated ids are its forced ids: all arms emitted the
same tokens, so they ran the same work. It also records the engine's ``lookup_exposed_s`` gained over the
timed steps (the engine times eager steps only: 0 without ``lookup_overlap``, on the CPU and for replayed
CUDA graphs, whose overlap only a profile shows; engine/lookup_stream.py) and ``graph_replays``, which must
equal the timed steps on CUDA unless ``--enforce-eager`` (0 where no graphs exist, on the CPU): a silent
eager fallback would make the comparison meaningless, so it stops the run (as does an engine without CUDA
graphs on CUDA).

Scheduling and statistics are ``engram.bench.stats.run_interleaved`` exactly as ``engram bench ab`` uses
them (A, A', B rounds in ABBA or ABAB order, ``--repeats`` recorded rounds after ``--warmup`` unrecorded
runs per arm, bootstrap CI of the median block ratio, A/A envelope, verdict), one run per (B arm, batch).

Output: the JSON of engram.bench.report (``--out``, default bench/results/<date>-placement-<model>.json):
``result.comparisons`` (per B arm and batch: the ABResult dict, the arms, per-sample records and per-arm
summaries; with a disk arm ``raw_reads`` and ``disk``, keyed by its label A or B), ``result.arms``,
``result.model``, ``result.tables`` (bytes per layer per placement: the tier, followed by the store
options that differ from --engram-config's if any), ``result.placements`` (per arm, its placement, and
per placement its effective store options), ``result.async_scheduling`` (per arm, whether its engine
schedules asynchronously), ``result.engine_config``, ``result.kv_cache_memory``, ``result.corpus`` (path, sha256) and
``result.windows`` (per batch: max_tokens, offsets, token_stats); a table with batch, arm B, tok/s of A and
B (medians), B/A median ratio and CI, A/A CI and verdict; with a disk arm a second table (batch, disk arm,
step ms, host step ms, read ops per step, raw read ops/s, bound ms, ratio, hit rates of the first warm-up
sample, the first recorded sample and the median); ``--plot FILE`` one PNG of samples in run order per
comparison (FILE's stem suffixed with ``-b<k>-batch<B>``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from engram.bench.disk_bound import (BOUND_FACTOR, DISK_COLUMNS, NO_HOST_ARM, add_bounds, disk_rows,
                                     measure_lookup_reads, measure_raw_reads, read_depth, sample_rate)
from engram.bench.engine_bench import _free_memory, _ints
from engram.bench.forced_windows import corpus_stream, cut_windows
from engram.bench.placement_arms import (DEFAULT_A, DEFAULT_B, ArmSpec, arm_store_options, parse_arm,
                                         parse_engram_options, placement_name)
from engram.bench.placement_compare import GraphFallback, run_comparison, table_row
from engram.bench.stats import ORDERS
from engram.commands.options import parse_bytes
from engram.model import kernel_switches

HELP = "Engram table placements / lookup options A/B'd in one process over forced natural decoding (A/A, CI)."
CUDA_MODEL, CPU_MODEL = "4b-like", "tiny"
DEFAULT_CORPUS_NAME = "bench/corpus/natural-v1.jsonl"  # serve_load.DEFAULT_CORPUS, as the result records it
TABLE_COLUMNS = ["batch", "arm B", "tok/s A", "tok/s B", "B/A", "B/A CI", "A/A CI", "verdict"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"preset (default: {CUDA_MODEL} on CUDA, {CPU_MODEL} on the CPU)")
    p.add_argument("--engram-config", default=None, metavar="JSON",
                   help='loader and table options every arm shares, e.g. \'{"tables_in_memory": true, '
                        '"load_threads": 16, "table_rows": 131000000}\' (not cpu_offload / lookup_overlap)')
    p.add_argument("--a", default=DEFAULT_A, metavar="JSON",
                   help=f'arm A (the baseline): keys tier (gpu|host|disk), lookup_overlap, wkv_run_ahead, '
                        f'async_scheduling (default: the engine\'s choice) and options (table options overriding '
                        f'--engram-config\'s for this arm, e.g. {{"io": "direct", "cache_rows": 200000}}) '
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
                   help="O_DIRECT disk arms: seconds of the same raw reads right before each of the arm's samples "
                        "and right after its timed steps too (the paired and bracketed bounds: each sample against "
                        "the rate of the disk as it was then; 0: off; default 0.25)")
    p.add_argument("--raw-read-pages", type=int, default=16384, metavar="N",
                   help="disk arms: pages per raw read call (default 16384 = 64 MiB, as in engram bench lookup "
                        "--raw-pages)")
    p.add_argument("--batch-sizes", default="1,64", help="decode batch sizes, comma-separated")
    p.add_argument("--context-len", type=int, default=512, help="prompt tokens per sequence (a corpus window)")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per sample")
    p.add_argument("--warmup-tokens", type=int, default=3, help="tokens every sequence decodes before timing")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="engine token budget per step (prefill chunks), raised to the largest batch")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="sequences every arm's engine is built for (its decode graphs' buckets, slabs, default KV "
                        "budget); default: the largest batch; at least that")
    p.add_argument("--kv-cache-memory", type=lambda t: parse_bytes(t, "--kv-cache-memory"), default=None,
                   metavar="BYTES",
                   help="one KV budget for every arm's engine: bytes, or with a unit (512MiB, 8GiB, 8G); default: "
                        "sized for the largest batch at full length plus Engram staging and hot-row caches")
    p.add_argument("--repeats", type=int, default=10, metavar="N", help="recorded runs per arm (default 10)")
    p.add_argument("--warmup", type=int, default=1, metavar="K", help="unrecorded runs per arm (default 1)")
    p.add_argument("--order", choices=ORDERS, default="abba", help="abba (default) cancels linear drift")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--corpus", default=None, metavar="FILE",
                   help="request corpus (engram bench corpus; default: the committed bench/corpus/natural-v1.jsonl)")
    p.add_argument("--enforce-eager", action="store_true", help="engines without CUDA graphs (vLLM's name)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/<date>-placement-<model>.json)")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="PNG of samples in run order, one per comparison (FILE's stem suffixed -b<k>-batch<B>)")
    p.add_argument("--quiet", action="store_true", help="no per-run progress on stderr")


# ----------------------------------------------------------------- the pieces that live for the run
def table_info(tables: dict) -> dict:
    """Per Engram layer: the table's type, rows, device, bytes of its storage (values and scales, a shared
    buffer counted once) and of its hot-row cache."""
    out = {}
    for lid, t in tables.items():
        storages = {}
        for x in (getattr(t, "values", None), getattr(t, "scales", None)):
            if x is not None:
                s = x.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        cache = getattr(t, "cache", None)
        values = getattr(t, "values", None)
        out[str(lid)] = {"type": type(t).__name__, "rows": t.rows,
                         "device": str(values.device) if values is not None else str(t.device),
                         "bytes": sum(storages.values()), "cache_bytes": cache.nbytes if cache is not None else 0}
    return out


def default_kv_budget(cfg, ecfg, dtype, tables_by_tier: dict) -> int:
    """Bytes for every sequence of the largest batch at max_model_len, the Engram staging of a full step
    and the largest hot-row cache of any tier (what an explicit budget pays first: engine/memory.py)."""
    from engram.engine.lookup import staging_bytes
    from engram.model.kv_cache import KVCache

    per_block = KVCache.for_model(cfg, 1, ecfg.block_size, dtype, "meta").bytes_per_block()
    staging = staging_bytes(cfg.engram, ecfg.max_num_batched_tokens, dtype) if cfg.engram else 0
    cache = max((sum(t.cache.nbytes for t in tabs.values() if getattr(t, "cache", None) is not None)
                 for tabs in tables_by_tier.values()), default=0)
    blocks = ecfg.max_num_seqs * -(-ecfg.max_model_len // ecfg.block_size)
    return staging + cache + blocks * per_block


# ----------------------------------------------------------------- the command
def _reads_together(arm: ArmSpec, tables: dict, step_ids: int) -> bool:
    """Whether ``arm``'s decode steps of ``step_ids`` row ids a table read its tables side by side
    (``lookup.reads_together`` under the arm's kernel switches)."""
    from engram.engine import lookup

    with kernel_switches.applied(dict(arm.switches)):
        return lookup.reads_together(step_ids, lookup.read_queue_depth(tables[min(tables)]))


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from engram.bench import stats
    from engram.bench.corpus import CorpusError, encode_corpus, load_corpus, load_tokenizer, token_stats
    from engram.bench.engine_bench import Settings, engine_config
    from engram.bench.engine_steps import decode_max_tokens
    from engram.bench.report import args_config, format_table, write_result
    from engram.bench.serve_load import DEFAULT_CORPUS
    from engram.engine.engine import LLMEngine
    from engram.engine.heap import freeze_startup_heap, thaw_heap
    from engram.model.loader import random_model, resolve_dtype
    from engram.model.presets import MODEL_PRESETS, preset_config

    # Everything the command line says is checked before anything loads.
    arm_a = parse_arm(args.a, "--a")
    b_texts = args.b or [DEFAULT_B]
    arms_b = [parse_arm(text, f"--b[{k}]") for k, text in enumerate(b_texts, start=1)]
    opts = parse_engram_options(args.engram_config)
    options_of = [("--a", arm_a)] + [(f"--b[{k}]", arm) for k, arm in enumerate(arms_b, start=1)]
    # each arm's options over the shared ones, validated by StoreOptions (unknown keys, values, combinations)
    stores = [arm_store_options(arm, opts.store, option) for option, arm in options_of]
    store_of = dict(zip((arm for _, arm in options_of), stores))
    for option, arm in options_of:
        if arm.tier == "disk" and opts.tables_in_memory:
            raise SystemExit(f"{option} is on tier 'disk', which reads the tables from their files, but "
                             f"--engram-config has tables_in_memory=true (tables built in memory, no files): drop "
                             f"tables_in_memory to generate the tables into --cache-dir")
    if args.raw_read_seconds <= 0 or args.raw_read_pages < 1 or args.raw_read_sample_seconds < 0:
        raise SystemExit(f"--raw-read-seconds={args.raw_read_seconds} must be > 0, --raw-read-sample-seconds="
                         f"{args.raw_read_sample_seconds} >= 0 and --raw-read-pages={args.raw_read_pages} >= 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    model = args.model or (CUDA_MODEL if device.type == "cuda" else CPU_MODEL)
    if model not in MODEL_PRESETS:
        raise SystemExit(f"--model: {model!r} is not among the presets {MODEL_PRESETS}")
    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    for option in ("context_len", "decode_steps", "warmup_tokens", "max_num_batched_tokens"):
        if getattr(args, option) < 1:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)} must be >= 1")
    try:
        ab_cfg = stats.ABConfig(repeats=args.repeats, order=args.order, warmup=args.warmup, higher_is_better=True,
                                seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"engram bench placement: {e}") from None
    kv_budget = args.kv_cache_memory
    try:
        cfg = preset_config(model, table_rows=opts.table_rows, seed=opts.seed)
    except ValueError as e:
        raise SystemExit(f"--engram-config: {e}") from None
    if cfg.engram is None:
        raise SystemExit(f"--model {model}: the preset has no Engram layers to place")
    s = Settings(batch_sizes, args.context_len, args.decode_steps, args.warmup_tokens, profile_steps=0,
                 prefill_shapes=(), prefill_repeats=1, max_num_batched_tokens=args.max_num_batched_tokens,
                 seed=opts.seed, enforce_eager=args.enforce_eager)
    ecfg = engine_config(s, cfg.max_position_embeddings)  # refuses a context too long for the model
    if args.max_num_seqs is not None:
        if args.max_num_seqs < ecfg.max_num_seqs:
            raise SystemExit(f"--max-num-seqs={args.max_num_seqs} must be at least the largest batch "
                             f"({ecfg.max_num_seqs})")
        ecfg = dataclasses.replace(ecfg, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=max(ecfg.max_num_batched_tokens, args.max_num_seqs))
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

    arms = list(dict.fromkeys([arm_a, *arms_b]))  # distinct arms, one engine each
    placement_of = {arm: placement_name(arm.tier, store_of[arm], opts.store) for arm in arms}
    placements = {placement_of[arm]: (arm.tier, store_of[arm]) for arm in arms}  # distinct (tier, options)
    say(f"loading {model} ({dtype}, {device}); placements {list(placements)}; {len(arms)} engines")
    base = random_model(cfg, arms[0].tier, dtype, device, opts.seed, cache_dir=args.cache_dir, opts=opts,
                        progress=not args.quiet)
    tables: dict[str, dict] = {}
    engines: dict[ArmSpec, object] = {}
    async_of: dict[str, bool] = {}  # per arm: whether its engine schedules asynchronously
    frozen = False
    try:
        for name, (tier, store) in placements.items():  # each placement's tables once: at ~33 GiB a layer
            tables[name] = dataclasses.replace(base, tables={}, tier=tier, store_options=store).open_tables()
        tables_info = {name: table_info(tabs) for name, tabs in tables.items()}  # before they close
        tokenizer = load_tokenizer("builtin")  # every preset's (random_model loads it)
        stream = corpus_stream(encode_corpus(corpus, tokenizer), cfg.vocab_size)
        if kv_budget is None:
            kv_budget, kv_source = default_kv_budget(cfg, ecfg, dtype, tables), "sized for the largest batch"
        else:
            kv_source = "--kv-cache-memory"
        ecfg = dataclasses.replace(ecfg, kv_cache_memory=kv_budget)
        for arm in arms:
            loaded = dataclasses.replace(base, tables=tables[placement_of[arm]], tier=arm.tier,
                                         store_options=store_of[arm], lookup_overlap=arm.lookup_overlap,
                                         wkv_run_ahead=arm.wkv_run_ahead)
            with kernel_switches.applied(dict(arm.switches)):  # captured into the arm's decode graphs
                engines[arm] = LLMEngine(loaded, dataclasses.replace(ecfg, async_scheduling=arm.async_scheduling),
                                         device, dtype)
            async_of[arm.name] = engines[arm]._async()
            graphs = engines[arm].executor.worker.graphs
            if device.type == "cuda" and not args.enforce_eager and (
                    graphs is None or max(batch_sizes) > ecfg.max_graph_batch):
                raise GraphFallback(f"arm {arm.name}: decode steps would run eagerly (no CUDA graphs for this "
                                    f"dtype/model, or a batch above max_graph_batch={ecfg.max_graph_batch}); "
                                    f"pass --enforce-eager to compare eager steps")
        freeze_startup_heap()  # as engram serve does (engine/heap.py); thawed before the tables close
        frozen = True

        comparisons, windows_info, rows = [], {}, []
        n_cols = base.model_config.engram.n_cols  # row ids per token per table: a decode step's b * n_cols
        for b in batch_sizes:
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
                        depth = read_depth(tabs, together=_reads_together(arm, tabs, b * n_cols))
                        raw = measure_raw_reads(tabs, args.raw_read_seconds, args.raw_read_pages, opts.seed, depth)
                        say(f"batch {b}: raw random reads for {label} {arm.name}: {raw['read_ops_per_s']:.4g} ops/s "
                            f"({raw['io']}, queue depth {raw['queue_depth']})")
                        disk[label] = (raw, fresh, placement_of[arm])
                rates = {label: sample_rate(tables[placement], args.raw_read_sample_seconds, args.raw_read_pages,
                                            opts.seed, raw["queue_depth"])
                         for label, (raw, _, placement) in disk.items()
                         if args.raw_read_sample_seconds > 0 and raw["io"] == "direct"}  # (disk_bound.py)
                say(f"batch {b}: A {arm_a.name} vs B {arm_b.name}")
                result, comparison = run_comparison(engines, arm_a, arm_b, k, b, win, s, ab_cfg, args.quiet, disk,
                                                    rates)
                for label, d in comparison.get("disk", {}).items():  # one lookup's reads as a raw call, after
                    tabs = tables[disk[label][2]]
                    d["lookup_reads"] = measure_lookup_reads(tabs, d["read_ops_per_step_median"],
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
        _free_memory(device)

    result = {"model": {"name": model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                        "engram_layers": list(cfg.engram.layer_ids),
                        "table_rows": {str(l): cfg.engram.table_rows(l) for l in cfg.engram.layer_ids}},
              "arms": {"A": arm_a.to_dict(), "B": [a.to_dict() for a in arms_b]},
              "engram_config": json.loads(json.dumps(dataclasses.asdict(opts), default=str)),
              "tables": tables_info,
              "placements": {"arms": {arm.name: placement_of[arm] for arm in arms},
                             "store_options": {name: store.to_dict() for name, (_, store) in placements.items()}},
              "async_scheduling": async_of,
              "engine_config": dataclasses.asdict(ecfg),
              "kv_cache_memory": {"bytes": kv_budget, "source": kv_source, "kv_blocks": kv_blocks},
              "settings": {"batch_sizes": list(batch_sizes), "context_len": s.context_len,
                           "decode_steps": s.decode_steps, "warmup_tokens": s.warmup_tokens,
                           "enforce_eager": args.enforce_eager, "ab": dataclasses.asdict(ab_cfg),
                           "raw_read_seconds": args.raw_read_seconds, "raw_read_pages": args.raw_read_pages,
                           "raw_read_sample_seconds": args.raw_read_sample_seconds,
                           "bound_factor": BOUND_FACTOR},
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
                  "paired ratio = median over samples of step ms / (host step ms + read ops/step / the raw rate "
                  "right before the sample); bracketed ratio: the same at the harmonic mean of the rates right "
                  "before and right after it; floor = host step ms + one lookup's reads as a raw call")
    for c in comparisons:
        for w in c["ab"]["warnings"]:
            print(f"warning: batch {c['batch']} b{c['b_index']}: {w}")
    print(f"result: {path}")
    return 0
