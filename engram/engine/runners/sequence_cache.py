"""The step runner of models whose caches are cache groups instead of one paged KV cache (DeepSeek-V4): the eager path
(uploads, staged Engram rows, tokens in flight, prompt logprobs as ``EagerRunner``). Each step builds every packed
sequence's ``SequenceCache`` from the Worker's pool of group pages (``GroupPool.gather``, by the step's
``group_tables``; position 0 starts fresh, new or recomputed after a preemption), runs the model on them, and stores
what the step added (``GroupPool.write``) only after the forward succeeded, so a failed step commits nothing."""
from __future__ import annotations

import torch

from engram.engine.lookup import StagedRows
from engram.engine.pending import PendingPatch
from engram.engine.runners.eager import EagerRunner
from engram.engine.runners.group_pool import GroupPool
from engram.engine.step import StepDescription
from engram.model.inputs import StepInputs
from engram.transfer import to_device


class SequenceCacheRunner(EagerRunner):
    """Covers every step; the model's ``forward(step, caches) -> (hidden, new caches)``."""

    name = "eager"

    def __init__(self, model, pool: GroupPool, lookup, device: torch.device, dtype: torch.dtype, ecfg):
        super().__init__(model, None, lookup, device, dtype, ecfg)
        self.pool = pool

    @torch.inference_mode()
    def run(self, step: StepDescription, staged: StagedRows, patch: PendingPatch | None = None) -> torch.Tensor:
        dev = self.device
        caches = self.pool.gather(step, lambda: self.model.empty_cache(self.dtype, dev))
        token_ids, dead_mask = self.tokens(step, patch)
        inputs = StepInputs(
            token_ids=token_ids, positions=to_device(step.positions, dev), cu_seqlens=to_device(step.cu_seqlens, dev),
            context_lens=to_device(step.context_lens, dev), block_tables=to_device(step.block_tables, dev),
            slot_mapping=to_device(step.slot_mapping, dev),
            engram_rows=lambda layer_id: staged.rows(layer_id, step.step_id), dead_mask=dead_mask,
            logits_indices=to_device(step.logits_indices + step.prompt_rows, dev))
        hidden, new = self.model.forward(inputs, caches)  # [N + P, H]
        n = len(step.sample_rows)
        self.prompt_scores = self._score_prompt(step, hidden[n:]) if step.prompt_logprobs else None
        logits = self.model.compute_logits(hidden[:n])  # [N, vocab] float32
        self.pool.write(step, new)  # commit: the forward succeeded
        return logits
