"""The draft model on the Worker (``Drafter``): runs a step's ``DraftPlan`` (engine/spec/draft_plan.py) with an eager
runner over the draft model, its own KV cache (the target's block ids and slots: same ``block_size``, a block more
for padding) and its own tables, and hands the target the drafts as a ``PendingPatch`` — raw ids and Engram row ids
hashed on the device (``NgramHasher.hash_step_reference``) from each sequence's lookback and the drafts before —
so the verify step's rows are planned for all K + 1 positions and gathered like any patched token's (host-read tables
get the ids copied to the host). Drafts are the draft model's argmax (a one-hot proposal for the verifier)."""
from __future__ import annotations

import torch

from engram.engine.lookup import LookupExecutor
from engram.engine.pending import PendingPatch, PendingTokens
from engram.engine.runners.eager import EagerRunner
from engram.engine.step import StepDescription
from engram.hashing import DEAD, NgramHasher
from engram.model.deepseek_v4.config import ARCHITECTURES as SEQUENCE_CACHE_ARCHITECTURES
from engram.model.kv_cache import KVCache
from engram.model.loader import load_model
from engram.transfer import to_device


def load_draft(spec, dtype: torch.dtype, device: torch.device):
    """The draft model of ``spec`` (a SpeculativeConfig with method "draft_model"): a preset or checkpoint, in the
    target's dtype on its device, its tables in memory there (tier gpu: a draft's tables are small)."""
    return load_model(spec.model, tier="gpu", dtype=dtype, device=device, progress=False)


def check_draft(target, draft) -> None:
    """ValueError unless ``draft`` (a LoadedModel) can propose for ``target``: the same tokenizer, a paged-KV
    architecture, Engram v41 (or none) over the same compressed ids and DEAD tokens."""
    name = draft.name
    if draft.model_config.architecture in SEQUENCE_CACHE_ARCHITECTURES:
        raise ValueError(f"speculative_config.model={name!r}: a {draft.model_config.architecture} draft keeps "
                         "compressor state that cannot be rewound; use a paged-KV model")
    if draft.tokenizer.to_str() != target.tokenizer.to_str():
        raise ValueError(f"speculative_config.model={name!r}: its tokenizer is not the target's {target.name!r} "
                         "(a draft must share the tokenizer)")
    d, t = draft.engram_config, target.engram_config
    if d is None:
        return
    if d.variant != "v41":
        raise ValueError(f"speculative_config.model={name!r}: a {d.variant}-variant draft keeps a conv state per "
                         "sequence, which the draft passes do not rewind; use a v41 or plain draft")
    if t is None:
        raise ValueError(f"speculative_config.model={name!r} has Engram layers but the target {target.name!r} has "
                         "none (the drafts' rows are hashed with the target's compressed ids)")
    dead = tuple(t.dead_token_ids)
    if tuple(d.dead_token_ids) != dead:
        raise ValueError(f"speculative_config.model={name!r}: its Engram DEAD ids {list(d.dead_token_ids)} differ "
                         f"from the target's {list(dead)} (the sequences' compressed ids are shared)")


class Drafter:
    """``pending``: the Worker's tokens-in-flight helper, whose target hasher and raw -> compressed map (DEAD = -1)
    the drafts are hashed with."""

    def __init__(self, draft, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 pending: PendingTokens):
        self.device = torch.device(device)
        self.ecfg = draft.engram_config
        kv = KVCache.for_model(draft.model_config, num_blocks, block_size, dtype, self.device)
        lookup = LookupExecutor(draft.open_tables(), self.ecfg, dtype, self.device)
        self.runner = EagerRunner(draft.model, kv, lookup, self.device, dtype, self.ecfg)
        self.hasher = NgramHasher.from_tokenizer(self.ecfg, draft.compressed_tokenizer) if self.ecfg else None
        self.target_hasher, self.map, self.has_dead = pending.hasher, pending.device_map, pending.has_dead

    def propose(self, step: StepDescription) -> tuple[torch.Tensor | None, PendingPatch | None]:
        """Run the step's draft passes -> (drafts [D] int64, the target's patch of its draft rows); (None, None) when
        no sequence speculates (pass 1 still runs: the draft's KV follows every computed token)."""
        plan = step.draft
        first = self.runner.launch(plan.passes[0], None).logits  # [Q, V]
        if not plan.num_drafts:
            return None, None
        q, k_max = len(plan.num_drafts), max(plan.num_drafts)
        drafts = torch.zeros(q, k_max, dtype=torch.long, device=self.device)  # [Q, K] d_1 .. d_k of each
        drafts[:, 0] = first.argmax(dim=-1)
        w = self.hasher.window if self.hasher else 0
        history = None  # [Q, W + K] draft-compressed ids: the lookback, then the drafts
        if self.hasher is not None:
            history = torch.cat([to_device(plan.draft_lookback, self.device),
                                 torch.zeros(q, k_max, dtype=torch.long, device=self.device)], dim=1)
            history[:, w] = self.map[drafts[:, 0]]
        for j, (one, act) in enumerate(zip(plan.passes[1:], plan.active), start=2):
            rows = to_device(act, self.device)  # [P] of the Q
            fed = drafts[rows, j - 2]  # draft j - 1, fed at its position
            patch = PendingPatch(torch.arange(len(act), device=self.device), fed, {}, None)
            if self.hasher is not None:
                compressed = history[rows, w + j - 2]  # [P]
                lookback = history[rows, j - 2:j - 2 + w]  # [P, W] the ids before it
                cu = torch.arange(len(act) + 1, device=self.device)
                patch.row_ids = self.hasher.hash_step_reference(compressed, cu, lookback)[0]
                patch.dead = compressed == DEAD if one.dead_mask is not None else None
            drafts[rows, j - 1] = self.runner.launch(one, patch).logits.argmax(dim=-1)
            if history is not None:
                history[rows, w + j - 1] = self.map[drafts[rows, j - 1]]
        keep = [qi * k_max + j for qi, k in enumerate(plan.num_drafts) for j in range(k)]
        flat = drafts.reshape(-1).index_select(0, to_device(keep, self.device))  # [D] sequence after sequence
        return flat, self._target_patch(step, plan, flat)

    def _target_patch(self, step: StepDescription, plan, flat: torch.Tensor) -> PendingPatch:
        """The target step's draft rows: raw ids, row ids from each sequence's lookback and its drafts before."""
        rows = to_device(step.draft_rows, self.device)
        if self.target_hasher is None:
            return PendingPatch(rows, flat, {}, None)
        compressed = self.map[flat]  # [D], DEAD = -1
        counts = torch.tensor([0] + plan.num_drafts, dtype=torch.long)
        cu = to_device(torch.cumsum(counts, 0), self.device)  # [Q + 1]
        hashed = self.target_hasher.hash_step_reference(compressed, cu, to_device(plan.target_lookback,
                                                                                   self.device))[0]
        return PendingPatch(rows, flat, hashed, compressed == DEAD if self.has_dead else None)
