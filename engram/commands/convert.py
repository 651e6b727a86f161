"""`engram convert`: build Engram table directories from safetensors checkpoints or from a seed."""
from __future__ import annotations

import argparse
import json
import sys
import time

HELP = ("build Engram table directories from safetensors shards (V4.1 names, FP8 or BF16/FP32) or random bytes; "
        "add page checksums to older tables")

EPILOG = """\
sources:
  safetensors shards (files or directories of *.safetensors), DeepSeek-V4.1 names, one table per layer:
      [model.]layers.L.engram.embed.weight  F8_E4M3 [rows, dim]   (+ ...embed.scale  F8_E8M0 [rows, dim/32])
      -> OUT/layer_L.   engram convert /ckpt/ --out tables/            (all layers found)
                        engram convert /ckpt/ --out tables/ --layers 1,14 --config /ckpt/config.json
  bf16 / fp16 / fp32 tables under the same names (no scale tensor): kept in their dtype, or MXFP8 with
      --quantize mxfp8.  engram convert emb.safetensors --out tables/ --quantize mxfp8
  any single 2-D tensor:  engram convert file.safetensors --tensor NAME --out tables/t [--layer L]
  synthetic random tables of any size (valid FP8 bytes, no NaN; bytes depend only on the arguments):
      engram convert --random --rows 100000000 --dim 256 --seed 0 --out tables/r
      engram convert --random --config tiny --seed 0 --out tables/     (one table per layer of a layout)

--config (a preset name or a config.json) stores each layer's layout fingerprint (primes, rows) in the
manifest and checks the tensor sizes against it; open_table(..., expect=cfg.fingerprint(L)) then refuses a
table of another layout. Tables are written to a temporary directory and renamed into place when complete.
Check one with `engram inspect --verify DIR`.

tables written before format 2 have no per-page checksums, which the disk tier needs:
      engram convert --add-checksums DIR [DIR ...]     (in place; verifies the existing CRCs first)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("sources", nargs="*", metavar="SRC", help="safetensors files or directories (table "
                                                            "directories with --add-checksums)")
    p.add_argument("--out", help="output directory (OUT/layer_L per layer, or the table itself for --tensor and "
                                 "--random --rows)")
    p.add_argument("--add-checksums", action="store_true",
                   help="add the per-page CRC32C sidecar to each table directory SRC in place (format 1 -> 2)")
    p.add_argument("--layers", help="comma-separated layer ids to convert (default: every layer found)")
    p.add_argument("--quantize", choices=["mxfp8"], help="quantize bf16/fp16/fp32 tables to MXFP8")
    p.add_argument("--config", help="config name (deepseek-v4.1-flash, paper-demo, tiny, small, 4b-like, 8b-like) "
                                    "or config.json: fingerprint + size checks")
    p.add_argument("--tensor", help="convert this one tensor (by name) instead of the V4.1 names")
    p.add_argument("--layer", type=int, help="layer id recorded in the manifest (--tensor, --random --rows)")
    p.add_argument("--random", action="store_true", help="write synthetic random tables")
    p.add_argument("--rows", type=int, help="rows of the random table")
    p.add_argument("--dim", type=int, help="values per row of the random table")
    p.add_argument("--seed", type=int, default=0, help="seed of the random table (default 0)")
    p.add_argument("--dtype", default="mxfp8", choices=["mxfp8", "bf16", "fp16", "fp32"],
                   help="row dtype of the random table (default mxfp8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _config(spec: str | None):
    if spec is None:
        return None
    from engram.config import EngramConfig
    from engram.commands.config_names import resolve_config

    return EngramConfig.from_hf_config(resolve_config(spec, "--config"))


def _report(manifests, seconds: float) -> None:
    total = 0
    for m in manifests:
        nbytes = sum(f.bytes for f in m.files.values())
        total += nbytes
        print(json.dumps({"table": str(m.path), "layer_id": m.layer_id, "rows": m.rows, "dim": m.dim,
                          "row_dtype": m.row_dtype, "bytes": nbytes}))
    print(f"wrote {len(manifests)} table(s), {total / 1e9:.3f} GB in {seconds:.1f} s "
          f"({total / 1e9 / max(seconds, 1e-9):.2f} GB/s)", file=sys.stderr)


def _add_checksums(dirs: list[str], progress: bool) -> int:
    from engram.store.format import TableFormatError
    from engram.store.upgrade import add_checksums

    if not dirs:
        print("engram convert: error: --add-checksums needs table directories", file=sys.stderr)
        return 2
    for d in dirs:
        try:
            m, changed = add_checksums(d, progress=progress)
        except (TableFormatError, OSError) as e:
            print(f"engram convert: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"table": str(m.path), "format_version": m.format_version, "pages": m.pages,
                          "added": changed}))
    return 0


def run(args: argparse.Namespace) -> int:
    from engram.store.convert import (convert_random, convert_safetensors, convert_tensor, find_tensor, layer_dir,
                                      shard_paths)
    from engram.store.format import TableFormatError

    progress = not args.no_progress
    if args.add_checksums:
        return _add_checksums(args.sources, progress)
    t0 = time.perf_counter()
    try:
        if args.out is None:
            raise ValueError("--out is required (except with --add-checksums)")
        cfg = _config(args.config)
        if args.random:
            if args.sources:
                raise ValueError("--random takes no SRC files")
            if args.rows is not None or args.dim is not None:
                if args.rows is None or args.dim is None:
                    raise ValueError("--random needs both --rows and --dim (or --config alone)")
                out = [convert_random(args.out, args.rows, args.dim, args.seed, args.dtype, layer_id=args.layer,
                                      config=cfg, progress=progress)]
            elif cfg is not None:
                out = [convert_random(layer_dir(args.out, lid), cfg.table_rows(lid), cfg.head_dim, args.seed + lid,
                                      cfg.row_dtype, layer_id=lid, config=cfg, progress=progress)
                       for lid in cfg.layer_ids]
            else:
                raise ValueError("--random needs --rows N --dim D, or --config for one table per layer")
        else:
            if not args.sources:
                raise ValueError("give safetensors files or directories (SRC), or --random")
            if args.tensor:
                src = find_tensor(shard_paths(args.sources), args.tensor)
                out = [convert_tensor(src, args.out, layer_id=args.layer, quantize=args.quantize, config=cfg,
                                      progress=progress)]
            else:
                layers = [int(x) for x in args.layers.split(",")] if args.layers else None
                out = convert_safetensors(args.sources, args.out, layers=layers, quantize=args.quantize, config=cfg,
                                          progress=progress)
    except (ValueError, FileNotFoundError, FileExistsError, TableFormatError) as e:
        print(f"engram convert: error: {e}", file=sys.stderr)
        return 2
    _report(out, time.perf_counter() - t0)
    return 0
