"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, min_tokens; SamplingParams validation."""
from __future__ import annotations

import math

import pytest
import torch

from engram.engine.sampler import SampleRequest, Sampler
from engram.engine.sampling_params import SamplingParams


def req(n_out=0, gen=None, **kw) -> SampleRequest:
    return SampleRequest(SamplingParams(**kw), n_out, gen)


def test_greedy_is_argmax_per_row():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler(eos_token_id=None)(logits, [req(temperature=0.0) for _ in range(7)])
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy_at_any_temperature():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    s = Sampler(None, seed=3)
    out = s(logits, [req(temperature=5.0, top_k=1)] * 3 + [req(temperature=5.0, top_p=1e-6)] * 3)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_samples_follow_softmax_of_scaled_logits():
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n, temp = 20000, 0.7
    out = Sampler(None, seed=0)(base.repeat(n, 1), [req(temperature=temp)] * n)
    freq = torch.bincount(out, minlength=4).double() / n
    p = torch.softmax(base.double() / temp, -1)
    # 5 standard errors per class: fails for a wrong temperature or a biased draw, not by chance
    assert torch.all((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n)), (freq, p)


def test_top_k_and_top_p_cut_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    s = Sampler(None, seed=1)
    k2 = s(logits, [req(top_k=2)] * 4000)
    assert set(k2.tolist()) == {0, 1}
    p7 = s(logits, [req(top_p=0.7)] * 4000)  # 0.5 < 0.7 keeps token 1; 0.8 >= 0.7 drops token 2
    assert set(p7.tolist()) == {0, 1}
    both = s(logits, [req(top_k=3, top_p=0.99)] * 4000)
    assert set(both.tolist()) == {0, 1, 2}
    # the kept mass is renormalised: token 0 has 0.5 / 0.8 of it
    assert abs((p7 == 0).double().mean().item() - 0.625) < 5 * math.sqrt(0.625 * 0.375 / 4000)


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 300
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(vocab, generator=g) for _ in range(8)]

    def run(batch_rows: list[int], seeds: dict[int, int]) -> dict[int, list[int]]:
        gens = {i: torch.Generator().manual_seed(seeds[i]) for i in seeds}
        s = Sampler(None, seed=123)
        out = {i: [] for i in seeds}
        for _ in range(5):
            logits = torch.stack([rows[i] for i in batch_rows])
            toks = s(logits, [req(temperature=1.0, gen=gens.get(i)) for i in batch_rows])
            for i, t in zip(batch_rows, toks.tolist()):
                if i in seeds:
                    out[i].append(t)
        return out

    alone = run([3], {3: 42})
    mixed = run([0, 3, 5, 1], {3: 42, 5: 7})
    assert alone[3] == mixed[3]
    assert len(set(mixed[3])) > 1  # really sampling
    assert run([3], {3: 43})[3] != alone[3]


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(2, 10)
    logits[:, 9] = 100.0  # EOS would win
    logits[:, 4] = 50.0
    s = Sampler(eos_token_id=9)
    early = s(logits, [req(n_out=0, temperature=0.0, min_tokens=2), req(n_out=2, temperature=0.0, min_tokens=2)])
    assert early.tolist() == [4, 9]
    logits[:, 4] = 200.0
    stopped = s(logits, [req(n_out=1, temperature=0.0, min_tokens=3, stop_token_ids=[4])] * 2)
    assert 4 not in stopped.tolist() and 9 not in stopped.tolist()


@pytest.mark.parametrize("kw,field", [({"n": 2}, "n"), ({"temperature": -0.1}, "temperature"),
                                      ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                      ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
                                      ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                                      ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")])
def test_sampling_params_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**kw)


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams(stop="###", top_k=-1)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.ignore_eos) == (1, 1.0, 1.0, 0, 16, False)
    assert p.stop_list == ["###"] and p.stop_token_ids == [] and not p.greedy
