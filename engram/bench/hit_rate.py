"""``engram bench hit-rate``: hot-row cache hit rate against its size, on natural text, per Engram layer. Per case
(layout, tokenizer) the corpus is served (serving_trace.py) and hashed into one row trace per layer (distinct rows per
step, as the cache counts). On each trace: LRU at every size (stack_distance.py) and, with ``--rowcache``, the engine's
``RowCache``; cold and warm, by n-gram order, against the infinite cache; and distinct rows per token as the text grows.
A tokenizer with another compressed vocabulary gets the layout with its own."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from engram.bench.serving_trace import LayerTrace
from engram.bench.stack_distance import lru_hits, reuse_index, stack_distances

HELP = "hot-row cache hit rate vs size on a natural-text corpus: LRU (stack distances), RowCache, cold/warm, per order"
SIZES_PCT = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
GROWTH_TOKENS = (1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000)
CURVE_POINTS = 49  # LRU curve: log-spaced sizes from 0.01 % to 100 % of the table


def summarize(hits: np.ndarray, order: np.ndarray, start: int = 0) -> dict[str, Any]:
    """Hits, accesses and rate of ``hits[start:]``, overall and per n-gram order."""
    h, o = hits[start:], order[start:]
    orders = np.unique(order).tolist()
    by = {}
    for n in orders:
        m = o == n
        acc, hit = int(m.sum()), int(h[m].sum())
        by[str(n)] = {"hits": hit, "accesses": acc, "rate": hit / acc if acc else None}
    acc, hit = int(h.size), int(h.sum())
    return {"hits": hit, "accesses": acc, "rate": hit / acc if acc else None, "by_order": by}


def cold_warm(hits: np.ndarray, order: np.ndarray, warm_start: int) -> dict[str, Any]:
    return {"cold": summarize(hits, order), "warm": summarize(hits, order, warm_start)}


def rowcache_hits(trace: LayerTrace, capacity: int, policy: str, ways: int = 8) -> tuple[np.ndarray, int]:
    """Hit flags of the engine's ``RowCache`` fed each step's distinct rows, and its actual capacity."""
    import torch

    from engram.store.cache import RowCache

    cache = RowCache(capacity, value_bytes=1, policy=policy, ways=ways)
    hits = np.ones(trace.accesses, dtype=bool)
    missed: list[torch.Tensor] = []

    def fetch(ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        missed.append(ids)
        return torch.zeros((ids.numel(), 1), dtype=torch.uint8), None

    rows, bounds = trace.rows, trace.step_bounds
    for s in range(bounds.size - 1):
        a, b = int(bounds[s]), int(bounds[s + 1])
        if a == b:
            continue
        step_rows = rows[a:b]
        missed.clear()
        cache.fetch(torch.from_numpy(step_rows), fetch)
        if missed:  # the cache passes the misses in input order: a sorted subsequence of step_rows
            hits[a + np.searchsorted(step_rows, missed[0].numpy())] = False
    return hits, cache.capacity


def warm_start_of(trace: LayerTrace, warmup: float) -> int:
    """First access of the first step that starts at or after ``warmup`` of the accesses."""
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup={warmup}: must be a fraction in [0, 1)")
    b = trace.step_bounds
    return int(b[np.searchsorted(b, warmup * trace.accesses, side="left")])


def lru_curve(dist: np.ndarray, table_rows: int, warm_start: int) -> dict[str, Any]:
    """LRU hit rate at ``CURVE_POINTS`` log-spaced sizes (share of table rows), cold and warm."""
    pct = np.logspace(-2, 2, CURVE_POINTS)
    cap = np.maximum(1, np.round(pct / 100 * table_rows)).astype(np.int64)
    out: dict[str, Any] = {"pct": pct.tolist(), "rows": cap.tolist()}
    for name, d in (("cold", dist), ("warm", dist[warm_start:])):
        reused = np.sort(d[d >= 0])
        out[name] = (np.searchsorted(reused, cap, side="left") / max(d.size, 1)).tolist()
    return out


def distinct_growth(trace: LayerTrace) -> list[dict[str, Any]]:
    """Distinct rows touched by the first 1 K, 2 K, 5 K, ... tokens and by all (per token, per order, share)."""
    t, n_cols = trace.text_rows.shape
    first = reuse_index(trace.text_rows.reshape(-1))[0] < 0
    per_order = np.cumsum(first.reshape(t, n_cols // trace.n_heads, trace.n_heads).sum(axis=2), axis=0)
    out = []
    for k in [x for x in GROWTH_TOKENS if x < t] + [t]:
        distinct = int(per_order[k - 1].sum())
        row = {"tokens": k, "distinct_rows": distinct, "per_token": distinct / k,
               "table_share": distinct / trace.table_rows}
        for i, n in enumerate(range(2, 2 + n_cols // trace.n_heads)):
            row[f"per_token_order_{n}"] = int(per_order[k - 1, i]) / k
        out.append(row)
    return out


def analyze_layer(trace: LayerTrace, sizes_pct: tuple[float, ...], policies: tuple[str, ...], ways: int,
                  warmup: float) -> dict[str, Any]:
    """Everything the bench reports for one layer's trace."""
    t0 = time.perf_counter()
    prev, _ = reuse_index(trace.rows)
    dist = stack_distances(trace.rows, prev)
    seconds = {"lru": time.perf_counter() - t0, "rowcache": 0.0}
    warm = warm_start_of(trace, warmup)
    reuse = prev >= 0
    sizes = []
    for pct in sizes_pct:
        cap = max(1, int(round(pct / 100 * trace.table_rows)))
        entry: dict[str, Any] = {"pct": pct, "rows": cap, "lru": cold_warm(lru_hits(dist, cap), trace.order, warm)}
        for policy in policies:
            t1 = time.perf_counter()
            hits, actual = rowcache_hits(trace, cap, policy, ways)
            seconds["rowcache"] += time.perf_counter() - t1
            entry[f"rowcache_{policy}"] = {"capacity": actual, **cold_warm(hits, trace.order, warm)}
        sizes.append(entry)
    return {
        "layer_id": trace.layer_id, "table_rows": trace.table_rows, "lookups": trace.lookups,
        "accesses": trace.accesses, "steps": int(trace.step_bounds.size - 1),
        "distinct_rows": int((~reuse).sum()),
        "warm_start": {"access": warm, "step": int(np.searchsorted(trace.step_bounds, warm, side="right") - 1)},
        "infinite_cache": cold_warm(reuse, trace.order, warm),
        "sizes": sizes, "lru_curve": lru_curve(dist, trace.table_rows, warm),
        "growth": distinct_growth(trace), "seconds": seconds,
    }


def layout_config(name: str, table_rows: int | None = None):
    """The EngramConfig of a model preset (``table_rows`` for TABLE_ROWS_PRESETS) or of an ``EngramConfig.preset``."""
    from engram.config import EngramConfig
    from engram.model.presets import MODEL_PRESETS, TABLE_ROWS_PRESETS, preset_config

    if name in MODEL_PRESETS:
        return preset_config(name, table_rows=table_rows if name in TABLE_ROWS_PRESETS else None).engram
    return EngramConfig.preset(name)


@dataclass
class CaseTraces:
    """A (layout, tokenizer) case's corpus served and hashed: one row trace per Engram layer, and what made it."""
    traces: list  # [LayerTrace] per Engram layer
    tok: Any  # the tokenizer (engram.bench.corpus.load_tokenizer)
    ctok: Any  # its CompressedTokenizer
    base: Any  # the layout's EngramConfig
    cfg: Any  # the same with the tokenizer's compressed vocabulary when they differ
    hasher: Any  # NgramHasher
    schedule: Any  # serving_trace.ServingSchedule


def case_traces(corpus, layout: str, tokenizer: str, *, concurrency: int,
                table_rows: int | None = None) -> CaseTraces:
    """Each layer's row trace of ``corpus`` under ``layout`` and ``tokenizer``, served ``concurrency`` at a time."""
    from engram.bench.corpus import encode_corpus, load_tokenizer
    from engram.bench.serving_trace import compressed_sequences, layer_traces, serving_schedule
    from engram.hashing import NgramHasher
    from engram.tokenizer import CompressedTokenizer

    tok = load_tokenizer(tokenizer)
    encoded = encode_corpus(corpus, tok)
    ctok = CompressedTokenizer.from_file(tok.path)
    base = layout_config(layout, table_rows)
    cfg = base if len(ctok) == base.compressed_vocab_size else base.replace(compressed_vocab_size=len(ctok))
    hasher = NgramHasher.from_tokenizer(cfg, ctok)
    schedule = serving_schedule(np.array([p.size for p, _ in encoded]), np.array([c.size for _, c in encoded]),
                                concurrency)
    traces = layer_traces(compressed_sequences(encoded, ctok, cfg.dead_token_ids), schedule, hasher)
    return CaseTraces(traces, tok, ctok, base, cfg, hasher, schedule)


def run_case(corpus, layout: str, tokenizer: str, *, concurrency: int, sizes_pct: tuple[float, ...],
             policies: tuple[str, ...], ways: int, warmup: float, table_rows: int | None = None,
             log=print) -> dict[str, Any]:
    """One (layout, tokenizer) case over ``corpus`` (``case_traces``): per-layer analyses."""
    case = case_traces(corpus, layout, tokenizer, concurrency=concurrency, table_rows=table_rows)
    traces, tok, ctok, base, cfg, hasher, schedule = (case.traces, case.tok, case.ctok, case.base, case.cfg,
                                                      case.hasher, case.schedule)
    layers = []
    for trace in traces:
        layers.append(analyze_layer(trace, sizes_pct, policies, ways, warmup))
        done = layers[-1]
        log(json.dumps({"layout": layout, "tokenizer": tok.name, "layer": trace.layer_id,
                        "accesses": trace.accesses, "distinct_rows": done["distinct_rows"],
                        "lru_warm": {s["pct"]: round(s["lru"]["warm"]["rate"], 4) for s in done["sizes"]},
                        "seconds": {k: round(v, 1) for k, v in done["seconds"].items()}}), flush=True)
    return {"layout": layout, "tokenizer": {**tok.info(), "compressed_vocab_size": len(ctok)},
            "engram": {"compressed_vocab_size": cfg.compressed_vocab_size,
                       "layout_compressed_vocab_size": base.compressed_vocab_size,
                       "compressed_vocab_size_replaced": cfg is not base, "pad_token_id": cfg.pad_token_id,
                       "pad_compressed_id": hasher.pad_id, "layer_ids": list(cfg.layer_ids), "n_cols": cfg.n_cols,
                       "orders": list(cfg.orders), "table_rows": [cfg.table_rows(lid) for lid in cfg.layer_ids]},
            "tokens": int(schedule.token_step.size), "steps": schedule.steps, "concurrency": concurrency,
            "layers": layers}


def _rate(x: dict[str, Any]) -> float | None:
    return x["rate"]


def size_rows(case: dict[str, Any], policies: tuple[str, ...]) -> list[dict[str, Any]]:
    """One table row per (layer, size): LRU and RowCache rates cold / warm, and warm LRU per order."""
    out = []
    for layer in case["layers"]:
        for s in layer["sizes"]:
            row = {"layout": case["layout"], "tokenizer": case["tokenizer"]["name"].split("/")[0],
                   "layer": layer["layer_id"], "size %": s["pct"], "rows": s["rows"],
                   "LRU cold": _rate(s["lru"]["cold"]), "LRU warm": _rate(s["lru"]["warm"])}
            for policy in policies:
                rc = s[f"rowcache_{policy}"]
                row[f"RowCache {policy} cold"] = _rate(rc["cold"])
                row[f"RowCache {policy} warm"] = _rate(rc["warm"])
            for n, v in s["lru"]["warm"]["by_order"].items():
                row[f"LRU warm {n}-gram"] = v["rate"]
            out.append(row)
        inf = layer["infinite_cache"]
        out.append({"layout": case["layout"], "tokenizer": case["tokenizer"]["name"].split("/")[0],
                    "layer": layer["layer_id"], "size %": "inf", "rows": layer["distinct_rows"],
                    "LRU cold": _rate(inf["cold"]), "LRU warm": _rate(inf["warm"])})
    return out


def growth_rows(case: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"layout": case["layout"], "tokenizer": case["tokenizer"]["name"].split("/")[0],
             "layer": layer["layer_id"], **g} for layer in case["layers"] for g in layer["growth"]]


def plot(cases: list[dict[str, Any]], path: str, policies: tuple[str, ...]) -> None:
    """Hit rate vs cache size per case (top) and distinct rows per token as the text grows (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(cases), figsize=(5.2 * len(cases), 8.4), squeeze=False)
    markers = {"lfu": "x", "lru": "+"}
    for k, case in enumerate(cases):
        ax, gx = axes[0][k], axes[1][k]
        for i, layer in enumerate(case["layers"]):
            color = f"C{i}"
            lid, curve = layer["layer_id"], layer["lru_curve"]
            ax.plot(curve["pct"], curve["warm"], color=color, label=f"layer {lid} LRU warm")
            ax.plot(curve["pct"], curve["cold"], color=color, ls="--", lw=0.8, label=f"layer {lid} LRU cold")
            ax.axhline(layer["infinite_cache"]["warm"]["rate"], color=color, ls=":", lw=0.8)
            for policy in policies:
                pts = [(s["pct"], s[f"rowcache_{policy}"]["warm"]["rate"]) for s in layer["sizes"]]
                ax.plot(*zip(*pts), marker=markers[policy], ls="none", color=color, ms=4,
                        label=f"layer {lid} RowCache {policy} warm")
            g = layer["growth"]
            gx.plot([x["tokens"] for x in g], [x["per_token"] for x in g], color=color, marker=".",
                    label=f"layer {lid}, all orders")
            if i == 0:
                for j, n in enumerate(case["engram"]["orders"]):
                    gx.plot([x["tokens"] for x in g], [x[f"per_token_order_{n}"] for x in g], color="0.4",
                            ls=("--", "-.", ":")[j % 3], lw=0.9, label=f"layer {lid}, {n}-grams")
        tok = case["tokenizer"]
        title = f"{case['layout']}\n{tok['name'].split('/')[0]} ({tok['compressed_vocab_size']} compressed ids)"
        ax.set(xscale="log", xlabel="cache size, % of table rows", ylabel="hit rate", ylim=(0, 1), title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
        gx.set(xscale="log", xlabel="tokens of text (requests in corpus order)", ylabel="distinct rows touched / token",
               ylim=(0, case["engram"]["n_cols"] * 1.05))
        gx.grid(True, which="both", alpha=0.3)
        gx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _floats(text: str, option: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"{option}={text!r}: expected comma-separated numbers") from None
    if not vals or any(not 0 < v <= 100 for v in vals):
        raise SystemExit(f"{option}={text!r}: sizes are percentages of table rows in (0, 100]")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", required=True, help="corpus file from `engram bench corpus` (its SHA-256 is checked)")
    p.add_argument("--case", action="append", default=None, metavar="LAYOUT=TOKENIZER",
                   help="layout (model preset such as 4b-like, or an EngramConfig preset such as deepseek-v4.1-flash) "
                        "= tokenizer (builtin, pkg:PACKAGE/PATH or a tokenizer.json); repeatable "
                        "(default: 4b-like=builtin and deepseek-v4.1-flash=builtin)")
    p.add_argument("--sizes", default=",".join(f"{x:g}" for x in SIZES_PCT), help="cache sizes, %% of table rows")
    p.add_argument("--rowcache", default="none",
                   help="also simulate the engine's RowCache per size: lfu, lru, both or none (slow)")
    p.add_argument("--ways", type=int, default=8, help="RowCache ways per set")
    p.add_argument("--concurrency", type=int, default=64, help="requests served at once")
    p.add_argument("--warmup", type=float, default=0.5, help="share of the accesses before warm statistics start")
    p.add_argument("--requests", type=int, default=None, help="use the corpus's first N requests (default all)")
    p.add_argument("--table-rows", type=int, default=None, help="rows per Engram layer of 4b-like / 8b-like")
    p.add_argument("--plot", default=None, help="PNG: hit rate vs size and distinct rows per token")
    p.add_argument("--name", default="hit-rate", help="result name")
    p.add_argument("--out", default=None, help="JSON path (default: a fresh file in a temporary directory)")


def run(args: argparse.Namespace) -> int:
    from engram.bench.corpus import CorpusError, load_corpus
    from engram.bench.report import args_config, format_table, write_result

    sizes = _floats(args.sizes, "--sizes")
    policies = {"none": (), "both": ("lfu", "lru")}.get(args.rowcache, tuple(x for x in args.rowcache.split(",") if x))
    if any(x not in ("lfu", "lru") for x in policies):
        raise SystemExit(f"--rowcache={args.rowcache!r}: expected lfu, lru, both or none")
    try:
        corpus = load_corpus(args.corpus)
    except (CorpusError, OSError) as e:
        raise SystemExit(f"engram bench hit-rate: {e}") from None
    if args.requests is not None:
        if not 1 <= args.requests <= len(corpus.requests):
            raise SystemExit(f"--requests={args.requests}: the corpus holds {len(corpus.requests)}")
        corpus.requests = corpus.requests[: args.requests]
    cases = []
    t0 = time.perf_counter()
    for spec in args.case or ["4b-like=builtin", "deepseek-v4.1-flash=builtin"]:
        layout, sep, tokenizer = spec.partition("=")
        if not sep or not layout or not tokenizer:
            raise SystemExit(f"--case={spec!r}: expected LAYOUT=TOKENIZER")
        try:
            cases.append(run_case(corpus, layout, tokenizer, concurrency=args.concurrency, sizes_pct=sizes,
                                  policies=policies, ways=args.ways, warmup=args.warmup, table_rows=args.table_rows))
        except ValueError as e:
            raise SystemExit(f"engram bench hit-rate: case {spec!r}: {e}") from None
    result = {"corpus": {"path": str(args.corpus), "sha256": corpus.sha256,
                         "requests": len(corpus.requests), "header": corpus.header},
              "seconds": time.perf_counter() - t0, "cases": cases}
    path = write_result(args.name, args_config(args), result, out=args.out)
    table = [r for c in cases for r in size_rows(c, policies)]
    print(format_table(table, floatfmt="{:.3f}"))
    print()
    print(format_table([r for c in cases for r in growth_rows(c)], floatfmt="{:.4g}"))
    if args.plot:
        plot(cases, args.plot, policies)
        print(f"plot: {args.plot}")
    print(f"json: {path}")
    return 0

