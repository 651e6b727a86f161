"""The eager step runner: any step, its lookups staged by the lookup executor, then one forward of the model. ``run``
uploads the step's CPU tensors (pinned, non-blocking), builds the attention layout from the host numbers (no read-back),
serves the staged rows through ``engram_rows`` (checking the step) and returns logits [N, vocab]. The paper variant's
conv states live in ``conv_states`` (conv_states.py), which the verify graphs share; ``free`` drops finished
sequences'."""
from __future__ import annotations

import torch

from engram.config import EngramConfig
from engram.engine.lookup import LookupExecutor, StagedRows
from engram.engine.pending import PendingPatch
from engram.engine.runners.conv_blocks import ConvBlockStore
from engram.engine.runners.conv_states import ConvStates
from engram.engine.runners.base import Forward, StepRunner
from engram.engine.spec.verify import rejected_per_sequence
from engram.engine.step import StepDescription
from engram.model.inputs import StepInputs
from engram.model.layers.attention import HostLayout
from engram.short_conv import ShortConvState
from engram.transfer import to_device

PROMPT_SCORE_ROWS = 256  # prompt rows turned into full-vocabulary logits at once (bounds the memory)


class EagerRunner(StepRunner):
    """Covers every step (prefill, mixed, decode): the Worker's fallback behind its graph runner."""
    name = "eager"

    def __init__(self, model, kv_cache, lookup: LookupExecutor, device: torch.device, dtype: torch.dtype,
                 ecfg: EngramConfig | None, conv_blocks: ConvBlockStore | None = None):
        self.model = model
        self.conv_blocks = conv_blocks  # paper variant with prefix caching: conv inputs kept with each KV block
        self.lookup = lookup
        self.kv = kv_cache
        self.device = torch.device(device)
        self.dtype = dtype
        self.ecfg = ecfg
        conv_layers = list(lookup.tables) if ecfg and ecfg.variant == "paper" else []  # this Worker's layers
        # the paper variant's per-sequence conv states (None without), shared with the verify graphs
        self.conv_states = ConvStates(ecfg, conv_layers, dtype, self.device, conv_blocks) if conv_layers else None
        self._unkept: tuple[int, dict[int, ShortConvState]] | None = None  # a speculative step's, until ``keep``

    def covers(self, step: StepDescription) -> bool:
        return True

    def launch(self, step: StepDescription, patch: PendingPatch | None) -> Forward:
        staged = self.lookup.submit(step, patch)
        try:
            logits = self.run(step, staged, patch)
        finally:
            staged.release()  # reads of layers a failed forward never reached (lookup.py: deferred)
        return Forward(logits, prompt_scores=self.prompt_scores if step.prompt_logprobs else None)

    @torch.inference_mode()
    def run(self, step: StepDescription, staged: StagedRows, patch: PendingPatch | None = None) -> torch.Tensor | None:
        """One forward -> float32 logits [len(step.samples), vocab] (a row per sampling sequence, or per verify row),
        prompt-logprob rows scored on the way (``prompt_scores``); None from a pipeline stage before the last
        (parallel/pp_stage.py: its streams went on to the next stage). ``patch``: the pending tokens' device values."""
        dev = self.device
        cu_seqlens = to_device(step.cu_seqlens, dev)  # [S+1], shared by attention and the conv states
        conv = self.conv_states.stacked(step, cu_seqlens) if self.conv_states is not None else None
        if conv is not None and step.num_drafts:  # keep room to rewind past rejected drafts (``keep``)
            for state in conv.values():
                state.extra = max(step.num_drafts)
        tails = self._tap_block_tails(step, conv)  # [R] pool rows of the conv inputs kept with the blocks
        token_ids, dead_mask = self.tokens(step, patch)
        inputs = StepInputs(
            token_ids=token_ids,
            positions=to_device(step.positions, dev),
            cu_seqlens=cu_seqlens,
            context_lens=to_device(step.context_lens, dev),
            block_tables=to_device(step.block_tables, dev),
            slot_mapping=to_device(step.slot_mapping, dev),
            engram_rows=lambda layer_id: staged.rows(layer_id, step.step_id),
            dead_mask=dead_mask,
            conv_state=conv,
            logits_indices=to_device(step.logits_indices + step.prompt_rows, dev),
            host_layout=HostLayout(step.cu_seqlens.tolist(), step.context_lens.tolist()),
        )
        hidden = self.model.forward(inputs, self.kv)  # [N + P, H], or None (a stage before the last)
        if conv is not None:
            if step.num_drafts:
                self._unkept = (step.step_id, conv)  # kept per sequence once the verifier has counted (``keep``)
            else:
                self.conv_states.keep(step, conv)
            if tails is not None:
                for lid, state in conv.items():
                    self.conv_blocks.write(lid, state.tapped, tails)
        self.prompt_scores = None
        if hidden is None:
            return None
        n = len(step.samples)  # a row per sampling sequence, or per verify row
        if step.prompt_logprobs:
            self.prompt_scores = self._score_prompt(step, hidden[n:])
        return self.model.compute_logits(hidden[:n])  # [N, vocab] float32

    def tokens(self, step: StepDescription, patch: PendingPatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's token ids [T] and DEAD mask [T] (or None) on the device, tokens in flight patched in."""
        token_ids = to_device(step.token_ids, self.device)
        dead_mask = None if step.dead_mask is None else to_device(step.dead_mask, self.device)
        if patch is not None:
            token_ids = patch.patched(token_ids, patch.token_ids)
            dead_mask = dead_mask if patch.dead is None else patch.patched(dead_mask, patch.dead)
        return token_ids, dead_mask

    def _score_prompt(self, step: StepDescription, hidden: torch.Tensor):
        """hidden [P, H] -> (target logprobs [P], top-k logprobs and ids [P, k]), PROMPT_SCORE_ROWS rows at a time."""
        k = max(p.k for p in step.prompt_logprobs)
        targets = to_device([t for p in step.prompt_logprobs for t in p.targets], self.device)  # [P]
        own, top_v, top_i = [], [], []
        for a in range(0, hidden.shape[0], PROMPT_SCORE_ROWS):
            logp = self.model.compute_logits(hidden[a:a + PROMPT_SCORE_ROWS]).log_softmax(-1)  # [r, vocab]
            own.append(logp.gather(1, targets[a:a + PROMPT_SCORE_ROWS, None]).squeeze(1))
            if k:
                v, i = logp.topk(k, dim=-1)
                top_v.append(v)
                top_i.append(i)
        return torch.cat(own), torch.cat(top_v) if k else None, torch.cat(top_i) if k else None

    @torch.inference_mode()
    def keep(self, step: StepDescription, accepted: torch.Tensor) -> None:
        """Speculative step (paper variant): each sequence's conv state becomes the window ending at its last accepted
        token — its rejected drafts before its last row dropped — and is kept under its id."""
        if self._unkept is None:
            return
        step_id, conv = self._unkept
        self._unkept = None
        if step_id != step.step_id:
            raise RuntimeError(f"step {step.step_id}: the conv state waiting to be kept is step {step_id}'s")
        dropped = rejected_per_sequence(step, accepted)  # [S]
        for state in conv.values():
            state.rewind(dropped)
        self.conv_states.keep(step, conv)

    def free(self, seq_ids: list[int]) -> None:
        if self.conv_states is not None:
            self.conv_states.free(seq_ids)

    def _tap_block_tails(self, step: StepDescription, conv: dict[int, ShortConvState] | None) -> torch.Tensor | None:
        """With ``conv_blocks``: ask each layer's call for the conv inputs of the step's tokens in the last rows of
        their blocks -> those rows' places in the pool [R] (None: nothing to keep)."""
        if conv is None or self.conv_blocks is None:
            return None
        rows, dest = self.conv_blocks.tail(step.slot_mapping)
        for state in conv.values():
            state.tap_rows = rows
        return dest

