"""One module per `engram` subcommand: ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``,
its module docstring the command's description; heavy imports happen inside ``run`` so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib


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
