"""The engine's side of speculative decoding (``Speculator``): how many drafts each decoding sequence gets in a step,
which tokens they are (n-gram) or how many the Worker's draft model fills in, what a collected step commits (its
accepted count; a draft model's progress through each sequence) and the counters ``engine.stats()['speculative']``
reports. It never touches a device."""
from __future__ import annotations

from typing import Any

import torch

from engram.engine.sequence import Sequence
from engram.engine.spec.config import SpeculativeConfig
from engram.engine.spec.draft_plan import DraftPlanner
from engram.engine.spec.drafter import check_draft, load_draft
from engram.engine.spec.ngram import NgramProposer
from engram.hashing import NgramHasher
from engram.model.deepseek_v4.config import ARCHITECTURES as SEQUENCE_CACHE_ARCHITECTURES


class Speculator:
    """``draft``: the draft model's LoadedModel and ``draft_planner`` its passes' planner (method "draft_model")."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None,
                 draft_planner: DraftPlanner | None = None):
        self.config, self.max_model_len = config, max_model_len
        self.draft, self.draft_planner = draft, draft_planner
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)
        self.spec_steps = 0  # sequence-steps that verified at least one draft
        self.draft_tokens = 0  # drafts verified
        self.accepted_tokens = 0  # drafts accepted
        self.plain_steps = 0  # decode sequence-steps that went without drafts (no match, limits, batch size)
        self.accepted_at = [0] * config.num_speculative_tokens  # [K] steps whose draft i was accepted

    @classmethod
    def for_engine(cls, config: SpeculativeConfig, max_model_len: int, loaded, executor, dtype: torch.dtype,
                   device: torch.device, block_size: int) -> "Speculator":
        """The engine's speculator; refuses what cannot speculate here (DeepSeek-V4, a draft model behind a
        multi-process executor) and, for a draft model, loads it (or takes the in-process Worker's) and checks it."""
        arch = getattr(loaded.model_config, "architecture", None)
        if arch in SEQUENCE_CACHE_ARCHITECTURES:
            raise ValueError(f"speculative_config: {arch} models cannot speculate here: their compressor state "
                             "(unclosed windows, compressed entries) cannot be rewound past rejected drafts; "
                             "drop speculative_config")
        if not config.uses_draft_model:
            return cls(config, max_model_len)
        if executor is None:
            draft = load_draft(config, dtype, device)
        elif getattr(getattr(executor, "worker", None), "draft", None) is not None:
            draft = executor.worker.draft  # an in-process Worker built by the caller
        else:
            raise NotImplementedError("speculative_config method 'draft_model' runs the draft on one in-process "
                                      "Worker; tensor-parallel ranks take the n-gram proposer")
        check_draft(loaded, draft)
        ecfg = draft.engram_config
        hasher = NgramHasher.from_tokenizer(ecfg, loaded.compressed_tokenizer) if ecfg else None
        has_dead = bool(loaded.engram_config.dead_token_ids) if loaded.engram_config else False
        return cls(config, max_model_len, draft,
                   DraftPlanner(hasher, loaded.engram_config is not None, block_size, has_dead))

    def drafts(self, seq: Sequence, room: int, num_running: int) -> tuple[int, int] | int:
        """The drafts of decoding ``seq`` this step within ``room`` spare budget tokens: the span of its tokens the
        n-gram proposer copies, or a draft model's count (its tokens come from the Worker). Never more than the
        sequence may still emit minus one (the verified token after them), nor past max_model_len."""
        c = self.config
        catch_up = self.catch_up(seq)
        # the draft model first catches up on the last step's final draft: its K rows then hold one draft fewer
        k = min(c.num_speculative_tokens - catch_up, (room - catch_up) // c.budget_per_draft,
                self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        if c.disable_by_batch_size is not None and num_running >= c.disable_by_batch_size:
            k = 0
        if k <= 0:
            return (0, 0) if self.proposer is not None else 0
        return self.proposer.propose(seq.token_ids, k) if self.proposer is not None else k

    def catch_up(self, seq: Sequence) -> int:
        """1 when the draft model must first run ``seq``'s last accepted draft (every draft of its last step was
        accepted, the last one never fed to the draft model), else 0."""
        return int(self.config.uses_draft_model and seq.num_draft_computed < seq.num_computed_tokens)

    def cost(self, seq: Sequence, num_drafts: int) -> int:
        """Step-budget tokens of ``num_drafts`` drafts beyond the sequence's own token: their verify rows, and a draft
        model's rows (the drafts it feeds itself and its catch-up)."""
        if not num_drafts:
            return 0
        return num_drafts * self.config.budget_per_draft + self.catch_up(seq)

    def commit(self, seq: Sequence, start: int, num_new: int, num_drafts: int, accepted: int) -> None:
        """A collected step ran ``num_new`` tokens of ``seq`` from ``start``, the last ``num_drafts`` of them drafts,
        ``accepted`` of which were accepted: give back the rejected drafts' positions (their KV slots are written again
        by the next step) and advance the draft model's progress."""
        if num_drafts:
            seq.num_computed_tokens -= num_drafts - accepted
            self.spec_steps += 1
            self.draft_tokens += num_drafts
            self.accepted_tokens += accepted
            for i in range(accepted):
                self.accepted_at[i] += 1
        elif num_new == 1 and start >= seq.num_prompt_tokens - 1:
            self.plain_steps += 1
        if self.config.uses_draft_model:
            # the draft ran the known tokens and drafts 1..k-1; those accepted have valid draft KV
            known = num_new - num_drafts
            seq.num_draft_computed = start + known + (min(accepted, num_drafts - 1) if num_drafts else 0)

    def stats(self) -> dict[str, Any]:
        """Counters since start; ``mean_acceptance_length``: tokens emitted per verifying sequence-step (1 + accepted
        drafts), vLLM's figure."""
        return {"method": self.config.method, "num_speculative_tokens": self.config.num_speculative_tokens,
                "spec_steps": self.spec_steps, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "plain_decode_steps": self.plain_steps,
                "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
                "mean_acceptance_length": 1.0 + self.accepted_tokens / self.spec_steps if self.spec_steps else 0.0,
                "accepted_at": list(self.accepted_at)}
