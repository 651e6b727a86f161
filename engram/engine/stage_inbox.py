"""A pipeline stage's messages from the engine, the same on every rank of the stage, with the steps behind the one it
runs learned of early (``StageInbox``). The stage's leader takes each message from the engine's pipe; with every
message, and at the stage's ``intake`` points (before it waits for the previous stage's streams, after its layers:
parallel/pp_stage.py), it also takes the steps that have already arrived behind it. One broadcast on the stage's control
group gives every rank both, in the same order on each, so every rank starts those steps' lookups (``start``:
``EarlyLookups.start``) at the same point of its message stream — the lookups' own collectives (a TP column shard's row
all-gather) then match on every rank. Messages still run strictly in arrival order: the steps learned of early first,
then a non-step message the leader found behind them, then the pipe."""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch.distributed as dist

__all__ = ["StageInbox"]


class StageInbox:
    """``receive()`` (leader): the pipe's next message, waiting for it; ``take_ready()`` (leader): the next message
    already there, else None; ``start(step)``: start a step's lookups (every rank). ``group``: the stage's control
    group, ``leader`` its first rank (global)."""

    def __init__(self, group, leader: int, is_leader: bool, start: Callable,
                 receive: Callable[[], tuple] | None = None, take_ready: Callable[[], tuple | None] | None = None):
        if is_leader and (receive is None or take_ready is None):
            raise ValueError("a stage leader's inbox needs receive and take_ready")
        self.group, self.leader, self.is_leader, self.start = group, leader, is_leader, start
        self.receive, self.take_ready = receive, take_ready
        self.size = dist.get_world_size(group)
        self._ahead: deque[tuple] = deque()  # ("step", description) learned of early, not run yet (every rank)
        self._held: deque[tuple] = deque()  # leader: a non-step message found behind them, not run yet
        self.learned_early = 0  # steps learned of before their turn (stats, tests)

    def next(self) -> tuple:
        """The stage's next message (kind, payload), the same on every rank."""
        from_ahead = bool(self._ahead)  # the same on every rank: every rank learned the same steps
        if self.is_leader:
            msg = None if from_ahead else self._held.popleft() if self._held else self.receive()
            box = [msg, self._arrived()]
        else:
            box = [None, None]
        self._share(box)
        msg = self._ahead.popleft() if from_ahead else box[0]
        self._learn(box[1])
        return msg

    @property
    def ahead(self) -> list:
        """The step descriptions learned of early, not run yet, oldest first (the same on every rank)."""
        return [msg[1] for msg in self._ahead]

    def intake(self) -> None:
        """Learn of the steps that arrived meanwhile and start their lookups (every rank of the stage calls it at the
        same point of the same step)."""
        box = [self._arrived() if self.is_leader else None]
        self._share(box)
        self._learn(box[0])

    def _arrived(self) -> list[tuple]:
        """Leader: the step messages already on the pipe, up to the first other message (held back, in order)."""
        steps: list[tuple] = []
        while not self._held:
            msg = self.take_ready()
            if msg is None:
                break
            if msg[0] == "step":
                steps.append(msg)
            else:
                self._held.append(msg)
        return steps

    def _share(self, box: list) -> None:
        if self.size > 1:
            dist.broadcast_object_list(box, src=self.leader, group=self.group)

    def _learn(self, steps: list[tuple]) -> None:
        for msg in steps:
            self._ahead.append(msg)
            self.learned_early += 1
            self.start(msg[1])
