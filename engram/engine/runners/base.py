"""The contract between a Worker and its step runners.

A Worker holds its runners in order, chosen once at construction: the one for the steps its CUDA graphs cover
(``GraphRunner``: device-resident tables, gathers inside the graphs; ``PiecewiseRunner``: host-read tables,
graphs cut at every Engram layer), then ``EagerRunner``, which covers every step. Each step goes to the first
runner that ``covers`` it. A runner's ``launch`` enqueues the step's lookups and forward and returns its
``Forward``. ``settle(upto)`` finishes the lookups a runner still runs in the background for steps up to
``upto`` (all of them for None): the Worker calls it on every runner before it reads a step's tokens, and on
the other runners before it launches a step on one, so no two steps' lookups overlap across runners. After
the tokens are read, ``check`` raises a failure of the step's lookups or of the flags it returned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.engine.pending import PendingPatch
from engram.engine.step import StepDescription


@dataclass
class Forward:
    """What a runner's launch leaves for the Worker to sample and read back."""

    logits: torch.Tensor  # [N, vocab] float32 of the sampled rows (a graph's output: sample before the next replay)
    flags: torch.Tensor | None = None  # device flags read back with the tokens and handed to ``check``
    prompt_scores: tuple | None = None  # (own, top values, top ids) of the prompt rows asked for, eager only


class StepRunner:
    """One way through a step; see the module docstring for the order the Worker keeps."""

    def covers(self, step: StepDescription) -> bool:
        raise NotImplementedError

    def launch(self, step: StepDescription, patch: PendingPatch | None) -> Forward:
        raise NotImplementedError

    def settle(self, upto: int | None = None) -> None:
        """Finish this runner's background lookups of steps up to ``upto`` (a failure is kept for ``check``)."""

    def check(self, step_id: int, flags: torch.Tensor | None) -> None:
        """Raise when the step's lookups failed, or the host copy of its ``flags`` says it read rows that were
        not its own."""

    def stats(self) -> dict:
        return {}
