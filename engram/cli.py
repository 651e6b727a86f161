"""`engram` command line: wires the subcommands of ``engram.commands`` into argparse."""
from __future__ import annotations

import argparse
import sys

from engram.commands import add_subcommands

COMMANDS = {
    "serve": "engram.commands.serve",
    "generate": "engram.commands.generate",
    "bench": "engram.commands.bench",
    "convert": "engram.commands.convert",
    "inspect": "engram.commands.inspect",
    "plan-pp": "engram.commands.plan_pp",
    "check": "engram.commands.check",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram", description="Serve models with Engram conditional memory.")
    add_subcommands(parser, COMMANDS, "command", "COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
