"""The contract between a Worker and its step runners: each step goes to the first runner that ``covers`` it (the graph
or piecewise runner, then ``EagerRunner``, which covers all), whose ``launch`` returns a ``Forward``. The Worker calls
``settle(upto)`` on every runner before reading a step's tokens, and on the others before launching on one, so no two
steps' lookups overlap; ``check`` after the read raises a failed lookup."""
from __future__ import annotations

import abc
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


class StepRunner(abc.ABC):
    """One way through a step; see the module docstring for the order the Worker keeps."""

    name: str  # the route it stands for in step records and stats ("eager", "graph", ...)

    @abc.abstractmethod
    def covers(self, step: StepDescription) -> bool:
        """Whether this runner can run ``step``."""

    @abc.abstractmethod
    def launch(self, step: StepDescription, patch: PendingPatch | None) -> Forward:
        """Enqueue the step's lookups and forward; ``patch``: its tokens still on the device (async scheduling)."""

    def keep(self, step: StepDescription, accepted: torch.Tensor) -> None:
        """After a speculative step's verification (``accepted`` [N] drafts of each sampling sequence, on the device):
        per-sequence state ends at each sequence's last accepted token. Runners that keep none (KV is positional: the
        next step overwrites the rejected slots) do nothing."""

    def settle(self, upto: int | None = None) -> None:
        """Finish this runner's background lookups of steps up to ``upto`` (a failure is kept for ``check``)."""

    def check(self, step_id: int, flags: torch.Tensor | None) -> None:
        """Raise when the step's lookups failed, or its ``flags`` say it read rows not its own."""

    def stats(self) -> dict:
        return {}
