"""`engram bench <name>`: dispatcher over the benchmark modules in engram.bench.

Each bench module defines HELP (one line), add_arguments(parser) and run(args) -> int, like a top-level
command, and imports nothing from engram.commands. Every bench reports through engram.bench.report (JSON +
table) and compares through engram.bench.stats. One-off probes live in the repository's benchmarks/ folder,
outside the package.
"""
from __future__ import annotations

import argparse

from engram.commands import add_subcommands

HELP = ("benchmarks: A/B harness, table lookups, serving load, generation, natural-text corpus, cache hit rates "
        "(JSON results + tables).")

BENCHES = {
    "ab": "engram.bench.ab",
    "lookup": "engram.bench.lookup",
    "serve": "engram.bench.serve_load",
    "corpus": "engram.bench.corpus",
    "hit-rate": "engram.bench.hit_rate",
    "engine": "engram.bench.engine_bench",
    "placement": "engram.bench.placement_ab",
    "paper": "engram.bench.paper",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_subcommands(parser, BENCHES, "bench", "BENCH")


def run(args: argparse.Namespace) -> int:
    raise AssertionError("unreachable: argparse dispatches to the chosen bench's run")
