"""The static inputs of decode CUDA graphs: buckets (``graph_buckets``), buffers filled from a StepDescription by one
pinned non-blocking copy a step. Padding sequences S..B decode token 0 into a KV block no sequence owns
(``null_block``), their logits dropped. Prefill, mixed, oversized, DEAD-token and prompt-logprob steps run eager."""
from __future__ import annotations

import logging

import numpy as np
import torch

from engram.engine.pending import PendingPatch
from engram.engine.runners.upload import PinnedUpload
from engram.engine.step import StepDescription
from engram.model.inputs import StepInputs
from engram.model.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

# Only this thread's unsafe CUDA calls may break a capture: another thread's (a background lookup allocating
# pinned staging) would invalidate a "global"-mode capture of another engine's graphs.
CAPTURE_ERROR_MODE = "thread_local"


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 24, 32, then every 16, up to and including max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32) if b < max_num_seqs]
    sizes += list(range(48, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def graph_reserve_bytes(config, step_peak_bytes: int | None, rows: int) -> int:
    """The graphs' pool in the KV plan: rows / max_num_batched_tokens of the profiled step's peak (``rows``: the token
    rows of the largest bucket captured, max_num_batched_tokens with mixed-step graphs, whose largest bucket is that
    step; 0: no graphs)."""
    if step_peak_bytes is None or not rows:
        return 0
    return step_peak_bytes * rows // config.max_num_batched_tokens


class DecodeInputs:
    """Static inputs of the largest bucket: ``fill`` writes a step, ``inputs(size)`` is what bucket ``size`` reads.
    ``row_layers``' row ids are padded with ``pad_row_id`` (0 for a gather, -1 for a probe)."""

    def __init__(self, max_batch: int, max_model_len: int, block_size: int, null_block: int, n_cols: int,
                 row_layers: list[int], pad_row_id: int, device: torch.device):
        self.buckets = graph_buckets(max_batch)
        self.max_rows, self.unit = self.buckets[-1], "batch"  # token rows of the largest bucket; what buckets count
        self.max_model_len, self.block_size, self.null_block = max_model_len, block_size, null_block
        self.max_blocks = -(-max_model_len // block_size)
        self.n_cols, self.row_layers, self.pad_row_id = n_cols, list(row_layers), pad_row_id
        b = self.buckets[-1]
        # Every per-step input in one int64 buffer, [token ids | positions | KV lengths | slots | block tables |
        # row ids per layer | plan id], one non-blocking copy a step (upload.py).
        self.upload = PinnedUpload(b * (4 + self.max_blocks + n_cols * len(self.row_layers)) + 1, device)
        self.dev_in = self.upload.device_buffer
        self._host_np = self.upload.views()
        self._host = [self._views(buf, b) for buf in self._host_np]  # numpy views of the pinned buffers
        self.token_ids, self.positions, self.context_lens, self.slot_mapping, self.block_tables, self.row_ids = (
            self._views(self.dev_in, b))
        self.plan_id = self.dev_in[-1:]  # [1]: the id of the step being replayed
        self.context_lens.fill_(1)
        for ids in self.row_ids.values():  # padding until a step fills them: the capture warm-up must not wait
            ids.fill_(pad_row_id)
        self.slot_mapping.fill_(null_block * block_size)
        self.block_tables.fill_(null_block)
        self.arange = torch.arange(b + 1, dtype=torch.long, device=device)
        self._warned_too_large = False

    def _views(self, buf, b: int):
        """(token ids, positions, KV lengths, slots [b], block tables [b, max_blocks], {layer: row ids [b, n_cols]})."""
        parts = [buf[i * b:(i + 1) * b] for i in range(4)]
        at = b * (4 + self.max_blocks)
        tables = buf[4 * b:at].reshape(b, self.max_blocks)
        ids = {lid: buf[at + i * b * self.n_cols:at + (i + 1) * b * self.n_cols].reshape(b, self.n_cols)
               for i, lid in enumerate(self.row_layers)}
        return (*parts, tables, ids)

    def fits(self, step: StepDescription) -> bool:
        """Whether a graph runs ``step``: one sampled token a sequence, no DEAD tokens, no prompt logprobs, a bucket."""
        if step.dead_mask is not None or step.prompt_logprobs or any(n != 1 for n in step.num_new_tokens):
            return False
        if len(step.sample_rows) != step.num_seqs or step.num_drafts:  # a one-token prompt chunk that does not sample yet
            return False
        if step.num_seqs > self.buckets[-1]:
            if not self._warned_too_large:
                log.info("decode batch of %d sequences is above the largest CUDA graph (%d): runs eager",
                         step.num_seqs, self.buckets[-1])
                self._warned_too_large = True
            return False
        return True

    def inputs(self, size: int, engram_rows) -> StepInputs:
        """The model's inputs of bucket ``size``; ``engram_rows(layer_id)`` serves each Engram layer's rows."""
        idx = self.arange[:size]
        meta = AttentionMetadata(starts=[], q_lens=[], context_lens=[], block_tables=self.block_tables[:size],
                                 slot_mapping=self.slot_mapping[:size], write_keep=None, decode_seqs=idx,
                                 decode_tokens=idx, decode_lens=self.context_lens[:size],
                                 decode_max_len=self.max_model_len)
        return StepInputs(token_ids=self.token_ids[:size], positions=self.positions[:size],
                          cu_seqlens=self.arange[:size + 1], context_lens=self.context_lens[:size],
                          block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
                          engram_rows=engram_rows, logits_indices=idx, attention=meta)

    def place(self, static: torch.Tensor, rows: torch.Tensor, size: int) -> None:
        """Copy a layer's staged rows (``rows`` [S, n_cols, D], one a sequence) into its static rows (``static``
        [>= size, n_cols, D]): sequence s is bucket row s; the padding rows' outputs are dropped, left as they are."""
        static[:rows.shape[0]].copy_(rows)

    def fill(self, step: StepDescription, patch: PendingPatch | None) -> int:
        """Write the step into its bucket's static inputs (padded, pending tokens patched on device) -> bucket size."""
        s = step.num_seqs
        size = next(b for b in self.buckets if b >= s)
        turn = self.upload.begin()
        tok, pos, ctx, slots, tables, row_ids = self._host[turn]  # numpy views of a pinned staging buffer
        tok[:s], pos[:s], ctx[:s], slots[:s] = (step.token_ids.numpy(), step.positions.numpy(),
                                                step.context_lens.numpy(), step.slot_mapping.numpy())
        tok[s:size], pos[s:size], ctx[s:size], slots[s:size] = 0, 0, 1, self.null_block * self.block_size
        bt = step.block_tables.numpy()  # [S, W], -1 padded
        tables[:size] = self.null_block
        tables[:s, :bt.shape[1]] = np.where(bt >= 0, bt, self.null_block)
        for lid, ids in row_ids.items():
            ids[:s] = step.engram_row_ids[lid].numpy()  # [S, n_cols]
            ids[s:size] = self.pad_row_id
        self._host_np[turn][-1] = step.step_id  # the plan id the lookup branch tags its rows with
        self.upload.upload(turn)
        if patch is not None:
            self.token_ids.index_copy_(0, patch.rows, patch.token_ids)
            for lid, ids in self.row_ids.items():
                ids.index_copy_(0, patch.rows, patch.row_ids[lid])
        return size


def warm_up(device: torch.device, fn) -> None:
    """Run ``fn()`` once on a side stream before a capture (Triton compiles, cuBLAS picks its kernels)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)


def capture_progress(buckets: list[int], progress: bool | None):
    """The buckets largest first (the smaller graphs reuse its pool), with a progress bar on a tty."""
    from tqdm.auto import tqdm

    return tqdm(list(reversed(buckets)), desc="capture CUDA graphs", unit="graph",
                disable=None if progress is None else not progress)
