"""`engram` command line: the one entry point.

Subcommands live in ``engram.commands.<name>`` (see that package's docstring for the contract); this file
only wires them into argparse.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": "engram.commands.serve",
    "generate": "engram.commands.generate",
    "bench": "engram.commands.bench",
    "convert": "engram.commands.convert",
    "inspect": "engram.commands.inspect",
    "plan-pp": "engram.commands.plan_pp",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram", description="Serve models with Engram conditional memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:  # a subcommand whose module is not installed in this build
            if e.name != module_name:
                raise
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
