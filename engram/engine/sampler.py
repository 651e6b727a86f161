"""Sampler (worker side): logits of the sequences that reached their last token -> one token each.

Greedy rows (temperature 0) take the argmax. Other rows are scaled by temperature, cut to top-k and top-p,
and drawn with the exponential race (argmax of p / Exp(1)), which equals sampling from p. A row with a
``seed`` draws from its own generator (the Worker keeps one per sequence), so its tokens do not depend on
the rest of the batch; the others share the sampler's generator. ``banned_token_ids`` (EOS / stop ids
before min_tokens) are masked first; a row with a forced token emits it after sampling as usual, so a
forced step costs what a real one does. Every per-row parameter reaches the device through pinned,
non-blocking copies: sampling never waits for the GPU; the caller's one read of the tokens does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.engine.step import SampleSpec
from engram.transfer import to_device


@dataclass
class SampledTokens:
    token_ids: torch.Tensor  # [N] int64 on the logits' device: emitted tokens
    logprobs: torch.Tensor | None  # [N] float32 logprob of each emitted token (raw distribution), if asked
    top_logprobs: torch.Tensor | None  # [N, k] float32 top-k logprobs, most likely first, if asked
    top_token_ids: torch.Tensor | None  # [N, k] int64 their token ids


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._shared[device]

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec],
                 generators: list[torch.Generator | None]) -> SampledTokens:
        """logits float32 [N, V], one spec and one generator (None: shared stream) per row."""
        if not logits.shape[0] == len(specs) == len(generators):
            raise ValueError(f"sampler got {logits.shape[0]} logit rows for {len(specs)} specs and "
                             f"{len(generators)} generators")
        dev = logits.device
        if not specs:
            return SampledTokens(torch.empty(0, dtype=torch.long, device=dev), None, None, None)
        raw = logits.float()
        masked = self._ban(raw, specs)
        out = masked.argmax(dim=-1)  # [N]; greedy rows are done
        rows = [i for i, s in enumerate(specs) if not s.greedy]
        if rows:
            out = self._draw(masked, out, rows, [specs[i] for i in rows], [generators[i] for i in rows])
        if any(s.forced_token_id >= 0 for s in specs):
            forced = to_device([s.forced_token_id for s in specs], dev)  # [N], -1 = not forced
            out = torch.where(forced >= 0, forced, out)
        k = max(s.logprobs for s in specs)
        if k == 0:
            return SampledTokens(out, None, None, None)
        logp = raw.log_softmax(dim=-1)  # [N, V]
        top_v, top_i = logp.topk(k, dim=-1)  # [N, k]
        return SampledTokens(out, logp.gather(1, out.unsqueeze(1)).squeeze(1), top_v, top_i)

    @staticmethod
    def _ban(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
        pairs = [(i, t) for i, s in enumerate(specs) for t in s.banned_token_ids]
        if not pairs:
            return logits
        idx = to_device(pairs, logits.device)  # [P, 2] (row, token)
        return logits.index_put((idx[:, 0], idx[:, 1]), logits.new_full((), float("-inf")))  # no host scalar copy

    def _draw(self, logits: torch.Tensor, out: torch.Tensor, rows: list[int], specs: list[SampleSpec],
              generators: list[torch.Generator | None]) -> torch.Tensor:
        dev = logits.device
        idx = to_device(rows, dev)  # [R]
        temp = to_device([s.temperature for s in specs], dev, torch.float32)  # [R]
        scaled = logits.index_select(0, idx) / temp.unsqueeze(1)  # [R, V]
        probs = self._top_k_top_p(scaled, specs).softmax(dim=-1)  # [R, V]
        noise = torch.empty_like(probs)  # [R, V] Exp(1) draws, per row from the row's generator
        shared_rows = []
        for j, gen in enumerate(generators):
            if gen is None:
                shared_rows.append(j)
            else:
                noise[j].exponential_(generator=gen)
        if shared_rows:
            draws = torch.empty(len(shared_rows), probs.shape[1], device=dev)
            draws.exponential_(generator=self.shared_generator(dev))
            noise.index_copy_(0, to_device(shared_rows, dev), draws)
        return out.index_copy(0, idx, (probs / noise).argmax(dim=-1))

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
        """Set logits outside each row's top-k / top-p set to -inf: [R, V] -> [R, V]."""
        vocab = logits.shape[1]
        ks = [s.top_k if 0 < s.top_k < vocab else vocab for s in specs]
        ps = [s.top_p for s in specs]
        if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
            return logits
        dev = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        rank = torch.arange(vocab, device=dev).unsqueeze(0)  # [1, V]
        drop = rank >= to_device(ks, dev).unsqueeze(1)  # [R, V]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
        p = to_device(ps, dev, torch.float32).to(probs.dtype).unsqueeze(1)
        drop = drop | (before >= p)  # keeps the top token always (before = 0 < p)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
