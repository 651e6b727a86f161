"""The static inputs of mixed-step CUDA graphs: steps that mix prefill chunks with decodes (or decode more sequences
than the decode graphs hold), bucketed by token count (``token_buckets``). A bucket of T tokens runs the Triton
attention with grids sized for the bucket, and the tile-to-sequence mapping as device inputs:

* decode entries (sequences with one new token): D = min(S, T) slots of (block-table row, token row, KV length);
* prefill entries: P = T // 2 + 1 slots (one kept free) of (block-table row, first token row, new tokens, KV length), and
  T // 64 + P query tiles of (entry, first query), enough for any chunks of T tokens in fewer than P sequences;
* the LM-head rows: min(L, T) slots, L = ``max_logits`` (``max_num_seqs``, or with speculative decoding
  ``max_num_seqs`` x (K + 1): every verify row gets logits; engine/spec/config.py). A verify sequence (its last token
  and K drafts) is a prefill entry of K + 1 tokens, so P keeps a slot free even when every entry is one.

Padding is inert: unused decode slots have KV length 0 (the kernels write nothing for them), unused tiles point at a
prefill slot of 0 tokens, padding tokens write their K/V into a block no sequence owns (``null_block``) and gather
row 0 (row ids of padding must be valid rows: the gathers run on every row of the bucket). Block-table row 0 is that
null block; sequence s reads row s + 1. Steps with DEAD tokens or prompt logprobs run eager."""
from __future__ import annotations

import numpy as np
import torch

from engram.engine.pending import PendingPatch
from engram.engine.runners.upload import PinnedUpload, lay_out
from engram.engine.step import StepDescription
from engram.model.inputs import StepInputs
from engram.model.layers.attention import AttentionMetadata
from engram.model.layers.paged_attention import PREFILL_BLOCK_M

MIN_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts that get a mixed-step graph: 16, 32, 64, then steps of x1.5 and x2 in turn (16, 24, 32, 48 ...
    scaled), up to and including ``max_tokens``."""
    sizes, t = [], MIN_BUCKET
    while t < max_tokens:
        sizes.append(t)
        t = t * 3 // 2 if (t & (t - 1)) == 0 else t * 4 // 3  # 64 -> 96 -> 128 -> 192 -> 256 ...
    return sizes + [max_tokens]


def write_block_tables(tables: np.ndarray, block_tables: torch.Tensor, null_block: int) -> None:
    """Sequence s's block table [S, W'] (-1 padded) into row s + 1 of the static ``tables`` [>= S + 1, W], the rest
    of those rows and row 0 the null block."""
    bt = block_tables.numpy()
    s = bt.shape[0]
    tables[0] = null_block
    tables[1:s + 1] = null_block
    tables[1:s + 1, :bt.shape[1]] = np.where(bt >= 0, bt, null_block)


class MixedInputs:
    """Static inputs of the largest bucket; ``fill`` writes a step, ``inputs(size)`` is what bucket ``size`` reads.
    The same interface as DecodeInputs (``buckets``, ``fits``, ``fill``, ``inputs``, ``row_ids``, ``plan_id``)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int, null_block: int,
                 n_cols: int, row_layers: list[int], device: torch.device, max_logits: int | None = None):
        self.buckets = token_buckets(max_tokens)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.max_logits = min(max_logits or max_seqs, max_tokens)  # LM-head rows (the sampler's reservation)
        self.max_rows, self.unit = max_tokens, "tokens"
        self.max_model_len, self.block_size, self.null_block = max_model_len, block_size, null_block
        self.width = -(-max_model_len // block_size)
        self.n_cols, self.row_layers = n_cols, list(row_layers)
        t, s = max_tokens, max_seqs
        self.max_prefill = self.prefill_slots(t)
        self.max_tiles = self.tile_slots(t)
        # [tokens | positions | slots | decode (row, token, len) | prefill (row, start, q_len, ctx) | tiles
        #  (entry, m0) | LM-head rows | row ids per layer | plan id | block tables], the block tables last so a step
        #  copies only the rows it uses
        sizes = [("token_ids", t), ("positions", t), ("slot_mapping", t), ("decode", 3 * s),
                 ("prefill", 4 * self.max_prefill), ("tiles", 2 * self.max_tiles), ("logits", self.max_logits),
                 ("row_ids", len(self.row_layers) * t * n_cols), ("plan_id", 1), ("block_tables", (s + 1) * self.width)]
        self._at, at = lay_out(sizes)
        self.upload = PinnedUpload(at, device)
        self._host = [self._views(buf) for buf in self.upload.views()]
        (self.token_ids, self.positions, self.slot_mapping, self.decode, self.prefill, self.tiles, self.logits_rows,
         self.row_ids, self.plan_id, self.block_tables) = self._views(self.upload.device_buffer)
        for buf in [self.upload.device_buffer, *self.upload.views()]:  # an inert step until one is filled
            self._pad(self._views(buf), tokens=0, decodes=0, prefills=0, tiles=0, sampled=0)
        self.arange = torch.arange(s + 2, dtype=torch.long, device=device)
        self.zeros = torch.zeros(s + 1, dtype=torch.long, device=device)

    @staticmethod
    def prefill_slots(tokens: int) -> int:
        return tokens // 2 + 1

    @staticmethod
    def tile_slots(tokens: int) -> int:
        return tokens // PREFILL_BLOCK_M + MixedInputs.prefill_slots(tokens)

    def _views(self, buf):
        """Views of one buffer (pinned numpy or the device tensor) in the layout above."""
        v = {name: buf[a:b] for name, (a, b) in self._at.items()}
        s = self.max_seqs
        return (v["token_ids"], v["positions"], v["slot_mapping"], v["decode"].reshape(3, s),
                v["prefill"].reshape(4, self.max_prefill), v["tiles"].reshape(2, self.max_tiles), v["logits"],
                {lid: v["row_ids"][i * self.max_tokens * self.n_cols:(i + 1) * self.max_tokens * self.n_cols]
                 .reshape(self.max_tokens, self.n_cols) for i, lid in enumerate(self.row_layers)},
                v["plan_id"], v["block_tables"].reshape(s + 1, self.width))

    def _pad(self, views, tokens: int, decodes: int, prefills: int, tiles: int, sampled: int) -> None:
        """Make everything after the step's own entries inert (see the module docstring): unused tiles point at the
        first unused prefill slot, which ``fits`` keeps free."""
        tok, pos, slots, dec, pre, tile, logits, row_ids, _, tables = views
        tok[tokens:], pos[tokens:], slots[tokens:] = 0, 0, self.null_block * self.block_size
        for ids in row_ids.values():
            ids[tokens:] = 0
        dec[:, decodes:] = 0
        pre[:, prefills:] = 0
        tile[0, tiles:], tile[1, tiles:] = prefills, 0
        logits[sampled:] = 0
        tables[0] = self.null_block

    def fits(self, step: StepDescription) -> bool:
        """Whether a mixed graph runs ``step``: no DEAD tokens or prompt logprobs; tokens, sequences and prefill
        chunks within the largest bucket's slots."""
        if step.dead_mask is not None or step.prompt_logprobs:
            return False
        t = step.num_tokens
        if t > self.max_tokens or step.num_seqs > self.max_seqs or len(step.samples) > self.max_logits:
            return False
        size = self.bucket(t)
        chunks = [n for n in step.num_new_tokens if n > 1]
        tiles = sum(-(-n // PREFILL_BLOCK_M) for n in chunks)
        return (len(chunks) < self.prefill_slots(size) and tiles <= self.tile_slots(size)
                and step.num_seqs <= min(self.max_seqs, size))

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def inputs(self, size: int, engram_rows) -> StepInputs:
        """The model's inputs of bucket ``size``; ``engram_rows(layer_id)`` serves each Engram layer's rows."""
        d, p, nt = min(self.max_seqs, size), self.prefill_slots(size), self.tile_slots(size)
        rows = min(self.max_logits, size)
        meta = AttentionMetadata(starts=[], q_lens=[], context_lens=[], block_tables=self.block_tables,
                                 slot_mapping=self.slot_mapping[:size], write_keep=None,
                                 decode_seqs=self.decode[0, :d], decode_tokens=self.decode[1, :d],
                                 decode_lens=self.decode[2, :d], decode_max_len=self.max_model_len, prefill=[],
                                 prefill_index=self.prefill[:, :p], prefill_tiles=self.tiles[:, :nt])
        s = self.max_seqs + 1
        return StepInputs(token_ids=self.token_ids[:size], positions=self.positions[:size],
                          cu_seqlens=self.arange[:s + 1], context_lens=self.zeros[:s], block_tables=self.block_tables,
                          slot_mapping=self.slot_mapping[:size], engram_rows=engram_rows,
                          logits_indices=self.logits_rows[:rows], attention=meta)

    def fill(self, step: StepDescription, patch: PendingPatch | None) -> int:
        """Write the step into its bucket's static inputs (padded, pending tokens patched on device) -> bucket size."""
        t, s = step.num_tokens, step.num_seqs
        size = self.bucket(t)
        turn = self.upload.begin()
        tok, pos, slots, dec, pre, tiles, logits, row_ids, plan_id, tables = self._host[turn]
        tok[:t], pos[:t], slots[:t] = step.token_ids.numpy(), step.positions.numpy(), step.slot_mapping.numpy()
        for lid, ids in row_ids.items():
            ids[:t] = step.engram_row_ids[lid].numpy()  # [T, n_cols]
        cu = step.cu_seqlens.numpy()
        ctx = step.context_lens.numpy()
        q = np.diff(cu)
        one = np.flatnonzero(q == 1)
        dec[0, :one.size], dec[1, :one.size], dec[2, :one.size] = one + 1, cu[one], ctx[one]
        many = np.flatnonzero(q > 1)
        pre[0, :many.size], pre[1, :many.size], pre[2, :many.size], pre[3, :many.size] = (
            many + 1, cu[many], q[many], ctx[many])
        per = -(-q[many] // PREFILL_BLOCK_M)  # query tiles of each prefill entry
        entry = np.repeat(np.arange(many.size), per)
        m0 = (np.arange(entry.size) - np.repeat(np.cumsum(per) - per, per)) * PREFILL_BLOCK_M
        tiles[0, :entry.size], tiles[1, :entry.size] = entry, m0
        rows = np.asarray(step.logits_indices, dtype=np.int64)
        logits[:rows.size] = rows
        self._pad(self._host[turn], tokens=t, decodes=one.size, prefills=many.size, tiles=entry.size,
                  sampled=rows.size)
        write_block_tables(tables, step.block_tables, self.null_block)
        plan_id[0] = step.step_id  # the plan id the lookup branch tags its rows with
        self.upload.upload(turn, self._at["block_tables"][0] + (s + 1) * self.width)
        if patch is not None:
            self.token_ids.index_copy_(0, patch.rows, patch.token_ids)
            for lid, ids in self.row_ids.items():
                ids.index_copy_(0, patch.rows, patch.row_ids[lid])
        return size
