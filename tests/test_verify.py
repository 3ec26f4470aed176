"""SPEC.md §2 step 4: flashspec.verify.verify, the exact speculative-sampling rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stats_helpers import ALPHA, chi2_pvalue

from flashspec.sampling import SamplingParams, probabilities, sample
from flashspec.verify import verify

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------
# Property tests
# ----------------------------------------------------------------------------------------------


@st.composite
def verify_cases(draw):
    batch = draw(st.one_of(st.just(1), st.integers(1, 6)))
    k = draw(st.one_of(st.just(1), st.integers(0, 6)))
    vocab = draw(st.integers(2, 40))
    do_sample = draw(st.booleans())
    temperature = draw(st.floats(0.1, 3.0))
    top_k = draw(st.one_of(st.just(0), st.integers(0, vocab + 2)))
    top_p = draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
    with_probs = draw(st.booleans())
    ties = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, k, vocab, do_sample, temperature, top_k, top_p, with_probs, ties, seed


def build_inputs(batch, k, vocab, params, with_probs, ties, seed):
    """Target logits, drafts drawn from a processed drafter law q (or deterministic drafts with
    q = None), and float64 uniforms. Drafts agree with the target argmax for a random prefix so
    that greedy acceptance is exercised."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        target = torch.randint(-2, 3, (batch, k + 1, vocab), generator=g).float()
    else:
        target = torch.randn(batch, k + 1, vocab, generator=g) * 3
    uniforms = torch.rand(batch, k + 1, dtype=torch.float64, generator=g)
    # edge uniforms: exactly 0 (a zero-probability draft must still be rejected) and 1 - 2^-53
    edge = torch.rand(batch, k + 1, generator=g)
    uniforms = torch.where(edge < 0.15, 0.0, uniforms)
    uniforms = torch.where(edge > 0.9, 1.0 - 2.0**-53, uniforms)
    if with_probs:
        if torch.rand((), generator=g) < 0.3:
            draft_logits = target.clone()  # drafter == target
        else:
            draft_logits = target + torch.randn(batch, k + 1, vocab, generator=g) * 2
        draft_params = params if params.do_sample else SamplingParams(do_sample=True)
        q = probabilities(draft_logits[:, :k], draft_params)
        drafts = sample(q, torch.rand(batch, k, dtype=torch.float64, generator=g))
    else:
        q = None
        drafts = torch.randint(0, vocab, (batch, k), generator=g)
        # a random-length prefix of drafts equal to the target's greedy choice
        agree = torch.randint(0, k + 1, (batch,), generator=g)
        greedy_choice = target[:, :k].argmax(-1)
        drafts = torch.where(torch.arange(k)[None, :] < agree[:, None], greedy_choice, drafts)
    return target, drafts, q, uniforms


def check_structure(result, drafts, batch, k, vocab):
    n, tokens = result.num_accepted, result.tokens
    assert n.shape == (batch,) and tokens.shape == (batch, k + 1)
    assert n.dtype == torch.long and tokens.dtype == torch.long
    assert ((n >= 0) & (n <= k)).all()
    cols = torch.arange(k + 1)[None, :]
    padded = torch.cat([drafts, torch.full((batch, 1), -1)], 1)
    before = cols < n[:, None]
    after = cols > n[:, None]
    assert torch.equal(tokens[before], padded[before])  # accepted drafts, in order
    assert (tokens[after] == -1).all()  # nothing after the new token
    final = tokens.gather(1, n[:, None]).squeeze(1)
    assert ((final >= 0) & (final < vocab)).all()
    assert ((tokens >= 0).sum(1) == n + 1).all()  # n + 1 tokens, at most k + 1
    return n, final


@PROPS
@given(verify_cases())
@example((1, 0, 2, True, 1.0, 0, 1.0, False, False, 0))
@example((1, 1, 2, True, 0.5, 1, 1.0, True, True, 1))
@example((6, 6, 40, True, 0.7, 5, 0.8, True, False, 2))
@example((6, 6, 40, False, 0.7, 5, 0.8, False, True, 3))
@example((3, 1, 5, False, 1.0, 0, 1.0, True, True, 4))
def test_verify_properties(case):
    batch, k, vocab, do_sample, temperature, top_k, top_p, with_probs, ties, seed = case
    params = SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    target, drafts, q, uniforms = build_inputs(batch, k, vocab, params, with_probs, ties, seed)
    result = verify(target, drafts, q, params, uniforms if do_sample else None)
    n, final = check_structure(result, drafts, batch, k, vocab)
    rows = torch.arange(batch)

    if not do_sample:
        greedy = target.numpy().argmax(-1)  # lowest index on ties
        match = drafts.numpy() == greedy[:, :k]
        expected_n = np.cumprod(match, axis=1).sum(1) if k else np.zeros(batch, dtype=int)
        assert n.tolist() == expected_n.tolist()
        assert final.tolist() == greedy[np.arange(batch), expected_n].tolist()
        # greedy reads no uniforms
        again = verify(target, drafts, q, params, uniforms)
        assert torch.equal(again.tokens, result.tokens)
        return

    p = probabilities(target, params).double()  # [B, k+1, V]
    if q is None:
        q_full = torch.nn.functional.one_hot(drafts, vocab).double()
    else:
        q_full = q.double()
    p_d = p[:, :k].gather(2, drafts[..., None]).squeeze(2)
    q_d = q_full.gather(2, drafts[..., None]).squeeze(2)
    # accept test u * q(d) < p(d), prefix only
    passes = uniforms[:, :k] * q_d < p_d
    expected_n = torch.cumprod(passes.long(), 1).sum(1)
    assert torch.equal(n, expected_n)
    # an accepted draft never has zero target probability
    accepted = torch.arange(k)[None, :] < n[:, None]
    assert (p_d[accepted] > 0).all()
    # the final token never has zero target probability at its position
    p_n = p[rows, n]
    assert (p_n[rows, final] > 0).all()
    # a corrected token (n < k) comes from the residual max(0, p - q) when it has mass
    q_n = torch.where((n < k)[:, None], q_full[rows, n.clamp(max=max(k - 1, 0))], 0.0) if k else 0 * p_n
    residual = (p_n - q_n).clamp(min=0)
    law = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    assert (law[rows, final] > 0).all()
    # ... drawn by inverse CDF with the last uniform u_{k+1}
    cdf = law.cumsum(-1)
    total = cdf[:, -1]
    target_mass = uniforms[:, k] * total
    before = torch.where(final > 0, cdf.gather(1, (final - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    through = cdf[rows, final]
    tol = 1e-6 * total
    assert (before <= target_mass + tol).all()
    last_positive = torch.where(law > 0, torch.arange(vocab), -1).amax(-1)
    assert ((through > target_mass - tol) | (final == last_positive)).all()


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 6),
    k=st.integers(0, 6),
    vocab=st.integers(2, 40),
    with_probs=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_deterministic_given_uniforms(batch, k, vocab, with_probs, seed):
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=0, top_p=0.95)
    target, drafts, q, uniforms = build_inputs(batch, k, vocab, params, with_probs, False, seed)
    a = verify(target, drafts, q, params, uniforms)
    b = verify(target.clone(), drafts.clone(), None if q is None else q.clone(), params, uniforms.clone())
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.tokens, b.tokens)


def test_uniforms_change_outputs():
    """The output depends on the uniforms (they are not ignored) but only through them."""
    batch, k, vocab = 2000, 3, 10
    params = SamplingParams(do_sample=True, temperature=1.0)
    target, drafts, q, u1 = build_inputs(batch, k, vocab, params, True, False, 7)
    u2 = torch.rand(batch, k + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    a = verify(target, drafts, q, params, u1)
    b = verify(target, drafts, q, params, u2)
    assert not torch.equal(a.num_accepted, b.num_accepted)
    assert not torch.equal(a.tokens, b.tokens)
    # only the final-draw uniform changed: acceptance is identical, final token may move
    u3 = u1.clone()
    u3[:, k] = u2[:, k]
    c = verify(target, drafts, q, params, u3)
    assert torch.equal(a.num_accepted, c.num_accepted)
    assert not torch.equal(a.tokens, c.tokens)
    # uniforms for drafts after the first rejection are irrelevant (prefix only)
    u4 = u1.clone()
    cols = torch.arange(k + 1)[None, :]
    later = (cols > a.num_accepted[:, None]) & (cols < k)
    u4[later] = 0.0  # these would all pass their own test
    d = verify(target, drafts, q, params, u4)
    assert torch.equal(a.tokens, d.tokens)


def test_prefix_only_rejects_later_passing_drafts():
    vocab = 4
    params = SamplingParams(do_sample=True)
    target = torch.zeros(1, 4, vocab)  # p uniform = 0.25 everywhere
    q = torch.full((1, 3, vocab), 0.25)
    q[0, 0] = torch.tensor([0.1, 0.7, 0.1, 0.1])  # draft 1 has q = 0.7 > p = 0.25
    drafts = torch.tensor([[1, 2, 3]])
    # u_1 * 0.7 = 0.63 >= 0.25: rejected; u_2, u_3 = 0 would pass their own tests
    uniforms = torch.tensor([[0.9, 0.0, 0.0, 0.0]], dtype=torch.float64)
    r = verify(target, drafts, q, params, uniforms)
    assert r.num_accepted.tolist() == [0]
    # residual max(0, p - q) = [0.15, 0, 0.15, 0.15]: u = 0 gives token 0, never the draft 1
    assert r.tokens.tolist() == [[0, -1, -1, -1]]
    uniforms[0, 3] = 0.5  # 0.5 * 0.45 = 0.225 -> cumulative 0.15, 0.15, 0.30 -> token 2
    assert verify(target, drafts, q, params, uniforms).tokens.tolist() == [[2, -1, -1, -1]]
    # all accepted: bonus from p_{k+1} with u_{k+1}
    uniforms = torch.tensor([[0.3, 0.99, 0.5, 0.8]], dtype=torch.float64)
    r = verify(target, drafts, q, params, uniforms)
    assert r.num_accepted.tolist() == [3]
    assert r.tokens.tolist() == [[1, 2, 3, 3]]


@pytest.mark.parametrize("with_probs", [False, True])
def test_zero_probability_draft_rejected_even_with_zero_uniform(with_probs):
    """Accept iff u * q(d) < p(d) (strict): with p(d) = 0 even u = 0 rejects."""
    params = SamplingParams(do_sample=True, top_k=2)
    target = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]])  # top-2 removes 2, 3
    drafts = torch.tensor([[2]])
    q = torch.tensor([[[0.1, 0.1, 0.7, 0.1]]]) if with_probs else None
    uniforms = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    r = verify(target, drafts, q, params, uniforms)
    assert r.num_accepted.tolist() == [0]
    assert r.tokens.tolist() == [[0, -1]]  # residual puts no mass on the rejected draft
    # a draft with p(d) > 0 and u = 0 is accepted, and the bonus comes from position 2
    r = verify(target, torch.tensor([[1]]), q, params, uniforms)
    assert r.num_accepted.tolist() == [1]
    assert r.tokens.tolist() == [[1, 2]]


def test_zero_mass_residual_falls_back_to_p():
    """Rejection while q >= p everywhere (p == q up to rounding): the token is drawn from p."""
    params = SamplingParams(do_sample=True, temperature=0.8)
    target = torch.tensor([[[2.0, 0.5, -1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]]])
    p = probabilities(target, params)
    q = p[:, :1] * (1 + 1e-5)  # "rounding": q slightly above p everywhere
    drafts = torch.tensor([[0]])
    for u_final in [0.0, 0.3, 0.6, 0.999999]:
        uniforms = torch.tensor([[1 - 1e-7, u_final]], dtype=torch.float64)
        r = verify(target, drafts, q, params, uniforms)
        assert r.num_accepted.tolist() == [0]
        expected = sample(p[0, 0], torch.tensor(u_final, dtype=torch.float64))
        assert r.tokens.tolist() == [[int(expected), -1]]


def test_greedy_ties_take_lowest_index():
    target = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 2.0, 0.0, 2.0]]])
    params = SamplingParams(do_sample=False)
    r = verify(target, torch.tensor([[1, 0]]), None, params)
    assert r.num_accepted.tolist() == [2] and r.tokens.tolist() == [[1, 0, 1]]
    r = verify(target, torch.tensor([[2, 0]]), None, params)
    assert r.num_accepted.tolist() == [0] and r.tokens.tolist() == [[1, -1, -1]]
    r = verify(target, torch.tensor([[1, 3]]), None, params)
    assert r.num_accepted.tolist() == [1] and r.tokens.tolist() == [[1, 0, -1]]
    # greedy ignores temperature/top-k/top-p: raw argmax
    hot = SamplingParams(do_sample=False, temperature=0.0, top_k=1, top_p=0.1)
    assert verify(target, torch.tensor([[1, 0]]), None, hot).tokens.tolist() == [[1, 0, 1]]


# ----------------------------------------------------------------------------------------------
# Exactness without a model: the first emitted token is distributed as p
# ----------------------------------------------------------------------------------------------

N_ROWS = 200_000
EXACT_PARAMS = SamplingParams(do_sample=True, temperature=0.8, top_k=4)
V6 = 6
# target logits at positions 1..4 (the k=3 case uses all four, k=1 the first two)
TARGET = torch.tensor(
    [
        [2.0, 1.2, 0.3, -0.5, 1.7, -1.0],  # top-4 removes tokens 3 and 5
        [0.2, -0.4, 1.5, 1.1, -2.0, 0.9],
        [-1.0, 0.0, 1.0, 0.5, 0.7, 0.1],
        [1.0, 1.0, 0.0, -1.0, 0.5, 0.2],
    ]
)
# drafter logits: its top-4 keeps tokens 1, 2, 3, 5 (q has mass where p has none)
DRAFTER = torch.tensor(
    [
        [0.1, 1.5, 1.0, 0.8, -0.3, 0.2],
        [1.0, 0.3, 0.2, -1.0, 1.4, 0.0],
        [0.5, -0.2, 1.2, 0.0, 0.3, 0.9],
    ]
)


def run_batch(case: str, k: int, seed: int, params=EXACT_PARAMS):
    g = torch.Generator().manual_seed(seed)
    target = TARGET[None, : k + 1].expand(N_ROWS, -1, -1).contiguous()
    if case == "independent":
        q_one = probabilities(DRAFTER[:k], params)
    elif case == "same":
        q_one = probabilities(TARGET[:k], params)
    else:
        q_one = None
    if q_one is not None:
        q = q_one[None].expand(N_ROWS, -1, -1).contiguous()
        drafts = sample(q, torch.rand(N_ROWS, k, dtype=torch.float64, generator=g))
        q_first = q_one[0]
    else:
        q = None
        fixed = {"onehot": [0, 2, 2], "onehot_impossible": [3, 0, 1]}[case][:k]
        drafts = torch.tensor(fixed).expand(N_ROWS, -1).contiguous()
        q_first = torch.nn.functional.one_hot(torch.tensor(fixed[0]), V6).float()
    uniforms = torch.rand(N_ROWS, k + 1, dtype=torch.float64, generator=g)
    return verify(target, drafts, q, params, uniforms), q_first


CASES = ["independent", "same", "onehot", "onehot_impossible"]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_first_token_distributed_as_target(case, k):
    result, q_first = run_batch(case, k, seed=1000 + 10 * k + CASES.index(case))
    p = probabilities(TARGET, EXACT_PARAMS).double()
    n, tokens = result.num_accepted, result.tokens
    first = tokens[:, 0]
    assert (first >= 0).all()
    counts = np.bincount(first.numpy(), minlength=V6)
    assert counts[3] == 0 and counts[5] == 0  # removed by top-k
    pvalue = chi2_pvalue(counts, p[0].numpy())
    assert pvalue > ALPHA, (counts, p[0])

    # acceptance rate of the first draft = sum_x min(p(x), q(x))
    expected_rate = float(torch.minimum(p[0], q_first.double()).sum())
    rate = float((n >= 1).double().mean())
    se = (max(expected_rate * (1 - expected_rate), 1e-12) / N_ROWS) ** 0.5
    if case == "same":
        assert (n == k).all()  # p == q: every draft accepted, residual never needed
    elif case == "onehot_impossible":
        assert (n == 0).all()  # p(d) = 0: always rejected
    else:
        assert 0.05 < expected_rate < 0.95
        assert abs(rate - expected_rate) < 4 * se, (rate, expected_rate, se)

    # later positions: given that i drafts were accepted, the next token is distributed as p_{i+1}
    for i in range(1, k if case != "onehot_impossible" else 1):
        rows = n >= i
        assert rows.sum() > 2_000
        counts_i = np.bincount(tokens[rows, i].numpy(), minlength=V6)
        assert chi2_pvalue(counts_i, p[i].numpy()) > ALPHA, (i, counts_i, p[i])

    # power: the same samples are rejected against the T = 1 law
    p_t1 = probabilities(TARGET[0], SamplingParams(do_sample=True, temperature=1.0, top_k=4))
    assert chi2_pvalue(counts, p_t1.double().numpy()) < ALPHA


def test_bonus_token_distributed_as_last_position():
    """p == q: all k drafts accepted and the bonus token follows p_{k+1}."""
    k = 3
    result, _ = run_batch("same", k, seed=77)
    assert (result.num_accepted == k).all()
    p = probabilities(TARGET, EXACT_PARAMS).double()
    counts = np.bincount(result.tokens[:, k].numpy(), minlength=V6)
    assert chi2_pvalue(counts, p[k].numpy()) > ALPHA
    # and not p_k (a wrong position would be caught)
    assert chi2_pvalue(counts, p[k - 1].numpy()) < ALPHA


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def _simple(batch=2, k=2, vocab=5):
    g = torch.Generator().manual_seed(0)
    target = torch.randn(batch, k + 1, vocab, generator=g)
    drafts = torch.randint(0, vocab, (batch, k), generator=g)
    return target, drafts


@pytest.mark.parametrize("shape", [None, (2, 2), (2, 4), (3, 3), (2,), (2, 3, 1)], ids=str)
def test_bad_uniforms_raise_when_sampling(shape):
    target, drafts = _simple()
    params = SamplingParams(do_sample=True)
    uniforms = None if shape is None else torch.rand(*shape, dtype=torch.float64)
    with pytest.raises(ValueError):
        verify(target, drafts, None, params, uniforms)


def test_greedy_needs_no_uniforms():
    target, drafts = _simple()
    r = verify(target, drafts, None, SamplingParams(do_sample=False), None)
    assert r.tokens.shape == (2, 3)


@pytest.mark.parametrize("do_sample", [True, False])
@pytest.mark.parametrize("shape", [(2, 2, 5), (2, 4, 5), (3, 3, 5), (1, 3, 5)], ids=str)
def test_target_shape_mismatch_raises(shape, do_sample):
    _, drafts = _simple()
    target = torch.randn(*shape)
    uniforms = torch.rand(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError):
        verify(target, drafts, None, SamplingParams(do_sample=do_sample), uniforms)


def test_unknown_backend_raises():
    target, drafts = _simple()
    with pytest.raises(ValueError):
        verify(target, drafts, None, SamplingParams(), None, backend="triton-nonexistent")
