"""Sampler: logits of the sequences that reached their last token -> one new token each.

Greedy rows (temperature 0) take the argmax. Other rows are scaled by temperature, cut to top-k and top-p,
and drawn with the exponential race (argmax of p / Exp(1)), which equals sampling from p. A row with a
``seed`` draws from its own generator, so its tokens do not depend on the rest of the batch; the others
share the engine's generator. Before ``min_tokens``, EOS and ``stop_token_ids`` are masked out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engram.engine.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    params: SamplingParams  # the sequence's sampling parameters
    num_output_tokens: int  # tokens generated so far (for min_tokens)
    generator: torch.Generator | None  # the sequence's own stream (seeded requests), else None


class Sampler:
    def __init__(self, eos_token_id: int | None, seed: int = 0):
        self.eos_token_id = eos_token_id
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._shared[device]

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        """logits float32 [N, V], one request per row -> token ids int64 [N]."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"sampler got {logits.shape[0]} logit rows for {len(requests)} requests")
        if not requests:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        logits = self._mask_min_tokens(logits.float(), requests)
        out = logits.argmax(dim=-1)  # [N]; greedy rows are done
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not rows:
            return out
        idx = torch.tensor(rows, device=logits.device)
        params = [requests[i].params for i in rows]
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
        scaled = logits.index_select(0, idx) / temp.unsqueeze(1)  # [R, V]
        probs = self._top_k_top_p(scaled, params).softmax(dim=-1)  # [R, V]
        noise = torch.empty_like(probs)  # [R, V] Exp(1) draws, per row from the row's generator
        shared_rows = []
        for j, i in enumerate(rows):
            gen = requests[i].generator
            if gen is None:
                shared_rows.append(j)
            else:
                noise[j].exponential_(generator=gen)
        if shared_rows:
            sel = torch.tensor(shared_rows, device=logits.device)
            draws = torch.empty(len(shared_rows), probs.shape[1], device=logits.device)
            draws.exponential_(generator=self.shared_generator(logits.device))
            noise.index_copy_(0, sel, draws)
        out[idx] = (probs / noise).argmax(dim=-1)
        return out

    def _mask_min_tokens(self, logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        masked = None
        for i, r in enumerate(requests):
            if r.num_output_tokens >= r.params.min_tokens:
                continue
            banned = list(r.params.stop_token_ids)
            if self.eos_token_id is not None and not r.params.ignore_eos:
                banned.append(self.eos_token_id)
            if banned:
                masked = logits.clone() if masked is None else masked
                masked[i, banned] = float("-inf")
        return logits if masked is None else masked

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Set logits outside each row's top-k / top-p set to -inf: [R, V] -> [R, V]."""
        vocab = logits.shape[1]
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        ps = [p.top_p for p in params]
        if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        rank = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
        k = torch.tensor(ks, device=logits.device).unsqueeze(1)  # [R, 1]
        drop = rank >= k
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
        p = torch.tensor(ps, dtype=probs.dtype, device=logits.device).unsqueeze(1)
        drop = drop | (before >= p)  # keeps the top token always (before = 0 < p)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
