"""The engine ↔ worker contract: one ``StepDescription`` in, one ``StepResult`` out, per step: plain, picklable
CPU data built from the scheduler's host numbers, so a Worker never reads a device tensor back to learn the
batch layout. With async scheduling N+1's decode tokens travel as ``pending_*`` references (packing.py)::

    engine (CPU)                                     worker (device)
    schedule → pack → plan lookups ──StepDescription──► upload (pinned, non-blocking) → lookups → model
    postprocess ◄────────────────────StepResult────────  sample → one read of the sampled ids"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engram.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engram.engine.spec.draft_plan import DraftPlan


@dataclass(frozen=True)
class SampleSpec:
    """How one sampling sequence picks its token this step (already resolved against its progress)."""

    temperature: float  # 0 = greedy
    top_p: float  # nucleus mass kept (1.0 = all)
    top_k: int  # tokens kept (0 = all)
    seed: int | None  # the sequence's own random stream (stateless: keyed by seed and ``draw``), None = shared
    draw: int  # which of the sequence's tokens this is (0 = first generated): the seeded stream's counter
    banned_token_ids: tuple[int, ...]  # masked to -inf this step (EOS / stop ids before min_tokens)
    forced_token_id: int  # -1, or the token emitted instead of the sampled one (forced decoding)
    logprobs: int  # -1 = none; k >= 0 = the emitted token's logprob and the top-k of this step

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_params(cls, p: SamplingParams, num_output_tokens: int, eos_token_id: int | None) -> "SampleSpec":
        """The spec of a sequence sampling its output token ``num_output_tokens`` (0-based): EOS (unless ignore_eos) and
        stop ids banned before min_tokens; the forced token at that index."""
        banned: list[int] = []
        if num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids)
            if eos_token_id is not None and not p.ignore_eos:
                banned.append(eos_token_id)
        forced = p.forced_token_ids or ()
        return cls(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, draw=num_output_tokens,
                   banned_token_ids=tuple(banned),
                   forced_token_id=forced[num_output_tokens] if num_output_tokens < len(forced) else -1,
                   logprobs=-1 if p.logprobs is None else p.logprobs)


@dataclass(frozen=True)
class PromptLogprobsSpec:
    """Prompt logprobs wanted from one prefill chunk: rows first_row.. of sequence ``seq`` predict ``targets``."""

    seq: int  # index into the step's S sequences
    first_row: int  # offset in that sequence's chunk of the first row scored
    targets: tuple[int, ...]  # the prompt tokens those rows predict (row first_row + i predicts targets[i])
    k: int  # top-k to return besides each target's own logprob


@dataclass
class StepDescription:
    """One engine step as the Worker sees it. T packed tokens of S sequences, N of which sample."""

    step_id: int  # unique per engine; staged Engram rows carry it (stale-row rejection)
    seq_ids: list[int]  # [S] engine sequence id of each packed sequence (keys the Worker's per-seq state)
    start_positions: list[int]  # [S] tokens already in the KV cache before this step (0 = fresh state)
    num_new_tokens: list[int]  # [S] tokens each sequence computes this step (>= 1)
    token_ids: torch.Tensor  # [T] int64 raw ids, sequence after sequence
    positions: torch.Tensor  # [T] int64 position of each token in its sequence
    cu_seqlens: torch.Tensor  # [S+1] int64 token offsets
    context_lens: torch.Tensor  # [S] int64 KV length of each sequence after the step
    block_tables: torch.Tensor  # [S, max_blocks] int64, -1 padded
    slot_mapping: torch.Tensor  # [T] int64 flat KV slot of each new token
    dead_mask: torch.Tensor | None  # [T] bool DEAD tokens (Engram gate 0); None when the model has none
    engram_row_ids: dict[int, torch.Tensor]  # Engram layer id -> [T, n_cols] int64 row ids (the lookup plan)
    sample_rows: list[int]  # [N] indices into the S sequences that sample a token this step
    samples: list[SampleSpec]  # [N] one per sampling sequence, same order
    finished_seq_ids: list[int] = field(default_factory=list)  # sequences gone since the last step: free state
    prompt_logprobs: list[PromptLogprobsSpec] = field(default_factory=list)  # prefill chunks to score
    # [C] indices into the S sequences that start fresh at a prefix-cache hit (start_positions > 0, a block
    # boundary): the Worker rebuilds their per-sequence state from the cached blocks instead of keeping it
    cached_starts: list[int] = field(default_factory=list)
    # Models with cache groups (DeepSeek-V4, engine/cache_groups.py): group name -> [S, width] int64 page of each
    # logical block of each sequence (-1: none held); empty for the paged-KV models (``block_tables`` is theirs)
    group_tables: dict[str, torch.Tensor] = field(default_factory=dict)
    # Async scheduling: tokens the previous step sampled, not read by the engine yet (packing.py). Their rows
    # of token_ids / engram_row_ids / dead_mask hold placeholders the Worker replaces on the device.
    pending_rows: list[int] = field(default_factory=list)  # [P] packed rows whose token is still on the device
    pending_sources: list[int] = field(default_factory=list)  # [P] its index among step pending_step_id's tokens
    pending_step_id: int = -1  # the step that sampled them (the one launched just before this one)
    pending_partials: torch.Tensor | None = None  # [L, P, n_cols] int64 host half of their Engram row ids
    # Speculative decoding (engine/spec/): [N] drafts of each sampling sequence, the last ``num_drafts[i]`` of its
    # packed tokens (empty: none). Such a sequence gets logits and a SampleSpec at each of its last k + 1 rows, so
    # ``samples`` has one spec per logits row (``logits_indices``), and the Worker verifies the drafts
    num_drafts: list[int] = field(default_factory=list)
    draft: "DraftPlan | None" = None  # a draft model's passes (engine/spec/draft_plan.py); None: drafts are in the ids
    # Engram layer id -> its ids deduplicated on the host (row_dedup.DedupRows: distinct ids + inverse index); the
    # Worker's eager lookups gather the distinct rows and expand them; empty when dedup is off
    engram_dedup: dict = field(default_factory=dict)
    # Prompt rows ahead of their prefill (engine/prefetch_plan.py): ranges to stage now (PrefetchRange, FCFS order),
    # sequences whose staged ranges go (preempted), and this step's token rows read from staged ranges (StagedUse)
    prefetch: list = field(default_factory=list)
    prefetch_drop: list[int] = field(default_factory=list)
    staged_uses: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def logits_indices(self) -> list[int]:
        """[R] packed token rows that get logits: each sampling sequence's last new token, or with k drafts its last
        k + 1 (R = N + sum of ``num_drafts``; one SampleSpec each, in this order)."""
        cu = self.cu_seqlens.tolist()  # one conversion, not a tensor index per sequence
        if not self.num_drafts:
            return [cu[s + 1] - 1 for s in self.sample_rows]
        return [r for s, k in zip(self.sample_rows, self.num_drafts) for r in range(cu[s + 1] - 1 - k, cu[s + 1])]

    @property
    def draft_rows(self) -> list[int]:
        """[D] packed token rows of the drafts, sequence after sequence (empty without speculation)."""
        cu = self.cu_seqlens.tolist()
        return [r for s, k in zip(self.sample_rows, self.num_drafts) for r in range(cu[s + 1] - k, cu[s + 1])]

    @property
    def prompt_rows(self) -> list[int]:
        """[P] packed token rows scored for prompt logprobs, spec after spec, in order."""
        cu = self.cu_seqlens.tolist()
        return [cu[p.seq] + p.first_row + i for p in self.prompt_logprobs for i in range(len(p.targets))]


@dataclass
class TokenLogprobs:
    """Logprobs of one emitted token: its own and the step's top-k (vLLM/OpenAI shape)."""

    token_id: int  # the emitted token
    logprob: float  # its log-probability under the step's (unforced, unmasked-by-sampling) distribution
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), most likely first


@dataclass
class StepResult:
    """What comes back: the emitted tokens of each sampling sequence, in ``sample_rows`` order: one each, or with
    speculation ``num_emitted[i]`` (its accepted drafts, then the token sampled after them)."""

    step_id: int  # the StepDescription's id
    token_ids: list[int]  # [sum num_emitted] emitted tokens (sampled, or forced where a SampleSpec says so)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # [same] where SampleSpec.logprobs >= 0
    num_emitted: list[int] = field(default_factory=list)  # [N] tokens each sequence emitted (empty: one each)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # seq index -> its targets'
    route: str = ""  # the step runner that ran it (step_trace.py)
    gpu_s: float | None = None  # its device work (CUDA events), None on the CPU
    idle_s: float | None = None  # the device's idle time since the step before it, None on the CPU or the first
    lookup_exposed_s: float | None = None  # time the step waited for its Engram rows (lookup_timing.py); None: a replay
    gather_s: dict[str, float] = field(default_factory=dict)  # tier -> seconds its tables took to produce the rows
