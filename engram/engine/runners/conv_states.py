"""The paper variant's per-sequence ShortConv states on a Worker (``ConvStates``), shared by the runners that run its
steps (the eager runner; the verify graphs, engine/runners/verify_graphs.py), so a sequence's state is the same
whichever runner ran its last step. A sequence at position 0 starts from zeros, one that starts at a prefix-cache hit
from the conv inputs kept with its blocks (``conv_blocks``), any other from the state its last step left under its
id; ``free`` drops finished sequences' states."""
from __future__ import annotations

import torch

from engram.config import EngramConfig
from engram.engine.runners.conv_blocks import ConvBlockStore
from engram.engine.step import StepDescription
from engram.short_conv import ShortConvState


class ConvStates:
    """Engram layer -> conv state [1, L, C] of each live sequence, by sequence id (``layers``: this Worker's)."""

    def __init__(self, ecfg: EngramConfig, layers: list[int], dtype: torch.dtype, device: torch.device,
                 conv_blocks: ConvBlockStore | None = None):
        self.ecfg, self.layers, self.dtype, self.device = ecfg, list(layers), dtype, torch.device(device)
        self.conv_blocks = conv_blocks  # with prefix caching: conv inputs kept with each KV block
        self._conv: dict[int, dict[int, ShortConvState]] = {}  # seq id -> Engram layer -> its conv state

    def of_step(self, step: StepDescription) -> list[dict[int, ShortConvState]]:
        """Each of the step's sequences' states before the step (packing order), by layer."""
        fresh = {lid: ShortConvState.zeros(1, self.ecfg, self.dtype, self.device) for lid in self.layers}
        if step.cached_starts and self.conv_blocks is None:
            raise RuntimeError(f"step {step.step_id}: sequences start at prefix-cache hits but this Worker keeps no "
                               "conv inputs with its blocks (prefix caching off here)")
        cached = set(step.cached_starts)
        states = []
        for i, (sid, start) in enumerate(zip(step.seq_ids, step.start_positions)):
            if start == 0:
                states.append(fresh)
            elif i in cached:
                states.append(self.conv_blocks.history(step.block_tables[i], start))
            elif sid in self._conv:
                states.append(self._conv[sid])
            else:
                raise RuntimeError(f"step {step.step_id}: sequence id {sid} continues at position {start} but this "
                                   "Worker keeps no conv state for it")
        return states

    def stacked(self, step: StepDescription, cu_seqlens: torch.Tensor) -> dict[int, ShortConvState]:
        """Each layer's states of the step's sequences stacked in packing order (copies), packed by ``cu_seqlens``."""
        states = self.of_step(step)
        return {lid: ShortConvState.stack([s[lid] for s in states], cu_seqlens) for lid in self.layers}

    def keep(self, step: StepDescription, conv: dict[int, ShortConvState]) -> None:
        """The states after the step: row i of each layer's ``conv`` [>= S, L, C] is sequence i's (views kept, so the
        caller hands over buffers no later step overwrites)."""
        per_layer = {lid: state.split() for lid, state in conv.items()}
        for i, sid in enumerate(step.seq_ids):
            self._conv[sid] = {lid: parts[i] for lid, parts in per_layer.items()}

    def free(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self._conv.pop(sid, None)
