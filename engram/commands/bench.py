"""`engram bench <name>`: dispatcher over the benchmark modules in engram.bench.

Each bench module defines HELP (one line), add_arguments(parser) and run(args) -> int, like a top-level
command; a module not present in this build is skipped, exactly as engram/cli.py skips commands. Every
bench reports through engram.bench.report (JSON + table) and compares through engram.bench.stats.
"""
from __future__ import annotations

import argparse

HELP = ("benchmarks: A/B harness, table lookups, serving load, generation, natural-text corpus, cache hit rates "
        "(JSON results + tables).")

BENCHES = {
    "ab": "engram.bench.ab",
    "lookup": "engram.bench.lookup",
    "gpu-lookup": "engram.bench.gpu_lookup",
    "serve": "engram.bench.serve_load",
    "table-open": "engram.bench.table_open",
    "corpus": "engram.bench.corpus",
    "hit-rate": "engram.bench.hit_rate",
    "engine": "engram.bench.engine_bench",
    "placement": "engram.bench.placement_ab",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engram.cli import add_subcommands

    add_subcommands(parser, BENCHES, "bench", "BENCH")


def run(args: argparse.Namespace) -> int:
    raise AssertionError("unreachable: argparse dispatches to the chosen bench's run")
