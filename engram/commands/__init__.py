"""One module per `engram` subcommand.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; heavy imports
happen inside ``run`` so that ``engram --help`` stays fast.
"""
