"""Verification of drafts (worker side): the logits of each speculating sequence's last k + 1 rows (its last token,
then k drafts) -> how many drafts it accepts and the token after them, for every sequence of a step at once, on the
device, with no host synchronisation.

Row j of a sequence (j = 0 .. k) scores output token ``draw + j``; draft j + 1 sits at row j + 1 and is what row j
predicts. With the target distribution p_j of row j (temperature, top-k / top-p and bans applied, as the plain
sampler) and the proposal q_j of the draft:

* temperature 0: draft j accepted iff it is row j's argmax; the emitted token after the accepted ones is the argmax of
  the first rejecting row (or of row k: the bonus token). The greedy outputs are those without speculation.
* forced rows (``forced_token_id``): a draft is accepted iff it is the forced token; the emitted token is the forced one.
* temperature > 0: rejection sampling. Draft d accepted with probability min(1, p_j(d) / q_j(d)); at the first
  rejection the token is drawn from max(0, p_j - q_j) normalised; after k acceptances the bonus from p_k. The emitted
  tokens are distributed exactly as p's (Leviathan et al.; Chen et al. 2023). Both proposers here propose
  deterministically (q one-hot), so a draft is accepted with probability p_j(d) and the residual is p_j without d.

A seeded row draws its uniform from (seed ^ ACCEPT_SALT, draw) and its Exp(1) race noise from (seed, draw) —
``sampler.seeded_exponential`` — so a seeded request's tokens depend neither on the batch nor on which other
sequences speculate, but differ from its tokens without speculation (the acceptance test consumes randomness of
its own)."""
from __future__ import annotations

import torch

from engram.engine.sampler import Sampler, SampledTokens, seeded_exponential
from engram.engine.step import SampleSpec
from engram.transfer import to_device

ACCEPT_SALT = 0x5DEECE66D  # keys a seeded row's acceptance uniform apart from its race noise


class Verifier:
    """Verifies a step's drafts with the Worker's sampler (its bans, top-k / top-p and shared generator)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec], num_drafts: list[int], drafts: torch.Tensor,
                 draft_probs: torch.Tensor | None = None) -> SampledTokens:
        """logits float32 [R, V] (R = N + sum(num_drafts), one spec a row), num_drafts [N], drafts [D] int64 on the
        logits' device (sequence after sequence), ``draft_probs`` [D, V] the proposal of each draft (None: one-hot).
        -> ``token_ids`` [R]: the token emitted at each row (-1 past a sequence's first rejection), ``accepted`` [N],
        logprobs per row as the sampler's."""
        rows, vocab = logits.shape
        if rows != len(specs) or rows != len(num_drafts) + sum(num_drafts):
            raise ValueError(f"verify got {rows} logit rows for {len(specs)} specs and drafts {num_drafts}")
        dev = logits.device
        if drafts.numel() != sum(num_drafts) or not drafts.numel():
            raise ValueError(f"verify got {drafts.numel()} drafts for num_drafts {num_drafts}")
        group, offset, has_draft = _layout(num_drafts)
        group_d, offset_d, has_draft_d = to_device([group, offset, has_draft], dev)  # [R] each
        # row j of a sequence is asked about its draft j + 1 (packed at row j + 1): drafts[first + j]
        draft_index = torch.cumsum(has_draft_d, 0) - 1  # [R]
        next_draft = torch.where(has_draft_d.bool(), drafts.index_select(0, draft_index.clamp(min=0)), -1)  # [R]
        raw = logits.float()
        masked = self.sampler.ban(raw, specs)
        target = masked.argmax(dim=-1)  # [R]: greedy rows' token
        accept = next_draft == target  # [R] greedy rule (forced rows replace target below)
        residual_pick = target
        random = [i for i, s in enumerate(specs) if not s.greedy and s.forced_token_id < 0]
        if random:
            idx = to_device(random, dev)  # [Rr]
            sub = [specs[i] for i in random]
            temp = to_device([s.temperature for s in sub], dev, torch.float32)
            p = self.sampler.top_k_top_p(masked.index_select(0, idx) / temp.unsqueeze(1), sub).softmax(-1)  # [Rr, V]
            noise, uniform = self._noise(sub, vocab, dev)
            target = target.index_copy(0, idx, (p / noise).argmax(dim=-1))  # the row's own draw from p
            d = next_draft.index_select(0, idx)  # [Rr], -1 on a sequence's last row
            q = (torch.nn.functional.one_hot(d.clamp(min=0), vocab).to(p.dtype) if draft_probs is None
                 else draft_probs.index_select(0, draft_index.index_select(0, idx).clamp(min=0)).to(p.dtype))
            p_d = p.gather(1, d.clamp(min=0).unsqueeze(1)).squeeze(1)
            q_d = q.gather(1, d.clamp(min=0).unsqueeze(1)).squeeze(1)
            ok = uniform * q_d < p_d  # u < p(d) / q(d), without dividing by a zero q(d)
            accept = accept.index_copy(0, idx, ok & (d >= 0))
            residual = (p - q).clamp(min=0)  # [Rr, V]; all zero only if p == q, when nothing is rejected
            residual_pick = residual_pick.index_copy(0, idx, torch.where(d >= 0, (residual / noise).argmax(-1),
                                                                         target.index_select(0, idx)))
        forced = [s.forced_token_id for s in specs]
        if any(f >= 0 for f in forced):
            f = to_device(forced, dev)  # [R]
            target = torch.where(f >= 0, f, target)
            accept = torch.where(f >= 0, next_draft == f, accept)
            residual_pick = torch.where(f >= 0, f, residual_pick)
        accept = accept & has_draft_d.bool()
        # a sequence accepts drafts up to its first row that stops (a rejection, or its last row)
        big = rows + 1
        stop_at = torch.where(accept, big, offset_d)  # [R]
        accepted = torch.full((len(num_drafts),), big, dtype=torch.long, device=dev).scatter_reduce(
            0, group_d, stop_at, reduce="amin")  # [N]
        a = accepted.index_select(0, group_d)  # [R]
        last = torch.where(has_draft_d.bool(), residual_pick, target)  # a rejecting row's residual, or the bonus
        emitted = torch.where(offset_d < a, next_draft, torch.where(offset_d == a, last, torch.full_like(target, -1)))
        out = self._logprobs(raw, emitted, specs)
        return SampledTokens(emitted, *out, accepted=accepted)

    def _noise(self, specs: list[SampleSpec], vocab: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Exp(1) race noise [Rr, V] and acceptance uniforms [Rr]: keyed by (seed, draw) on seeded rows, from the
        shared generator on the others."""
        noise = torch.empty(len(specs), vocab, device=dev)
        uniform = torch.empty(len(specs), device=dev)
        seeded = [j for j, s in enumerate(specs) if s.seed is not None]
        shared = [j for j, s in enumerate(specs) if s.seed is None]
        if seeded:
            keys = to_device([[specs[j].seed for j in seeded], [specs[j].draw for j in seeded]], dev)  # [2, R']
            at = to_device(seeded, dev)
            noise.index_copy_(0, at, seeded_exponential(keys[0], keys[1], vocab))
            uniform.index_copy_(0, at, torch.exp(-seeded_exponential(keys[0] ^ ACCEPT_SALT, keys[1], 1)[:, 0]))
        if shared:
            gen = self.sampler.shared_generator(dev)
            at = to_device(shared, dev)
            noise.index_copy_(0, at, torch.empty(len(shared), vocab, device=dev).exponential_(generator=gen))
            uniform.index_copy_(0, at, torch.rand(len(shared), device=dev, generator=gen))
        return noise, uniform

    @staticmethod
    def _logprobs(raw: torch.Tensor, emitted: torch.Tensor, specs: list[SampleSpec]):
        """(logprob [R], top values [R, k], top ids [R, k]) of each row's emitted token, or Nones when none asked."""
        k = max(s.logprobs for s in specs)
        if k < 0:
            return None, None, None
        logp = raw.log_softmax(dim=-1)  # [R, V]
        top_v, top_i = logp.topk(k, dim=-1)
        return logp.gather(1, emitted.clamp(min=0).unsqueeze(1)).squeeze(1), top_v, top_i


def _layout(num_drafts: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Per logits row: its sequence, its offset j in the sequence's rows, and whether a draft follows it."""
    group, offset, has_draft = [], [], []
    for i, k in enumerate(num_drafts):
        group += [i] * (k + 1)
        offset += list(range(k + 1))
        has_draft += [1] * k + [0]
    return group, offset, has_draft


def flatten(accepted: list[int], num_drafts: list[int], per_row: list) -> tuple[list, list[int]]:
    """Host side: the per-row values of the emitted tokens (rows 0 .. accepted of each sequence), flat in order, and
    how many each sequence emitted."""
    out, counts, at = [], [], 0
    for a, k in zip(accepted, num_drafts):
        out.extend(per_row[at:at + a + 1])
        counts.append(a + 1)
        at += k + 1
    return out, counts


def rejected_per_sequence(step, accepted: torch.Tensor) -> torch.Tensor:
    """[S] int64 on the device: each of the step's sequences' rejected drafts (0 without drafts), from the
    verifier's ``accepted`` [N]."""
    dev = accepted.device
    spec = [i for i, k in enumerate(step.num_drafts) if k]
    seqs, at, k = to_device([[step.sample_rows[i] for i in spec], spec, [step.num_drafts[i] for i in spec]], dev)
    dropped = torch.zeros(step.num_seqs, dtype=torch.long, device=dev)
    return dropped.index_copy(0, seqs, k - accepted.index_select(0, at))
