"""The static inputs of verify CUDA graphs (speculative decoding): a step whose every sequence decodes its last token
and up to K drafts is a fixed-shape bucket of S_b sequences x (K + 1) rows, S_b one of the decode graphs' batch sizes
(``graph_buckets``), K the speculative config's. Row j of sequence s sits at bucket row s*(K+1) + j::

    bucket rows (K = 3)   | s0: t  d1 d2 d3 | s1: t  d1 -- -- | s2: t  -- -- -- | pad sequence: -- -- -- -- |
    KV length of the row  |     c  c+1 ...  |     c' c'+1 1  1 |     c''  1  1  1 |               1  1  1  1  |

Each row is a decode query of its own over its sequence's block table, with the KV length of its position + 1: that is
the causal mask within the K + 1 (the K/V of all rows are written before any layer attends), and the decode kernel's
result for a row does not depend on the batch. Padding — the missing drafts of a sequence with fewer than K, and whole
padding sequences — is inert as in the decode graphs: token 0 at position 0, its K/V written into a block no sequence
owns (``null_block``, block-table row 0; sequence s reads row s + 1) and read back from there (KV length 1), Engram
row 0. The LM-head rows list the real rows first, in the step's packing order, so the logits' first R rows are the
verifier's (R = S + sum of drafts); padding rows' logits follow and are never read.

The paper variant's ShortConv runs inside the graph on static states [S_b, L, C] with the bucket's fixed packing
(K + 1 rows a sequence) and K rows more kept (``ShortConvState.extra``): its window ends at the sequence's last bucket
row, so the state after the step ends ``K - accepted`` rows before it (``dropped``), whatever padding the sequence had.
Padding rows come after a sequence's real ones, and the conv is causal: they never reach a real row's output."""
from __future__ import annotations

import numpy as np
import torch

from engram.config import EngramConfig
from engram.engine.pending import PendingPatch
from engram.engine.runners.decode_inputs import graph_buckets
from engram.engine.runners.mixed_inputs import write_block_tables
from engram.engine.runners.upload import PinnedUpload, lay_out
from engram.engine.step import StepDescription
from engram.model.inputs import StepInputs
from engram.model.layers.attention import AttentionMetadata
from engram.short_conv import ShortConvState, history_len


class VerifyInputs:
    """Static inputs of the largest bucket; ``fill`` writes a step, ``inputs(size)`` is what bucket ``size`` (its token
    rows) reads. The interface of DecodeInputs (``buckets``, ``max_rows``, ``fits``, ``fill``, ``inputs``, ``row_ids``,
    ``plan_id``). ``conv``: (Engram config, its layers, dtype) of the paper variant's conv states, None without;
    ``conv_tap``: the conv hands out every row's inputs (``ShortConvState.tapped`` [size, C], the prefix cache's)."""

    def __init__(self, max_batch: int, num_speculative_tokens: int, max_model_len: int, block_size: int,
                 null_block: int, n_cols: int, row_layers: list[int], device: torch.device,
                 conv: tuple[EngramConfig, list[int], torch.dtype] | None = None, conv_tap: bool = False):
        self.k = num_speculative_tokens
        self.rows_per_seq = self.k + 1
        self.seq_buckets = graph_buckets(max_batch)
        self.buckets = [b * self.rows_per_seq for b in self.seq_buckets]  # token rows of each bucket
        self.max_seqs = self.seq_buckets[-1]
        self.max_rows, self.unit = self.buckets[-1], "tokens"
        self.max_model_len, self.block_size, self.null_block = max_model_len, block_size, null_block
        self.width = -(-max_model_len // block_size)
        self.n_cols, self.row_layers = n_cols, list(row_layers)
        n = self.max_rows
        # [tokens | positions | slots | KV length of each row | its block-table row | LM-head rows | bucket row of each
        #  packed token | row ids per layer | plan id | block tables], the block tables last so a step copies only the
        #  rows it uses; one non-blocking copy a step (upload.py)
        sizes = [("token_ids", n), ("positions", n), ("slot_mapping", n), ("lens", n), ("table_rows", n),
                 ("logits", n), ("bucket_rows", n), ("row_ids", len(self.row_layers) * n * n_cols), ("plan_id", 1),
                 ("block_tables", (self.max_seqs + 1) * self.width)]
        self._at, at = lay_out(sizes)
        self.upload = PinnedUpload(at, device)
        self._host = [self._views(buf) for buf in self.upload.views()]
        (self.token_ids, self.positions, self.slot_mapping, self.lens, self.table_rows, self.logits_rows,
         self.bucket_rows, self.row_ids, self.plan_id, self.block_tables) = self._views(self.upload.device_buffer)
        for buf in [self.upload.device_buffer, *self.upload.views()]:  # every row inert until a step is filled
            self._pad(self._views(buf), n)
        self.arange = torch.arange(n + 1, dtype=torch.long, device=device)
        self.zeros = torch.zeros(self.max_seqs + 1, dtype=torch.long, device=device)
        self.conv: dict[int, torch.Tensor] = {}  # Engram layer -> [max_seqs, L, C] conv states of the bucket
        self._conv_states: dict[int, dict[int, ShortConvState]] = {}  # bucket rows -> layer -> its static state
        self.conv_tap = conv_tap
        if conv is not None:
            ecfg, layers, dtype = conv
            self.conv = {lid: torch.zeros(self.max_seqs, history_len(ecfg), ecfg.hc_mult * ecfg.hidden_size,
                                          dtype=dtype, device=device) for lid in layers}
        self.num_rows = 0  # real verify rows filled so far
        self.padded_rows = 0  # padding rows of the buckets filled so far (missing drafts and padding sequences)
        self.short_seqs = 0  # sequences that proposed fewer than K drafts, padded in their bucket
        self.last_rows: np.ndarray | None = None  # [T] bucket row of each packed token of the last step filled

    @classmethod
    def of_config(cls, config, max_model_len: int, null_block: int, ecfg: EngramConfig | None, row_layers: list[int],
                  device: torch.device, dtype: torch.dtype, conv_states=None) -> "VerifyInputs":
        """The verify buckets of an EngineConfig with a speculative config: the decode graphs' batch sizes up to
        ``min(max_num_seqs, max_graph_batch)`` x (K + 1) rows; ``conv_states``: the paper variant's ``ConvStates``."""
        c = config
        return cls(min(c.max_num_seqs, c.max_graph_batch), c.speculative_config.num_speculative_tokens, max_model_len,
                   c.block_size, null_block, ecfg.n_cols if ecfg else 0, row_layers, device,
                   conv=(ecfg, conv_states.layers, dtype) if conv_states is not None else None,
                   conv_tap=conv_states is not None and conv_states.conv_blocks is not None)

    def _views(self, buf):
        """Views of one buffer (pinned numpy or the device tensor) in the layout above."""
        v = {name: buf[a:b] for name, (a, b) in self._at.items()}
        n = self.max_rows
        ids = {lid: v["row_ids"][i * n * self.n_cols:(i + 1) * n * self.n_cols].reshape(n, self.n_cols)
               for i, lid in enumerate(self.row_layers)}
        return (v["token_ids"], v["positions"], v["slot_mapping"], v["lens"], v["table_rows"], v["logits"],
                v["bucket_rows"], ids, v["plan_id"], v["block_tables"].reshape(self.max_seqs + 1, self.width))

    def _pad(self, views, size: int) -> None:
        """The first ``size`` rows inert (the module docstring's padding): ``fill`` then writes the real ones."""
        tok, pos, slots, lens, table_rows, logits, _, row_ids, _, tables = views
        tok[:size], pos[:size], slots[:size] = 0, 0, self.null_block * self.block_size
        lens[:size], table_rows[:size], logits[:size] = 1, 0, 0
        for ids in row_ids.values():
            ids[:size] = 0
        tables[0] = self.null_block

    def fits(self, step: StepDescription) -> bool:
        """Whether a verify graph runs ``step``: drafts, every sequence sampling at its last token and its drafts (its
        new tokens are exactly those), at most K drafts each, no DEAD tokens, no prompt logprobs, no prefix-cache start,
        at most the largest bucket's sequences."""
        if not step.num_drafts or step.dead_mask is not None or step.prompt_logprobs or step.cached_starts:
            return False
        s = step.num_seqs
        if s > self.max_seqs or step.sample_rows != list(range(s)):
            return False
        return all(n == k + 1 and k <= self.k for n, k in zip(step.num_new_tokens, step.num_drafts))

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.seq_buckets if b >= num_seqs) * self.rows_per_seq

    def inputs(self, size: int, engram_rows) -> StepInputs:
        """The model's inputs of bucket ``size`` (token rows); ``engram_rows(layer_id)`` serves each layer's rows."""
        meta = AttentionMetadata(starts=[], q_lens=[], context_lens=[], block_tables=self.block_tables,
                                 slot_mapping=self.slot_mapping[:size], write_keep=None,
                                 decode_seqs=self.table_rows[:size], decode_tokens=self.arange[:size],
                                 decode_lens=self.lens[:size], decode_max_len=self.max_model_len)
        s = self.max_seqs + 1  # block-table rows (StepInputs' shape checks; the metadata above is what attention reads)
        return StepInputs(token_ids=self.token_ids[:size], positions=self.positions[:size],
                          cu_seqlens=self.arange[:s + 1], context_lens=self.zeros[:s], block_tables=self.block_tables,
                          slot_mapping=self.slot_mapping[:size], engram_rows=engram_rows,
                          conv_state=self.conv_states(size) or None, logits_indices=self.logits_rows[:size],
                          attention=meta)

    def conv_states(self, size: int) -> dict[int, ShortConvState]:
        """The paper variant's static conv states of bucket ``size`` ({} without): the same objects at every call, so
        the window (``ShortConvState.window``) and tapped inputs a replay leaves are read where the graph wrote them."""
        if size not in self._conv_states and self.conv:
            seqs = size // self.rows_per_seq
            cu = self.arange[:seqs + 1] * self.rows_per_seq  # [S_b + 1]: K + 1 rows a sequence
            self._conv_states[size] = {
                lid: ShortConvState(buf[:seqs], cu, tap_rows=self.arange[:size] if self.conv_tap else None,
                                    extra=self.k) for lid, buf in self.conv.items()}
        return self._conv_states.get(size, {})

    def load_conv(self, states: list[dict[int, ShortConvState]]) -> None:
        """Copy the step's sequences' states [1, L, C] each into the static ones, in packing order."""
        for lid, buf in self.conv.items():
            buf[:len(states)].copy_(torch.cat([st[lid].conv for st in states]))

    def dropped(self, size: int, accepted: torch.Tensor) -> torch.Tensor:
        """[S_b] int64: rows each bucket sequence's conv state gives back from its window's end, from the verifier's
        ``accepted`` [S] (its drafts' padding and its rejected drafts: K - accepted; padding sequences none)."""
        out = torch.zeros(size // self.rows_per_seq, dtype=torch.long, device=accepted.device)
        out[:accepted.numel()] = self.k - accepted
        return out

    def place(self, static: torch.Tensor, rows: torch.Tensor, size: int) -> None:
        """Copy a layer's rows staged in packing order (``rows`` [T, n_cols, D], the host-read lookup's) into its static
        rows of bucket ``size`` (``static`` [>= size, n_cols, D]) at their bucket rows; the padding rows become zero
        rows, so the static rows are a function of the step alone (no earlier step's rows stay behind)."""
        static[:size].zero_()
        static.index_copy_(0, self.bucket_rows[:rows.shape[0]], rows.to(static.dtype))  # a no-op cast as a rule

    def stats(self) -> dict:
        """The bucket counters both verify runners report (engine.stats()["verify_graph"])."""
        return {"verify_graph_rows": self.num_rows, "verify_graph_padded_rows": self.padded_rows,
                "verify_graph_short_seqs": self.short_seqs}

    def fill(self, step: StepDescription, patch: PendingPatch | None) -> int:
        """Write the step into its bucket's static inputs (padded, tokens on the device patched in) -> bucket rows."""
        t, s = step.num_tokens, step.num_seqs
        size = self.bucket(s)
        turn = self.upload.begin()
        views = self._host[turn]
        tok, pos, slots, lens, table_rows, logits, bucket_rows, row_ids, plan_id, tables = views
        self._pad(views, size)
        q = np.diff(step.cu_seqlens.numpy())  # [S] new tokens: the last one and the drafts
        first = np.repeat(step.cu_seqlens.numpy()[:-1], q)  # [T] each token's sequence's first packed row
        seq = np.repeat(np.arange(s), q)  # [T]
        rows = seq * self.rows_per_seq + np.arange(t) - first  # [T] bucket row of each packed token
        tok[rows], pos[rows], slots[rows] = step.token_ids.numpy(), step.positions.numpy(), step.slot_mapping.numpy()
        lens[rows] = pos[rows] + 1  # the causal mask within the K + 1: each row sees the keys up to its own
        table_rows[rows] = seq + 1
        logits[:t] = rows  # every packed token of a verify step gets logits, in packing order
        bucket_rows[:t] = rows
        for lid, ids in row_ids.items():
            ids[rows] = step.engram_row_ids[lid].numpy()  # [T, n_cols]
        write_block_tables(tables, step.block_tables, self.null_block)
        plan_id[0] = step.step_id  # the plan id the lookup branch tags its rows with
        self.upload.upload(turn, self._at["block_tables"][0] + (s + 1) * self.width)
        if patch is not None:
            at = self.bucket_rows.index_select(0, patch.rows)  # [P] bucket rows of the patched packed rows
            self.token_ids.index_copy_(0, at, patch.token_ids)
            for lid, ids in self.row_ids.items():
                ids.index_copy_(0, at, patch.row_ids[lid])
        self.num_rows += t
        self.padded_rows += size - t
        self.short_seqs += sum(k < self.k for k in step.num_drafts)
        self.last_rows = rows
        return size
