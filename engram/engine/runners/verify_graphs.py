"""The verify graph runner (speculative decoding): verify steps — every sequence its last token and up to K drafts —
as one CUDA graph per bucket of S_b sequences x (K + 1) rows (verify_inputs.py), the Engram gathers of every row
inside as in the decode graphs, logits for every verify row; the verifier (spec/verify.py) runs after the replay.

The paper variant's conv states come from the Worker's ``ConvStates`` (shared with the eager runner) through
``VerifyConv`` (verify_conv.py): the replay leaves each one's window of L + K inputs ending at its last bucket row, and
``keep`` rewinds it to the sequence's last accepted token. Over host-read tables the verify steps replay pieces
instead (verify_pieces.py)."""
from __future__ import annotations

import torch

from engram.engine.lookup_stream import LookupStream
from engram.engine.runners.conv_states import ConvStates
from engram.engine.runners.graphs import GraphRunner
from engram.engine.runners.verify_conv import ConvAroundSteps, VerifyConv
from engram.engine.runners.verify_inputs import VerifyInputs


class VerifyGraphRunner(ConvAroundSteps, GraphRunner):
    """A GraphRunner over ``VerifyInputs`` ("verify-graph"); ``conv_states``: the paper variant's (None: v41 or no
    Engram), loaded and kept around each replay by ``VerifyConv``. ``capture=False`` (tests, the CPU) runs what a
    graph holds eagerly on the same static inputs."""

    def __init__(self, model, kv, ecfg, tables: dict, io: VerifyInputs, device: torch.device,
                 conv_states: ConvStates | None = None, progress: bool | None = None,
                 lookup_stream: LookupStream | None = None, pool=None, capture: bool = True):
        self.conv = VerifyConv(io, conv_states)
        super().__init__(model, kv, ecfg, tables, io, device, name="verify-graph", progress=progress,
                         lookup_stream=lookup_stream, pool=pool, capture=capture)

    def stats(self) -> dict:
        return {**super().stats(), **self.io.stats()}


def verify_runner(model, kv, ecfg, tables: dict, config, max_model_len: int, null_block: int, device: torch.device,
                  dtype: torch.dtype, conv_states: ConvStates | None, capture: bool = True, **graph_options
                  ) -> VerifyGraphRunner:
    """The verify runner of an EngineConfig with a speculative config (``VerifyInputs.of_config``'s buckets);
    ``graph_options``: GraphRunner's progress, lookup_stream, pool."""
    io = VerifyInputs.of_config(config, max_model_len, null_block, ecfg, list(tables), device, dtype, conv_states)
    return VerifyGraphRunner(model, kv, ecfg, tables, io, device, conv_states, capture=capture, **graph_options)
