"""``StageInbox`` (engine/stage_inbox.py) on a one-rank gloo group: messages come out in arrival order whatever was
learned of early, the steps queued behind a message are started as soon as they are seen (with a message or at an
``intake``), and a non-step message stops the look-ahead so nothing overtakes it."""
from __future__ import annotations

import collections

import pytest
import torch.distributed as dist

from engram.engine.stage_inbox import StageInbox


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class Pipe:
    """The leader's pipe as a queue: ``get`` waits (here: must have a message), ``get_ready`` never does."""

    def __init__(self):
        self.queue = collections.deque()

    def get(self):
        return self.queue.popleft()

    def get_ready(self):
        return self.queue.popleft() if self.queue else None


def test_messages_run_in_order_and_steps_behind_start_at_once(group):
    pipe, started = Pipe(), []
    inbox = StageInbox(group, 0, True, started.append, pipe.get, pipe.get_ready)
    pipe.queue.extend([("step", "s0"), ("step", "s1"), ("stats", None), ("step", "s2")])
    assert inbox.next() == ("step", "s0")
    assert started == ["s1"]  # s1 was queued behind s0; s2 waits behind the stats message
    pipe.queue.append(("step", "s3"))
    inbox.intake()  # the stats message still holds the look-ahead back
    assert started == ["s1"]
    assert inbox.next() == ("step", "s1")
    assert inbox.next() == ("stats", None)
    assert started == ["s1", "s2", "s3"]  # taken with the stats message
    pipe.queue.append(("step", "s4"))
    inbox.intake()  # arrived while s2 computes: started before its turn
    assert started == ["s1", "s2", "s3", "s4"]
    assert [inbox.next() for _ in range(3)] == [("step", "s2"), ("step", "s3"), ("step", "s4")]
    pipe.queue.append(("stop", None))
    assert inbox.next() == ("stop", None)
    assert inbox.learned_early == 4


def test_a_leader_needs_its_pipe(group):
    with pytest.raises(ValueError, match="needs receive and take_ready"):
        StageInbox(group, 0, True, lambda step: None)
