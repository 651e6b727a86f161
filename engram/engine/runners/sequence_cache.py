"""The step runner of models that keep per-sequence caches instead of a paged KV cache (DeepSeek-V4): the eager path
(uploads, staged Engram rows, tokens in flight, prompt logprobs as ``EagerRunner``), with one ``SequenceCache`` per
running sequence kept here by sequence id. A sequence at start position 0 gets a fresh cache (new, or recomputed after a
preemption); a cache is replaced only after the step's forward succeeded, so a failed step commits nothing; ``free``
drops finished sequences' caches."""
from __future__ import annotations

import torch

from engram.engine.lookup import StagedRows
from engram.engine.pending import PendingPatch
from engram.engine.runners.eager import EagerRunner
from engram.engine.step import StepDescription
from engram.model.inputs import StepInputs
from engram.transfer import to_device


class SequenceCacheRunner(EagerRunner):
    """Covers every step; the model's ``forward(step, caches) -> (hidden, new caches)``."""

    name = "eager"

    def __init__(self, model, lookup, device: torch.device, dtype: torch.dtype, ecfg):
        super().__init__(model, None, lookup, device, dtype, ecfg)
        self.caches: dict = {}  # seq id -> the model's SequenceCache after its last step

    def free(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.caches.pop(sid, None)

    def cache_bytes(self) -> int:
        """Bytes the running sequences' caches hold."""
        return sum(c.nbytes() for c in self.caches.values())

    @torch.inference_mode()
    def run(self, step: StepDescription, staged: StagedRows, patch: PendingPatch | None = None) -> torch.Tensor:
        dev = self.device
        caches = []
        for sid, start in zip(step.seq_ids, step.start_positions):
            cache = self.model.empty_cache(self.dtype, dev) if start == 0 else self.caches.get(sid)
            if cache is None or cache.position != start:
                held = "none" if cache is None else f"{cache.position} tokens"
                raise RuntimeError(f"sequence {sid}: step {step.step_id} continues it at position {start} but its "
                                   f"cache holds {held}")
            caches.append(cache)
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
        self.caches.update(zip(step.seq_ids, new))  # commit: the forward succeeded
        return logits
