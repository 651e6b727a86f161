"""Sampler (worker side): logits of the sequences that reached their last token -> one token each. Greedy rows
(temperature 0) take the argmax; others are scaled, cut to top-k/top-p and drawn by the exponential race (argmax of p /
Exp(1)). A seeded row's Exp(1) draws hash (seed, draw, token id), so its tokens depend neither on the batch, preemption
nor process. ``banned_token_ids`` are masked first; a forced token is emitted after sampling as usual. Per-row
parameters reach the device through pinned non-blocking copies: sampling never waits for the GPU."""
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
    ready: torch.cuda.Event | None = None  # set on host copies still in flight: recorded after their copy
    accepted: torch.Tensor | None = None  # [N] int64 accepted drafts of each sequence (speculative decoding only)


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._shared[device]

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec]) -> SampledTokens:
        """logits float32 [N, V], one spec per row."""
        if logits.shape[0] != len(specs):
            raise ValueError(f"sampler got {logits.shape[0]} logit rows for {len(specs)} specs")
        dev = logits.device
        if not specs:
            return SampledTokens(torch.empty(0, dtype=torch.long, device=dev), None, None, None)
        raw = logits.float()
        masked = self.ban(raw, specs)
        out = masked.argmax(dim=-1)  # [N]; greedy rows are done
        rows = [i for i, s in enumerate(specs) if not s.greedy]
        if rows:
            out = self._draw(masked, out, rows, [specs[i] for i in rows])
        if any(s.forced_token_id >= 0 for s in specs):
            forced = to_device([s.forced_token_id for s in specs], dev)  # [N], -1 = not forced
            out = torch.where(forced >= 0, forced, out)
        k = max(s.logprobs for s in specs)
        if k < 0:
            return SampledTokens(out, None, None, None)
        logp = raw.log_softmax(dim=-1)  # [N, V]
        top_v, top_i = logp.topk(k, dim=-1)  # [N, k] (k may be 0: the emitted token's logprob alone)
        return SampledTokens(out, logp.gather(1, out.unsqueeze(1)).squeeze(1), top_v, top_i)

    @staticmethod
    def ban(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
        pairs = [(i, t) for i, s in enumerate(specs) for t in s.banned_token_ids]
        if not pairs:
            return logits
        idx = to_device(pairs, logits.device)  # [P, 2] (row, token)
        return logits.index_put((idx[:, 0], idx[:, 1]), logits.new_full((), float("-inf")))  # no host scalar copy

    def _draw(self, logits: torch.Tensor, out: torch.Tensor, rows: list[int], specs: list[SampleSpec]) -> torch.Tensor:
        dev = logits.device
        idx = to_device(rows, dev)  # [R]
        temp = to_device([s.temperature for s in specs], dev, torch.float32)  # [R]
        scaled = logits.index_select(0, idx) / temp.unsqueeze(1)  # [R, V]
        probs = self.top_k_top_p(scaled, specs).softmax(dim=-1)  # [R, V]
        noise = torch.empty_like(probs)  # [R, V] Exp(1) draws
        seeded = [j for j, s in enumerate(specs) if s.seed is not None]
        shared = [j for j, s in enumerate(specs) if s.seed is None]
        if seeded:
            keys = to_device([[specs[j].seed for j in seeded], [specs[j].draw for j in seeded]], dev)  # [2, R']
            noise.index_copy_(0, to_device(seeded, dev), seeded_exponential(keys[0], keys[1], probs.shape[1]))
        if shared:
            draws = torch.empty(len(shared), probs.shape[1], device=dev)
            draws.exponential_(generator=self.shared_generator(dev))
            noise.index_copy_(0, to_device(shared, dev), draws)
        return out.index_copy(0, idx, (probs / noise).argmax(dim=-1))

    @staticmethod
    def top_k_top_p(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
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


def _i64(x: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of int64 that scatters nearby inputs over all 64 bits."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def seeded_exponential(seeds: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [R, vocab] float32, a pure function of (seed, draw, token id): splitmix64 of a key mixed from
    seed then draw, plus the token id; its top 24 bits as a uniform in (0, 1), then -log. seeds, draws: int64
    [R] on the noise's device (int64 arithmetic wraps alike on the CPU and CUDA)."""
    key = _mix(_mix(seeds * _GOLDEN) + draws * _GOLDEN).unsqueeze(1)  # [R, 1]
    tokens = torch.arange(vocab, dtype=torch.int64, device=seeds.device).unsqueeze(0)  # [1, V]
    x = _mix(key + tokens * _GOLDEN)  # [R, V]
    u = (_shr(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1): never 0, never 1
    return -torch.log(u)
