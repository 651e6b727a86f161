"""The verify graph runner (speculative decoding): verify steps — every sequence its last token and up to K drafts —
as one CUDA graph per bucket of S_b sequences x (K + 1) rows (verify_inputs.py), the Engram gathers of every row
inside as in the decode graphs, logits for every verify row; the verifier (spec/verify.py) runs after the replay.

The paper variant's conv states come from the Worker's ``ConvStates`` (shared with the eager runner): ``launch`` copies
the step's sequences' states into the bucket's static ones, the replay leaves each one's window of L + K inputs ending
at its last bucket row, and ``keep`` — once the verifier has counted — rewinds each to its last accepted token
(``VerifyInputs.dropped``) and hands copies back, so rejected drafts and padding leave nothing behind. With prefix
caching the conv inputs of the step's block-tail tokens go to the blocks' store (``ConvBlockStore``) as eager does."""
from __future__ import annotations

import torch

from engram.engine.lookup_stream import LookupStream
from engram.engine.pending import PendingPatch
from engram.engine.runners.base import Forward
from engram.engine.runners.conv_states import ConvStates
from engram.engine.runners.graphs import GraphRunner
from engram.engine.runners.verify_inputs import VerifyInputs
from engram.engine.step import StepDescription
from engram.short_conv import ShortConvState


class VerifyGraphRunner(GraphRunner):
    """A GraphRunner over ``VerifyInputs`` ("verify-graph"); ``conv_states``: the paper variant's (None: v41 or no
    Engram). ``capture=False`` (tests, the CPU) runs what a graph holds eagerly on the same static inputs."""

    def __init__(self, model, kv, ecfg, tables: dict, io: VerifyInputs, device: torch.device,
                 conv_states: ConvStates | None = None, progress: bool | None = None,
                 lookup_stream: LookupStream | None = None, pool=None, capture: bool = True):
        if (conv_states is not None) != bool(io.conv):
            raise ValueError("VerifyGraphRunner: conv_states and the inputs' static conv states go together "
                             f"(conv_states {'given' if conv_states is not None else 'None'}, "
                             f"io.conv layers {sorted(io.conv)})")
        self.conv_states = conv_states
        self._unkept: tuple[int, int] | None = None  # (step id, bucket rows) of a launched step awaiting ``keep``
        super().__init__(model, kv, ecfg, tables, io, device, name="verify-graph", progress=progress,
                         lookup_stream=lookup_stream, pool=pool, capture=capture)

    @torch.inference_mode()
    def launch(self, step: StepDescription, patch: PendingPatch | None) -> Forward:
        if self.conv_states is None:
            return super().launch(step, patch)
        self.io.load_conv(self.conv_states.of_step(step))
        forward = super().launch(step, patch)
        size = self.io.bucket(step.num_seqs)
        self._unkept = (step.step_id, size)
        blocks = self.conv_states.conv_blocks
        if blocks is not None:  # the conv inputs of the tokens in their blocks' last slots, as eager keeps them
            rows, dest = blocks.tail(step.slot_mapping)  # packed rows [R], pool rows [R]
            at = self.io.bucket_rows.index_select(0, rows)  # [R] their bucket rows
            for lid, state in self.io.conv_states(size).items():
                blocks.write(lid, state.tapped.index_select(0, at), dest)
        return forward

    @torch.inference_mode()
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

    def stats(self) -> dict:
        return {**super().stats(), "verify_graph_rows": self.io.num_rows,
                "verify_graph_padded_rows": self.io.padded_rows, "verify_graph_short_seqs": self.io.short_seqs}


def verify_runner(model, kv, ecfg, tables: dict, config, max_model_len: int, null_block: int, device: torch.device,
                  dtype: torch.dtype, conv_states: ConvStates | None, capture: bool = True, **graph_options
                  ) -> VerifyGraphRunner:
    """The verify runner of an EngineConfig with a speculative config: buckets of the decode graphs' batch sizes (up to
    ``min(max_num_seqs, max_graph_batch)``) x (K + 1) rows; ``graph_options``: GraphRunner's progress, lookup_stream,
    pool."""
    c = config
    io = VerifyInputs(min(c.max_num_seqs, c.max_graph_batch), c.speculative_config.num_speculative_tokens,
                      max_model_len, c.block_size, null_block, ecfg.n_cols if ecfg else 0, list(tables), device,
                      conv=(ecfg, conv_states.layers, dtype) if conv_states is not None else None,
                      conv_tap=conv_states is not None and conv_states.conv_blocks is not None)
    return VerifyGraphRunner(model, kv, ecfg, tables, io, device, conv_states, capture=capture, **graph_options)
