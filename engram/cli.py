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
    "check": "engram.commands.check",
}


def add_subcommands(parser: argparse.ArgumentParser, registry: dict[str, str], dest: str, metavar: str) -> None:
    """One subparser per ``registry`` entry (name -> module with HELP, add_arguments, run); the chosen
    module's ``run`` lands in ``args._run``. A module missing from this build is skipped; an import error
    inside a module that exists is raised."""
    sub = parser.add_subparsers(dest=dest, required=True, metavar=metavar)
    for name, module_name in registry.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__ or module.HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram", description="Serve models with Engram conditional memory.")
    add_subcommands(parser, COMMANDS, "command", "COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
