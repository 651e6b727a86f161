"""`engram inspect`: show an Engram layout, the row ids of a text, or verify a table directory.

--preset takes every config name any command takes (engram/commands/config_names.py: the shipped deepseek-v4.1-flash and
paper-demo layouts, the model presets tiny, small, 4b-like, 8b-like, v4-small-like); --config a config.json, a
directory holding one, or such a name. A model preset's report adds its size ("model": parameters and bf16 bytes,
counted on the meta device).

Examples:
  engram inspect --preset deepseek-v4.1-flash
  engram inspect --preset tiny --text "Hello world"            (built-in tokenizer)
  engram inspect --preset 4b-like --json
  engram inspect --preset v4-small-like                         (its layout and size)
  engram inspect --config path/to/config.json --tokenizer path/to/tokenizer.json --text "..." --json
  engram convert --random --rows 100000 --dim 256 --out /tmp/t && engram inspect --verify /tmp/t
  engram inspect --verify ~/.cache/engram/tables/random-<key>/layer1
      (a preset's tables, generated on its first use: one random-<key> directory per layout and seed, one
      layer<N> table per Engram layer; ENGRAM_CACHE_DIR replaces ~/.cache/engram)

The row ids are what every engine must agree on: compare them column by column when yours disagree.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "show an Engram layout, the row ids a text hashes to, or verify a table directory"

BUILTIN_TOKENIZER = Path(__file__).resolve().parents[1] / "model" / "assets" / "tokenizer.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help="config name: deepseek-v4.1-flash (default), paper-demo, tiny, small, 4b-like, 8b-like, "
                          "v4-small-like")
    src.add_argument("--config", default=None,
                     help="HF config.json with engram_* fields, a directory holding one, or a config name")
    p.add_argument("--text", default=None, help="text whose compressed ids and row ids to print")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json for --text (default: the built-in tokenizer, which matches 'tiny')")
    p.add_argument("--verify", metavar="DIR", default=None, help="check a table directory's sizes and checksums")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def layout_report(cfg) -> dict:
    layers = []
    for lid in cfg.layer_ids:
        primes = cfg.primes(lid)
        layers.append({"layer_id": lid, "rows": cfg.table_rows(lid), "prime_sum": sum(primes),
                       "prime_min": min(primes), "prime_max": max(primes), "bytes": cfg.table_bytes(lid),
                       "multipliers": cfg.multipliers(lid)})
    return {"variant": cfg.variant, "orders": list(cfg.orders), "heads_per_order": cfg.n_heads, "n_cols": cfg.n_cols,
            "head_dim": cfg.head_dim, "row_dtype": cfg.row_dtype, "row_bytes": cfg.row_bytes,
            "compressed_vocab_size": cfg.compressed_vocab_size, "pad_token_id": cfg.pad_token_id,
            "layers": layers, "total_rows": sum(l["rows"] for l in layers),
            "total_bytes": sum(l["bytes"] for l in layers),
            "bytes_per_token": len(layers) * cfg.n_cols * cfg.row_bytes}


def model_report(name: str) -> dict:
    """A model preset's size in bf16 (loader.model_size: parameters, bytes, Engram tables), nothing allocated."""
    import torch

    from engram.model.presets import preset_config
    from engram.model.loader import model_size

    cfg = preset_config(name)
    return {"name": name, "architecture": cfg.architecture, "num_layers": cfg.num_layers, "dtype": "bfloat16",
            **model_size(cfg, torch.bfloat16)}


def text_report(cfg, tokenizer_path: Path, text: str) -> dict:
    import torch
    from tokenizers import Tokenizer

    from engram.hashing import NgramHasher
    from engram.tokenizer import CompressedTokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    ctok = CompressedTokenizer.from_file(tokenizer_path)
    hasher = NgramHasher.from_tokenizer(cfg, ctok)  # refuses a tokenizer of another compressed size
    enc = tok.encode(text, add_special_tokens=False)
    ids = torch.tensor(enc.ids, dtype=torch.int64)
    comp = ctok.compress(ids, cfg.dead_token_ids)
    rows = {lid: hasher.hash(comp[None], lid)[0].tolist() for lid in cfg.layer_ids}
    return {"tokens": enc.tokens, "ids": enc.ids, "compressed_ids": comp.tolist(),
            "compressed_pad_id": hasher.pad_id, "rows": rows}


def _print_layout(r: dict) -> None:
    from engram.store.preflight import fmt_bytes

    print(f"variant {r['variant']}: orders {r['orders']} x {r['heads_per_order']} heads = {r['n_cols']} columns, "
          f"rows of {r['head_dim']} {r['row_dtype']} ({r['row_bytes']} B)")
    print(f"compressed vocab {r['compressed_vocab_size']}, pad token {r['pad_token_id']}")
    print(f"{'layer':>5} {'rows':>14} {'prime range':>25} {'bytes':>12}")
    for l in r["layers"]:
        print(f"{l['layer_id']:>5} {l['rows']:>14,} {l['prime_min']:>12,}..{l['prime_max']:<12,} "
              f"{fmt_bytes(l['bytes']):>12}")
    print(f"{'total':>5} {r['total_rows']:>14,} {'':>25} {fmt_bytes(r['total_bytes']):>12}")
    print(f"row bytes fetched per token: {r['bytes_per_token']:,}")


def _print_model(r: dict) -> None:
    from engram.store.preflight import fmt_bytes

    print(f"model {r['name']} ({r['architecture']}, {r['num_layers']} layers): {r['parameters'] / 1e9:.2f} B "
          f"parameters ({r['routed_expert_parameters'] / 1e9:.2f} B routed experts, {r['engram_parameters'] / 1e9:.2f} "
          f"B Engram), {fmt_bytes(r['parameter_bytes'] + r['buffer_bytes'])} in {r['dtype']}, tables "
          f"{fmt_bytes(r['table_bytes'])}")


def _print_text(r: dict, cfg) -> None:
    print(f"\ncompressed pad id {r['compressed_pad_id']}")
    print(f"{'pos':>4} {'token':<16} {'id':>7} {'cid':>7}")
    for i, (t, raw, c) in enumerate(zip(r["tokens"], r["ids"], r["compressed_ids"])):
        print(f"{i:>4} {t!r:<16} {raw:>7} {c:>7}")
    for lid, rows in r["rows"].items():
        print(f"\nlayer {lid} row ids (columns: " + " | ".join(f"{n}-gram x{cfg.n_heads}" for n in cfg.orders) + ")")
        for i, cols in enumerate(rows):
            print(f"{i:>4} " + " ".join(str(x) for x in cols))


def run(args: argparse.Namespace) -> int:
    from engram.config import EngramConfig
    from engram.commands.config_names import named_config, resolve_config
    from engram.model.presets import MODEL_PRESETS

    if args.verify:
        from engram.store.verify import verify_table

        report = verify_table(args.verify, progress=not args.json)
        print(json.dumps(report.to_dict(), indent=2))
        for err in report.errors:
            print(f"FAILED: {err}", file=sys.stderr)
        return 0 if report.ok else 1
    try:
        if args.config:
            raw = resolve_config(args.config, "--config")
        else:
            raw = named_config(args.preset or ("tiny" if args.text and not args.tokenizer else "deepseek-v4.1-flash"))
        cfg = EngramConfig.from_hf_config(raw)
        out = {"layout": layout_report(cfg)}
        name = args.config or args.preset
        if name in MODEL_PRESETS:
            out["model"] = model_report(name)
        if args.text is not None:
            tokenizer = Path(args.tokenizer) if args.tokenizer else BUILTIN_TOKENIZER
            out["text"] = text_report(cfg, tokenizer, args.text)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print_layout(out["layout"])
    if "model" in out:
        _print_model(out["model"])
    if "text" in out:
        _print_text(out["text"], cfg)
    return 0
