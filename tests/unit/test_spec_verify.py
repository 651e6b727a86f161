"""Verification of drafts (engine/spec/verify.py) on a tiny vocabulary: rejection sampling emits tokens distributed
as the target's p (chi-square, with a sampled proposal q and with the one-hot proposals of this engine's proposers,
seeded and unseeded), greedy and forced rows accept a draft iff it is the argmax / the forced token, and seeded rows
give the same tokens whatever else is in the step."""
from __future__ import annotations

import torch

from engram.engine.sampler import Sampler
from engram.engine.spec.verify import Verifier, flatten
from engram.engine.step import SampleSpec

V = 6
CHI2_DF5_P001 = 20.515  # the 0.999 quantile of chi-square with 5 degrees of freedom


def spec(temperature=1.0, seed=None, draw=0, forced=-1, top_k=0):
    return SampleSpec(temperature, 1.0, top_k, seed, draw, (), forced, -1)


def chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    want = p.double() * tokens.numel()
    return float(((counts - want) ** 2 / want).sum())


def _trials(n: int, k: int, proposal: str, seeded: bool):
    """n sequences with the same logits rows (one per offset) and k drafts each -> (p rows [k+1, V], emitted per row
    [n, k+1], accepted [n])."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(k + 1, V, generator=g, dtype=torch.float64).float() * 1.5  # [k+1, V]
    p = logits.softmax(-1)
    q = torch.randn(k, V, generator=g).softmax(-1)  # [k, V] a draft distribution unlike p
    if proposal == "sampled":
        drafts = torch.multinomial(q, n, replacement=True, generator=g).T.reshape(-1)  # [n*k] draft j ~ q_j
        probs = q.repeat(n, 1)  # [n*k, V]
    else:  # one-hot: a fixed draft per offset (what the n-gram and draft-model proposers do)
        drafts, probs = torch.tensor([1, 4, 2][:k]).repeat(n), None
    specs = [spec(seed=i if seeded else None, draw=j) for i in range(n) for j in range(k + 1)]
    out = Verifier(Sampler(seed=11))(logits.repeat(n, 1), specs, [k] * n, drafts, probs)
    return p, out.token_ids.reshape(n, k + 1), out.accepted


def test_rejection_sampling_reproduces_the_target_distribution():
    n, k = 12000, 2
    for proposal in ("sampled", "one-hot"):
        for seeded in (False, True):
            p, rows, accepted = _trials(n, k, proposal, seeded)
            assert chi2(rows[:, 0], p[0]) < CHI2_DF5_P001, (proposal, seeded)  # first token ~ p_0
            second = rows[accepted >= 1, 1]  # emitted after an accepted first draft: ~ p_1
            assert second.numel() > 1000 and chi2(second, p[1]) < CHI2_DF5_P001, (proposal, seeded)
            assert bool(((rows >= 0).sum(1) == accepted + 1).all())  # rows up to the first rejection


def test_the_test_can_fail():
    # emitting the drafts unverified (always accepting) gives the proposal's distribution, not p's
    n, k = 12000, 2
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(k + 1, V, generator=g, dtype=torch.float64).float() * 1.5
    q = torch.randn(k, V, generator=g).softmax(-1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T
    assert chi2(drafts[:, 0], logits.softmax(-1)[0]) > CHI2_DF5_P001


def test_greedy_and_forced_rows_accept_a_draft_iff_it_is_the_target():
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0],  # argmaxes 1, 2, 3
                           [5, 0, 0, 0, 0, 0], [0, 0, 0, 0, 5, 0]], dtype=torch.float32)  # 0, 4
    # sequence 0 (rows 0-2): drafts [1, 5] -> 1 is row 0's argmax (accepted), 5 is not row 1's (rejected): emits 1, 2
    # sequence 1 (rows 3-4): draft 2 at a row forced to 2 -> accepted, then row 4's argmax: emits 2, 4
    specs = [spec(0.0), spec(0.0), spec(0.0), spec(1.0, seed=1, forced=2), spec(0.0)]
    out = Verifier(Sampler())(logits, specs, [2, 1], torch.tensor([1, 5, 2]))
    assert out.accepted.tolist() == [1, 1]
    tokens, counts = flatten(out.accepted.tolist(), [2, 1], out.token_ids.tolist())
    assert tokens == [1, 2, 2, 4] and counts == [2, 2]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_step():
    g = torch.Generator().manual_seed(5)
    mine = torch.randn(4, V, generator=g)  # [k+1, V], k = 3
    others = torch.randn(6, V, generator=g)
    drafts = torch.tensor([1, 1, 3])
    alone = Verifier(Sampler(seed=1))(mine, [spec(seed=42, draw=10 + j) for j in range(4)], [3], drafts)
    specs = [spec(seed=7, draw=0), spec(seed=7, draw=1)] + [spec(seed=42, draw=10 + j) for j in range(4)] + \
        [spec(), spec(), spec(), spec()]
    mixed = Verifier(Sampler(seed=2))(torch.cat([others[:2], mine, others[2:]]), specs, [1, 3, 3],
                                      torch.tensor([0, 1, 1, 3, 2, 2, 2]))
    assert mixed.token_ids[2:6].tolist() == alone.token_ids.tolist()
    assert mixed.accepted[1].item() == alone.accepted[0].item()
