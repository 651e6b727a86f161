"""`engram bench <name>`: dispatcher over the benchmark modules in engram.bench.

Each bench module defines HELP (one line), add_arguments(parser) and run(args) -> int, like a top-level
command; a module not present in this build is skipped, exactly as engram/cli.py skips commands. Every
bench reports through engram.bench.report (JSON + table) and compares through engram.bench.stats.
"""
from __future__ import annotations

import argparse
import importlib

HELP = "benchmarks: A/B harness, table lookups, serving load, generation (JSON results + tables)."

BENCHES = {
    "ab": "engram.bench.ab",
    "lookup": "engram.bench.lookup",
    "gpu-lookup": "engram.bench.gpu_lookup",
    "serve": "engram.bench.serve_load",
    "generate": "engram.bench.generate",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, module_name in BENCHES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:  # a bench whose module is not in this build yet
            if e.name != module_name:
                raise
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
