"""SPEC.md §1: logit processing (temperature, top-k, top-p), parameter checks, inverse-CDF draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stats_helpers import ALPHA, chi2_pvalue

from flashspec.sampling import SamplingParams, probabilities, process_logits, sample

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_logits(mode: str, rows: int, vocab: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if mode == "normal":
        return torch.randn(rows, vocab, generator=g) * scale
    if mode == "ties":  # few distinct values: many ties at the top-k and top-p boundaries
        return torch.randint(-3, 3, (rows, vocab), generator=g).float() * scale
    if mode == "constant":
        return torch.full((rows, vocab), scale)
    # one dominant logit per row
    z = torch.randn(rows, vocab, generator=g)
    z[:, 0] += 30.0 * scale
    return z


def transformers_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    z = logits.float()
    ids = torch.zeros(z.shape[0], 1, dtype=torch.long)
    z = TemperatureLogitsWarper(float(temperature))(ids, z)
    if top_k > 0:
        z = TopKLogitsWarper(top_k)(ids, z)
    if top_p < 1.0:
        z = TopPLogitsWarper(float(top_p))(ids, z)
    return z


def assert_same_processed(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), (actual, expected)
    assert not torch.isnan(actual).any()
    finite = torch.isfinite(expected)
    assert torch.allclose(actual[finite], expected[finite], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# process_logits == transformers' Temperature -> TopK -> TopP warpers
# ----------------------------------------------------------------------------------------------


@st.composite
def warper_cases(draw):
    vocab = draw(st.integers(1, 300))
    rows = draw(st.integers(1, 4))
    temperature = draw(st.floats(0.05, 5.0))
    top_k = draw(st.integers(0, vocab + 3))
    top_p = draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0)))
    mode = draw(st.sampled_from(["normal", "ties", "constant", "dominant"]))
    scale = draw(st.floats(0.1, 20.0))
    seed = draw(st.integers(0, 2**31 - 1))
    return vocab, rows, temperature, top_k, top_p, mode, scale, seed


@FAST
@given(warper_cases())
@example((7, 2, 1.0, 3, 1.0, "ties", 1.0, 0))
@example((7, 2, 0.7, 0, 0.5, "ties", 1.0, 1))
@example((50, 3, 2.0, 10, 0.9, "normal", 3.0, 2))
@example((1, 1, 0.3, 4, 0.2, "normal", 1.0, 3))
@example((300, 4, 5.0, 303, 0.01, "dominant", 1.0, 4))
@example((10, 1, 0.05, 1, 1.0, "constant", 2.0, 5))
def test_matches_transformers_warpers(case):
    vocab, rows, temperature, top_k, top_p, mode, scale, seed = case
    logits = make_logits(mode, rows, vocab, seed, scale)
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    expected = transformers_reference(logits, temperature, top_k, top_p)
    assert_same_processed(process_logits(logits, params), expected)
    # probabilities() is softmax of the same thing, in float32
    probs = probabilities(logits, params)
    assert probs.dtype == torch.float32
    assert torch.allclose(probs, torch.softmax(expected, dim=-1), rtol=1e-5, atol=1e-7)
    assert (probs[torch.isneginf(expected)] == 0).all()  # removed tokens have no mass


def test_matches_transformers_on_float16_and_3d_input():
    g = torch.Generator().manual_seed(11)
    logits = torch.randint(-4, 4, (2, 3, 17), generator=g).to(torch.float16)
    params = SamplingParams(do_sample=True, temperature=0.6, top_k=5, top_p=0.8)
    expected = transformers_reference(logits.reshape(6, 17), 0.6, 5, 0.8).reshape(2, 3, 17)
    assert_same_processed(process_logits(logits, params), expected)


def test_top_k_keeps_ties_with_kth_largest():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0, 2.0]])
    out = process_logits(logits, SamplingParams(do_sample=True, top_k=2))
    assert torch.isneginf(out).tolist() == [[False, False, False, True, True, False]]
    out = process_logits(logits, SamplingParams(do_sample=True, top_k=1))
    assert torch.isneginf(out).tolist() == [[False, True, True, True, True, True]]
    # top_k larger than V keeps everything
    out = process_logits(logits, SamplingParams(do_sample=True, top_k=100))
    assert torch.isfinite(out).all()


def test_top_p_hand_example():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # ascending masses 0.05, 0.2, 0.5, 1.0: with top_p=0.6 every c_i <= 0.4 goes -> 0.05, 0.15
    out = process_logits(logits, SamplingParams(do_sample=True, top_p=0.6))
    assert torch.isneginf(out).tolist() == [[False, False, True, True]]
    # tiny top_p still keeps the most likely token
    out = process_logits(logits, SamplingParams(do_sample=True, top_p=0.01))
    assert torch.isneginf(out).tolist() == [[False, True, True, True]]
    p = probabilities(logits, SamplingParams(do_sample=True, top_p=0.6))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)


def test_temperature_changes_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    p_cold = probabilities(logits, SamplingParams(do_sample=True, temperature=0.7))
    p_one = probabilities(logits, SamplingParams(do_sample=True, temperature=1.0))
    p_hot = probabilities(logits, SamplingParams(do_sample=True, temperature=1.5))
    assert torch.allclose(p_one, torch.softmax(logits, -1), atol=1e-7)
    assert torch.allclose(p_cold, torch.softmax(logits / 0.7, -1), atol=1e-7)
    assert torch.allclose(p_hot, torch.softmax(logits / 1.5, -1), atol=1e-7)
    assert (p_cold - p_one).abs().max() > 0.03
    assert p_cold[0, 0] > p_one[0, 0] > p_hot[0, 0]  # lower temperature sharpens
    # temperature is applied before top-p, so the top-p cut moves with T:
    # masses 0.45/0.35/0.2 -> ascending cumulative 0.2, 0.55 at T=1; 0.11, 0.45 at T=0.5;
    # 0.28, 0.63 at T=3
    logp = torch.tensor([[0.45, 0.35, 0.2]]).log()

    def removed(t, top_p):
        z = process_logits(logp, SamplingParams(do_sample=True, temperature=t, top_p=top_p))
        return torch.isneginf(z).tolist()

    assert removed(1.0, 0.5) == [[False, False, True]]
    assert removed(0.5, 0.5) == [[False, True, True]]
    assert removed(1.0, 0.75) == [[False, False, True]]
    assert removed(3.0, 0.75) == [[False, False, False]]


# ----------------------------------------------------------------------------------------------
# Greedy parameters and validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_greedy_returns_raw_float32_logits(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, generator=g) * 4).to(dtype)
    params = SamplingParams(do_sample=False, temperature=0.3, top_k=2, top_p=0.2)
    out = process_logits(logits, params)
    assert out.dtype == torch.float32
    assert torch.equal(out, logits.float())
    assert torch.isfinite(out).all()


def test_greedy_allows_zero_temperature():
    SamplingParams(do_sample=False, temperature=0.0)
    SamplingParams(do_sample=False, temperature=0)
    SamplingParams()  # defaults are valid


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(do_sample=True, temperature=0.0),
        dict(do_sample=True, temperature=-0.5),
        dict(do_sample=True, temperature=float("nan")),
        dict(do_sample=True, temperature=float("inf")),
        dict(do_sample=True, temperature=float("-inf")),
        dict(do_sample=True, top_p=0.0),
        dict(do_sample=True, top_p=1.5),
        dict(do_sample=True, top_p=-0.1),
        dict(do_sample=True, top_p=float("nan")),
        dict(do_sample=False, top_p=0.0),
        dict(do_sample=False, top_p=1.5),
        dict(do_sample=False, top_p=-0.1),
        dict(do_sample=False, top_p=float("nan")),
        dict(do_sample=True, top_k=-1),
        dict(do_sample=True, top_k=2.5),
        dict(do_sample=True, top_k=True),
        dict(do_sample=False, top_k=-1),
        dict(do_sample=False, top_k=2.5),
        dict(do_sample=False, top_k=True),
    ],
    ids=repr,
)
def test_invalid_params_raise(kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert len(str(info.value)) > 10  # a sentence, not a bare exception


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(do_sample=True, temperature=1e-3, top_k=0, top_p=1.0),
        dict(do_sample=True, temperature=100.0, top_k=1, top_p=1e-6),
        dict(do_sample=True, temperature=2, top_k=10**6, top_p=1),
    ],
)
def test_valid_params_accepted(kwargs):
    SamplingParams(**kwargs)


# ----------------------------------------------------------------------------------------------
# sample(weights, uniforms)
# ----------------------------------------------------------------------------------------------

EDGE_UNIFORMS = [0.0, 1e-300, 0.5, 1.0 - 1e-16, math.nextafter(1.0, 0.0), 1.0 - 1e-9]


@st.composite
def weight_cases(draw):
    vocab = draw(st.integers(1, 40))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    n_rows = int(np.prod(lead)) if lead else 1
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    element = st.one_of(
        st.just(0.0),
        st.just(0.0),
        st.floats(1e-30, 1e3),
        st.sampled_from([1e-38, 1e-45, 1.0, 1e30]),
    )
    rows = []
    for _ in range(n_rows):
        row = draw(st.lists(element, min_size=vocab, max_size=vocab))
        if not any(x > 0 for x in row):
            row[draw(st.integers(0, vocab - 1))] = draw(st.floats(1e-10, 10.0))
        rows.append(row)
    uniform = st.one_of(st.sampled_from(EDGE_UNIFORMS), st.floats(0.0, 1.0, exclude_max=True))
    uniforms = draw(st.lists(uniform, min_size=n_rows, max_size=n_rows))
    weights = torch.tensor(rows, dtype=torch.float64).to(dtype).reshape(*lead, vocab)
    # float32 may flush 1e-45 etc. to zero: make sure each row still has positive mass
    weights = weights.reshape(n_rows, vocab)
    empty = weights.sum(-1) == 0
    weights[empty, -1] = 1.0
    weights = weights.reshape(*lead, vocab)
    return weights, torch.tensor(uniforms, dtype=torch.float64).reshape(lead)


@settings(max_examples=150, deadline=None)
@given(weight_cases())
def test_sample_never_returns_zero_weight_token(case):
    weights, uniforms = case
    tokens = sample(weights, uniforms)
    assert tokens.shape == uniforms.shape
    assert tokens.dtype == torch.long
    flat_w = weights.reshape(-1, weights.shape[-1]).double()
    flat_t = tokens.reshape(-1)
    flat_u = uniforms.reshape(-1)
    assert ((flat_t >= 0) & (flat_t < weights.shape[-1])).all()
    chosen = flat_w.gather(1, flat_t[:, None]).squeeze(1)
    assert (chosen > 0).all(), (weights, uniforms, tokens)
    # inverse CDF: the token's CDF interval contains u * total (up to float64 rounding)
    cdf = flat_w.cumsum(-1)
    total = cdf[:, -1]
    before = torch.where(flat_t > 0, cdf.gather(1, (flat_t - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    through = cdf.gather(1, flat_t[:, None]).squeeze(1)
    target = flat_u * total
    tol = 1e-12 * total
    assert (before <= target + tol).all()
    last_positive = torch.where(flat_w > 0, torch.arange(flat_w.shape[1]), -1).amax(-1)
    assert ((through > target - tol) | (flat_t == last_positive)).all()


@pytest.mark.parametrize("u", EDGE_UNIFORMS)
def test_sample_edge_uniforms_with_zero_ends(u):
    weights = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7, 0.0, 0.0]] * 2, dtype=torch.float32)
    tokens = sample(weights, torch.tensor([u, u], dtype=torch.float64))
    assert tokens.tolist()[0] in (2, 4)
    if u == 0.0:
        assert tokens.tolist() == [2, 2]  # smallest i with cdf_i > 0
    if u >= 0.5:
        assert tokens.tolist() == [4, 4]


def test_sample_boundary_is_strict_inverse_cdf():
    w = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    # token = smallest i with cumsum_i > u * sum  (cumsum = 1, 2, 4; sum = 4)
    cases = {0.0: 0, 0.2499: 0, 0.25: 1, 0.4999: 1, 0.5: 2, 0.99: 2}
    for u, expected in cases.items():
        assert int(sample(w, torch.tensor(u, dtype=torch.float64))) == expected, u
    # the same rule on unnormalised weights, in a batch, with a 0-d uniform per row
    w3 = torch.tensor([[5.0, 0.0, 5.0], [0.0, 3.0, 1.0]])
    assert sample(w3, torch.tensor([0.5, 0.74])).tolist() == [2, 1]
    assert sample(w3, torch.tensor([0.49, 0.75])).tolist() == [0, 2]


@pytest.mark.parametrize("scale", [1.0, 37.5, 1e-20])
def test_sample_empirical_law(scale):
    law = np.array([0.1, 0.0, 0.3, 0.05, 0.0, 0.25, 0.3])
    weights = torch.tensor(law * scale, dtype=torch.float64)
    g = torch.Generator().manual_seed(1234)
    n = 100_000
    uniforms = torch.rand(n, dtype=torch.float64, generator=g)
    tokens = sample(weights.expand(n, -1), uniforms)
    counts = np.bincount(tokens.numpy(), minlength=len(law))
    assert counts[1] == 0 and counts[4] == 0
    assert chi2_pvalue(counts, law) > ALPHA
    # power: the same samples are clearly not uniform over the support
    support = (law > 0).astype(float)
    assert chi2_pvalue(counts, support) < ALPHA


def test_sample_float32_weights_empirical_law():
    # float32 weights as verify passes them (drawn in float64 internally)
    law = torch.softmax(torch.tensor([1.0, 0.2, -0.7, 2.0, 0.0]), -1)
    g = torch.Generator().manual_seed(99)
    n = 100_000
    tokens = sample(law.expand(n, -1), torch.rand(n, dtype=torch.float64, generator=g))
    counts = np.bincount(tokens.numpy(), minlength=5)
    assert chi2_pvalue(counts, law.double().numpy()) > ALPHA
