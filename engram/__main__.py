"""``python -m engram ...``: the ``engram`` command (engram.cli), for environments without its script on PATH."""
import sys

from engram.cli import main

sys.exit(main())
