"""engine/heap.py: freezing moves the live heap out of the collector's reach, thawing gives it back; the
generate command thaws when it returns (tests run it in this process)."""
from __future__ import annotations

import gc

from engram.engine.heap import freeze_startup_heap, thaw_heap


def test_freeze_then_thaw():
    thaw_heap()
    try:
        assert freeze_startup_heap() > 1000 and gc.get_freeze_count() > 1000
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0


def test_generate_leaves_nothing_frozen(capsys):
    from engram.cli import main

    assert main(["generate", "tiny", "--prompt", "Tables", "--max-tokens", "2", "--no-progress"]) == 0
    assert gc.get_freeze_count() == 0
