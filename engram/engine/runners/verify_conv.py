"""The paper variant's conv states around a verify bucket, shared by both verify runners (verify_graphs.py: the
gathers inside one graph; verify_pieces.py: host-read rows copied in between pieces). ``load`` copies the step's
sequences' states (the Worker's ``ConvStates``) into the bucket's static ones before the forward; ``launched`` writes
the conv inputs of the step's block-tail tokens to the blocks' store (prefix caching) as eager does; ``keep`` — once
the verifier has counted — rewinds each state to its last accepted token (``VerifyInputs.dropped``) and hands copies
back, so rejected drafts and padding leave nothing behind. Without conv states (v41, no Engram) all three do
nothing. ``ConvAroundSteps`` puts them around a runner's ``launch`` and ``keep``."""
from __future__ import annotations

import torch

from engram.engine.pending import PendingPatch
from engram.engine.runners.base import Forward
from engram.engine.runners.conv_states import ConvStates
from engram.engine.runners.verify_inputs import VerifyInputs
from engram.engine.step import StepDescription
from engram.short_conv import ShortConvState


class VerifyConv:
    """``io``: the verify bucket's static inputs; ``conv_states``: the Worker's (None: v41 or no Engram)."""

    def __init__(self, io: VerifyInputs, conv_states: ConvStates | None):
        if (conv_states is not None) != bool(io.conv):
            raise ValueError("verify runner: conv_states and the inputs' static conv states go together "
                             f"(conv_states {'given' if conv_states is not None else 'None'}, "
                             f"io.conv layers {sorted(io.conv)})")
        self.io, self.conv_states = io, conv_states
        self._unkept: tuple[int, int] | None = None  # (step id, bucket rows) of a launched step awaiting ``keep``

    def load(self, step: StepDescription) -> None:
        """Before the step's forward: its sequences' states into the static ones."""
        if self.conv_states is not None:
            self.io.load_conv(self.conv_states.of_step(step))

    def launched(self, step: StepDescription) -> None:
        """After the step's forward is queued: remember it for ``keep``; the block-tail conv inputs to their store."""
        if self.conv_states is None:
            return
        size = self.io.bucket(step.num_seqs)
        self._unkept = (step.step_id, size)
        blocks = self.conv_states.conv_blocks
        if blocks is not None:  # the conv inputs of the tokens in their blocks' last slots, as eager keeps them
            rows, dest = blocks.tail(step.slot_mapping)  # packed rows [R], pool rows [R]
            at = self.io.bucket_rows.index_select(0, rows)  # [R] their bucket rows
            for lid, state in self.io.conv_states(size).items():
                blocks.write(lid, state.tapped.index_select(0, at), dest)

    def keep(self, step: StepDescription, accepted: torch.Tensor) -> None:
        """Each sequence's conv state becomes the window ending at its last accepted token (``accepted`` [S])."""
        if self._unkept is None:
            return
        (step_id, size), self._unkept = self._unkept, None
        if step_id != step.step_id:
            raise RuntimeError(f"step {step.step_id}: the conv state waiting to be kept is step {step_id}'s")
        dropped = self.io.dropped(size, accepted)  # [S_b]
        kept = {}
        for lid, state in self.io.conv_states(size).items():
            state.rewind(dropped)
            kept[lid] = ShortConvState(state.conv[:step.num_seqs].clone())  # the next replay rewrites the static one
        self.conv_states.keep(step, kept)


class ConvAroundSteps:
    """Mixin of the verify runners (before their step runner base): ``launch`` and ``keep`` of the base with the
    runner's ``conv`` (a VerifyConv) around them."""

    conv: VerifyConv

    @torch.inference_mode()
    def launch(self, step: StepDescription, patch: PendingPatch | None) -> Forward:
        self.conv.load(step)
        forward = super().launch(step, patch)
        self.conv.launched(step)
        return forward

    @torch.inference_mode()
    def keep(self, step: StepDescription, accepted: torch.Tensor) -> None:
        self.conv.keep(step, accepted)
