"""The verify runner over host-read tables (speculative decoding; the disk tier, hot-row caches, and any table whose
gather is not device work alone): verify steps as the verify buckets of verify_inputs.py — S_b sequences x (K + 1)
rows, padding inert in the null block — replayed as decode-style pieces cut at each Engram layer (pieces.py), so the
host reads a layer's rows while the layers before it run. The rows reach the layers the way the piecewise decode
steps' copied-in rows do: the lookup executor stages each layer's rows in packing order, and right before the layer's
piece ``VerifyInputs.place`` copies them to their bucket rows (padding rows zero). No slab and no in-graph cache probe
here: the disk tier's rows are staged by the executor's reads, which the pieces before the layer overlap.

The paper variant's conv states go in and out through ``VerifyConv`` as in the one-graph verify runner; the counters
are the same ``verify_graph`` ones; the route is "verify-piecewise" (the one-graph runner's: "verify-graph")."""
from __future__ import annotations

import torch

from engram.engine.lookup import LookupExecutor
from engram.engine.runners.conv_states import ConvStates
from engram.engine.runners.piecewise import PiecewiseRunner
from engram.engine.runners.pieces import DecodePieces
from engram.engine.runners.verify_conv import ConvAroundSteps, VerifyConv
from engram.engine.runners.verify_inputs import VerifyInputs


class VerifyPiecesRunner(ConvAroundSteps, PiecewiseRunner):
    """A PiecewiseRunner over pieces of ``VerifyInputs`` ("verify-piecewise"); ``conv_states``: the paper variant's
    (None: v41)."""

    name = "verify-piecewise"

    def __init__(self, pieces: DecodePieces, lookup: LookupExecutor, device: torch.device,
                 conv_states: ConvStates | None = None):
        if not isinstance(pieces.io, VerifyInputs):
            raise ValueError(f"VerifyPiecesRunner: pieces over {type(pieces.io).__name__}, not VerifyInputs")
        super().__init__(pieces, lookup, device)
        self.conv = VerifyConv(pieces.io, conv_states)

    def stats(self) -> dict:
        return {"verify_graph_replays": self.pieces.replays, "verify_graph_pool_bytes": self.pieces.pool_bytes,
                **self.pieces.io.stats()}


def verify_pieces_runner(model, kv, ecfg, tables: dict, lookup: LookupExecutor, config, max_model_len: int,
                         null_block: int, device: torch.device, dtype: torch.dtype, conv_states: ConvStates | None,
                         progress: bool | None = None, pool=None, capture: bool = True) -> VerifyPiecesRunner:
    """The host-read verify runner of an EngineConfig with a speculative config (``VerifyInputs.of_config``'s
    buckets), its lookups through ``lookup``; ``pool``: the graph pool it shares (None: its own); ``capture=False``:
    the pieces run uncaptured (tests, the CPU)."""
    io = VerifyInputs.of_config(config, max_model_len, null_block, ecfg, list(tables), device, dtype, conv_states)
    pieces = DecodePieces(model, kv, ecfg, tables, io.max_seqs, max_model_len, config.block_size, null_block, device,
                          progress, io=io, pool=pool, capture=capture)
    return VerifyPiecesRunner(pieces, lookup, device, conv_states)
