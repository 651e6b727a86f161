"""Sampled ids relayed between pipeline stages (``SampledRelay``): the last stage sends every step's sampled ids
straight to the stages that need them for the next step — the first stage (it embeds them) and every stage with
Engram layers (they hash them into row ids) — point-to-point, rank t of the last stage to rank t of each, gloo on the
CPU, NCCL on GPUs. A step whose inputs include a token the engine has not read yet then starts on those stages as
soon as the token arrives, not after a round trip through the engine.

Order is the contract: every stage runs the same steps in the same order, so the last stage sends the ids of each
step that samples in step order and a receiving stage ``expect``s each such step as it runs it; ``receive_through(j)``
takes the messages in that order up to step j's (those before it come first: the last stage ran them first). What no
step needed is taken by ``drain`` at stop. Messages use their own tag, apart from the streams (parallel/pp_stage.py)."""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

RELAY_TAG = 1  # the streams between stages use tag 0


class SampledRelay:
    """One rank's end of the relay. On the last stage ``targets``: the global ranks to send to (its TP rank in each
    stage that needs the ids; may be empty); elsewhere ``source``: the last stage's rank it receives from (None on
    a stage that needs no ids). ``group``: the point-to-point group (the world)."""

    def __init__(self, device: torch.device, targets: list[int] | None = None, source: int | None = None, group=None):
        if targets is not None and source is not None:
            raise ValueError("a relay end either sends (the last stage) or receives")
        self.device, self.targets, self.source, self.group = torch.device(device), list(targets or ()), source, group
        self._sending: deque = deque()  # (work, buffer) of sends not waited for yet
        self._expected: deque[tuple[int, int]] = deque()  # (step id, number of ids) not received yet, in step order
        self.sent = self.received = 0  # messages sent / received (stats, tests)

    @property
    def sends(self) -> bool:
        return bool(self.targets)

    @property
    def receives(self) -> bool:
        return self.source is not None

    def send(self, token_ids: list[int]) -> None:
        """Last stage: a step's sampled ids [N] to every target (queued; the buffers live until the send is done)."""
        if not token_ids or not self.targets:
            return
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [N] int64
        for dst in self.targets:
            self._sending.append((dist.isend(ids, dst, group=self.group, tag=RELAY_TAG), ids))
            self.sent += 1
        while self._sending and self._sending[0][0].is_completed():
            self._sending.popleft()

    def expect(self, step_id: int, num_ids: int) -> None:
        """Receiving stage: a step that samples ``num_ids`` ids ran here; its ids will come, in this order."""
        if self.source is not None and num_ids:
            self._expected.append((step_id, num_ids))

    def receive_through(self, step_id: int) -> dict[int, torch.Tensor]:
        """The ids of every expected step up to and including ``step_id`` -> {step id: [N] int64 on the device}; a
        step never expected (it sampled nothing, or ran before this rank learned of it) is an error naming it."""
        if not any(sid == step_id for sid, _ in self._expected):
            raise RuntimeError(f"relay: step {step_id}'s sampled ids are not expected here (expecting "
                               f"{[sid for sid, _ in self._expected]})")
        out: dict[int, torch.Tensor] = {}
        while step_id not in out:
            sid, n = self._expected.popleft()
            out[sid] = self._receive(n)
        return out

    def drain(self) -> None:
        """Stop: take what no step needed (receiving) or wait for every send to complete (sending)."""
        while self._expected:
            self._receive(self._expected.popleft()[1])
        while self._sending:
            self._sending.popleft()[0].wait()

    def _receive(self, n: int) -> torch.Tensor:
        ids = torch.empty(n, dtype=torch.long, device=self.device)
        dist.recv(ids, self.source, group=self.group, tag=RELAY_TAG)
        self.received += 1
        return ids


def relay_for(stage: int, num_stages: int, tp: int, tp_rank: int, needs_ids: list[bool], device: torch.device,
              group=None) -> SampledRelay:
    """Stage ``stage``'s end of the relay: ``needs_ids[s]`` says whether stage s takes the sampled ids (the first
    stage and the stages with Engram layers; never the last, which sampled them)."""
    last = num_stages - 1
    if stage == last:
        return SampledRelay(device, targets=[s * tp + tp_rank for s in range(last) if needs_ids[s]], group=group)
    return SampledRelay(device, source=last * tp + tp_rank if needs_ids[stage] else None, group=group)
