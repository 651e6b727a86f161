"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, min_tokens, forced tokens, logprobs;
SamplingParams validation."""
from __future__ import annotations

import math

import pytest
import torch

from engram.engine.sampler import Sampler
from engram.engine.sampling_params import SamplingParams
from engram.engine.step import SampleSpec


def req(n_out=0, eos=None, **kw) -> SampleSpec:
    """The spec of a sequence with ``n_out`` tokens generated so far."""
    return SampleSpec.from_params(SamplingParams(**kw), n_out, eos)


def sample(sampler: Sampler, logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    return sampler(logits, specs).token_ids


def test_greedy_is_argmax_per_row():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    out = sample(Sampler(), logits, [req(temperature=0.0) for _ in range(7)])
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy_at_any_temperature():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    s = Sampler(seed=3)
    out = sample(s, logits, [req(temperature=5.0, top_k=1)] * 3 + [req(temperature=5.0, top_p=1e-6)] * 3)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_samples_follow_softmax_of_scaled_logits():
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n, temp = 20000, 0.7
    out = sample(Sampler(seed=0), base.repeat(n, 1), [req(temperature=temp)] * n)
    freq = torch.bincount(out, minlength=4).double() / n
    p = torch.softmax(base.double() / temp, -1)
    # 5 standard errors per class: fails for a wrong temperature or a biased draw, not by chance
    assert torch.all((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n)), (freq, p)


def test_top_k_and_top_p_cut_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    s = Sampler(seed=1)
    k2 = sample(s, logits, [req(top_k=2)] * 4000)
    assert set(k2.tolist()) == {0, 1}
    p7 = sample(s, logits, [req(top_p=0.7)] * 4000)  # 0.5 < 0.7 keeps token 1; 0.8 >= 0.7 drops token 2
    assert set(p7.tolist()) == {0, 1}
    both = sample(s, logits, [req(top_k=3, top_p=0.99)] * 4000)
    assert set(both.tolist()) == {0, 1, 2}
    # the kept mass is renormalised: token 0 has 0.5 / 0.8 of it
    assert abs((p7 == 0).double().mean().item() - 0.625) < 5 * math.sqrt(0.625 * 0.375 / 4000)


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 300
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(vocab, generator=g) for _ in range(8)]

    def run(batch_rows: list[int], seeds: dict[int, int], sampler_seed: int = 123) -> dict[int, list[int]]:
        s = Sampler(seed=sampler_seed)
        out = {i: [] for i in seeds}
        for step in range(5):
            logits = torch.stack([rows[i] for i in batch_rows])
            toks = sample(s, logits, [req(n_out=step, temperature=1.0, seed=seeds.get(i)) for i in batch_rows])
            for i, t in zip(batch_rows, toks.tolist()):
                if i in seeds:
                    out[i].append(t)
        return out

    alone = run([3], {3: 42})
    mixed = run([0, 3, 5, 1], {3: 42, 5: 7}, sampler_seed=9)
    assert alone[3] == mixed[3]
    assert len(set(mixed[3])) > 1  # really sampling
    assert run([3], {3: 43})[3] != alone[3]


def test_seeded_draws_follow_softmax_and_are_exponential():
    from engram.engine.sampler import seeded_exponential

    e = seeded_exponential(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)  # [64, 4096]
    assert e.min() > 0 and abs(e.mean().item() - 1.0) < 0.01 and abs(e.var().item() - 1.0) < 0.03
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n, temp = 20000, 0.7
    out = sample(Sampler(), base.repeat(n, 1), [req(n_out=i % 100, temperature=temp, seed=i // 100) for i in range(n)])
    freq = torch.bincount(out, minlength=4).double() / n
    p = torch.softmax(base.double() / temp, -1)
    assert torch.all((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n)), (freq, p)


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(2, 10)
    logits[:, 9] = 100.0  # EOS would win
    logits[:, 4] = 50.0
    s = Sampler()
    early = sample(s, logits, [req(n_out=0, eos=9, temperature=0.0, min_tokens=2),
                               req(n_out=2, eos=9, temperature=0.0, min_tokens=2)])
    assert early.tolist() == [4, 9]
    logits[:, 4] = 200.0
    stopped = sample(s, logits, [req(n_out=1, eos=9, temperature=0.0, min_tokens=3, stop_token_ids=[4])] * 2)
    assert 4 not in stopped.tolist() and 9 not in stopped.tolist()


def test_forced_tokens_replace_the_sampled_ones_after_sampling_as_usual():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    forced = [7, 11]
    reqs = [req(n_out=0, temperature=0.0, forced_token_ids=forced),
            req(n_out=1, temperature=0.0, forced_token_ids=forced),
            req(n_out=2, temperature=0.0, forced_token_ids=forced)]  # the third is past the continuation
    assert sample(Sampler(), logits, reqs).tolist() == [7, 11, int(logits[2].argmax())]
    # a sampled row draws even when forced: the shared stream advances as in real decode
    a, b = Sampler(seed=5), Sampler(seed=5)
    sample(a, logits[:1], [req(temperature=1.0, forced_token_ids=[3])])
    sample(b, logits[:1], [req(temperature=1.0)])
    assert torch.equal(a.shared_generator(logits.device).get_state(), b.shared_generator(logits.device).get_state())


def test_logprobs_are_the_raw_log_softmax_of_the_emitted_token_and_the_top_k():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(3))
    out = Sampler()(logits, [req(temperature=0.0, logprobs=3), req(temperature=0.0, forced_token_ids=[5], logprobs=2)])
    zero = Sampler()(logits, [req(temperature=0.0, logprobs=0), req(temperature=0.0)])  # 0: own logprob, no top
    assert zero.top_logprobs.shape == (2, 0) and torch.equal(zero.logprobs[0], logits.log_softmax(-1)[0].max())
    assert Sampler()(logits, [req(temperature=0.0)] * 2).logprobs is None
    logp = logits.log_softmax(-1)
    assert out.token_ids.tolist() == [int(logits[0].argmax()), 5]
    assert torch.equal(out.logprobs, torch.stack([logp[0].max(), logp[1, 5]]))
    assert out.top_token_ids[0].tolist() == logp[0].topk(3).indices.tolist()
    assert torch.equal(out.top_logprobs[1, :2], logp[1].topk(2).values)


@pytest.mark.parametrize("kw,field", [({"n": 0}, "n"), ({"temperature": -0.1}, "temperature"),
                                      ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                      ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
                                      ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                                      ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
                                      ({"logprobs": 21}, "logprobs"), ({"seed": 2**70}, "seed"),
                                      ({"forced_token_ids": [-3]}, "forced_token_ids")])
def test_sampling_params_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**kw)


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams(stop="###", top_k=-1)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.ignore_eos) == (1, 1.0, 1.0, 0, 16, False)
    assert p.stop_list == ["###"] and p.stop_token_ids == [] and not p.greedy
