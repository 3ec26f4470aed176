"""Block verification (SPEC.md §2, "Block verification"): the target's exact law, greedy equal to
token-wise, never fewer drafts kept in expectation, shapes and no host synchronisation.

The direct tests drive ``verify(..., acceptance="block")`` over a toy language model whose laws
are tables indexed by the whole prefix (vocabulary 4, prefixes up to 4 tokens), so the law of the
block depends on every drafted token, as with a real model. The exact law is computed with
transformers' logits warpers, not FlashSpec's sampling code.
"""

from __future__ import annotations

import importlib
import itertools
import os
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from stats_helpers import ALPHA, chi2_pvalue

from flashspec import SamplingParams, SpeculativeEngine
from flashspec.sampling import probabilities, sample
from flashspec.verify import verify

verify_module = importlib.import_module("flashspec.verify")  # (the package's ``verify`` is the function)

V = 4  # toy vocabulary
SAMPLES = 20_000
MAX_PREFIX = 4  # the toy model's laws are defined for prefixes of 0..MAX_PREFIX tokens


# ------------------------------------------------------------------------------ a toy model
def _offsets() -> list[int]:
    """Where the contexts of each prefix length start in the tables (base-V numbering)."""
    out, start = [], 0
    for length in range(MAX_PREFIX + 1):
        out.append(start)
        start += V**length
    return out + [start]


OFFSETS = _offsets()


def context_of(prefix: torch.Tensor) -> torch.Tensor:
    """The table row of each prefix in ``prefix [N, j]``."""
    n, j = prefix.shape
    index = torch.zeros(n, dtype=torch.long)
    for c in range(j):
        index = index * V + prefix[:, c]
    return OFFSETS[j] + index


def table(seed: int, scale: float = 2.5) -> torch.Tensor:
    """Logits ``[contexts, V]`` of a random toy model: one law per prefix."""
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(OFFSETS[-1], V, generator=gen)


TARGET = table(0)
DRAFTERS = {
    "other": lambda: table(1),  # unrelated: many rejections
    "noisy": lambda: TARGET + 1.5 * table(2, scale=1.0),  # p != q, often accepted
    "self": lambda: TARGET.clone(),  # drafter == target: every residual has no mass
    # drafts = its argmax, no q (a deterministic drafter: one-hot q); near the target's, so some pass
    "point": lambda: TARGET + 1.5 * table(3, scale=1.0),
}


def warped_law(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed laws by transformers' warpers (independent of flashspec.sampling), float64."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return torch.softmax(warpers(None, logits.float()), dim=-1).double()


def exact_joint(params: SamplingParams, length: int) -> np.ndarray:
    """P(x_1..x_length) under the target, ``[V] * length``, by enumeration."""
    laws = warped_law(TARGET, params)
    joint = np.zeros([V] * length)
    for seq in itertools.product(range(V), repeat=length):
        prob = 1.0
        for j in range(length):
            prob *= float(laws[context_of(torch.tensor([seq[:j]], dtype=torch.long).view(1, j))[0], seq[j]])
        joint[seq] = prob
    return joint


def one_block(drafter: str, params: SamplingParams, gamma: int, rows: int, seed: int,
              acceptance: str = "block", backend: str = "reference") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One speculative step from the empty prefix for ``rows`` independent rows: the drafts, the
    verification result's counts and tokens, each row completed to ``gamma + 1`` tokens by the
    target's own law (the steps that follow)."""
    gen = torch.Generator().manual_seed(seed)
    draft_table = DRAFTERS[drafter]()
    drafts = torch.zeros(rows, gamma, dtype=torch.long)
    probs = torch.zeros(rows, gamma, V)
    for i in range(gamma):
        logits = draft_table[context_of(drafts[:, :i])]
        if drafter == "point":
            drafts[:, i] = logits.argmax(dim=-1)
        else:
            probs[:, i] = probabilities(logits, params)
            drafts[:, i] = sample(probs[:, i], torch.rand(rows, generator=gen, dtype=torch.float64))
    target_logits = torch.stack([TARGET[context_of(drafts[:, :i])] for i in range(gamma + 1)], dim=1)
    uniforms = torch.rand(rows, gamma + 1, generator=gen, dtype=torch.float64)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    inputs = [x.to(device) for x in (target_logits, drafts, probs, uniforms)]
    result = verify(*inputs[:2], None if drafter == "point" else inputs[2], params, inputs[3],
                    acceptance=acceptance, backend=backend)
    result = type(result)(result.num_accepted.cpu(), result.tokens.cpu())
    out = result.tokens.clone()
    for j in range(gamma + 1):  # continue after the step's new token with the target itself
        todo = out[:, j] < 0
        law = probabilities(TARGET[context_of(out[:, :j].clamp(min=0))], params)
        drawn = sample(law, torch.rand(rows, generator=gen, dtype=torch.float64))
        out[:, j] = torch.where(todo, drawn, out[:, j])
    return result.num_accepted, result.tokens, out


def chi_square(out: torch.Tensor, law: np.ndarray) -> float:
    observed = np.bincount(np.ravel_multi_index(out.numpy().T, law.shape), minlength=law.size)
    return chi2_pvalue(observed, law.ravel())


# ------------------------------------------------------------------------------ (a) the law
LAW_CASES = [
    ("other", 1.0, 0, 1.0, 1),
    ("other", 0.7, 3, 0.9, 3),
    ("noisy", 0.7, 0, 1.0, 3),
    ("noisy", 1.3, 3, 1.0, 1),
    ("noisy", 0.8, 0, 0.8, 3),
    ("self", 0.7, 0, 1.0, 3),
    ("self", 1.0, 3, 0.9, 1),
    ("point", 0.7, 3, 1.0, 3),
    ("point", 1.2, 0, 0.9, 1),
]


@pytest.mark.parametrize("drafter,temperature,top_k,top_p,gamma", LAW_CASES)
def test_block_verification_samples_the_exact_target_law(drafter, temperature, top_k, top_p, gamma):
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    accepted, _, out = one_block(drafter, params, gamma, SAMPLES, seed=gamma * 100 + len(drafter))
    pvalue = chi_square(out, exact_joint(params, gamma + 1))
    print(f"{drafter} T={temperature} top_k={top_k} top_p={top_p} γ={gamma}: χ² p = {pvalue:.3f}")
    assert pvalue > ALPHA, f"χ² p-value {pvalue:.2e}: block verification's law differs from the target's"
    if drafter == "self":
        assert bool((accepted == gamma).all())
    else:
        assert 0 < accepted.float().mean() < gamma  # both the accept and the reject paths ran


def test_power_a_wrong_stop_probability_fails(monkeypatch):
    """The χ² test has power: stop probabilities from step 4's residual (``w_i`` taken as 1)
    instead of the block's change the law, and are rejected; so are T = 0.7 samples against
    the T = 1 law."""
    params = SamplingParams(do_sample=True, temperature=0.7)
    _, _, out = one_block("other", params, 3, SAMPLES, seed=5)
    assert chi_square(out, exact_joint(SamplingParams(do_sample=True), 4)) < ALPHA
    right = verify_module._residual_masses
    monkeypatch.setattr(verify_module, "_residual_masses",
                        lambda w, p, pd, dp: right(torch.ones_like(w), p, pd, dp))
    _, _, out = one_block("other", params, 3, SAMPLES, seed=5)
    pvalue = chi_square(out, exact_joint(params, 4))
    print(f"stop probabilities with w_i = 1: χ² p = {pvalue:.2e}")
    assert pvalue < ALPHA


# Through the engine: test_distribution's tiny Llama, its drafters and its exact law.
ENGINE_CASES = [("noisy", 0.7, 4, 0.9, 3), ("independent", 1.0, 0, 1.0, 1), ("self", 0.7, 0, 1.0, 3),
                ("ngram", 0.9, 6, 1.0, 3)]


@pytest.mark.parametrize("drafter,temperature,top_k,top_p,gamma", ENGINE_CASES)
def test_engine_with_block_verification_samples_the_exact_law(drafter, temperature, top_k, top_p, gamma):
    import test_distribution as dist

    made = dist.DRAFTERS[drafter]()
    engine = SpeculativeEngine(dist.TARGET, [made], selector="fixed", acceptance="block")
    out = engine.generate([dist.PROMPT] * dist.SAMPLES, max_new_tokens=5, do_sample=True, temperature=temperature,
                          top_k=top_k, top_p=top_p, num_draft_tokens=gamma, eos_token_id=[], seed=4321)
    samples = np.array([s[:3] for s in out.sequences])
    pvalue = dist.chi_square_pvalue(samples, dist.exact_law(temperature, top_k, top_p))
    print(f"engine {drafter} T={temperature} top_k={top_k} top_p={top_p} γ={gamma}: χ² p = {pvalue:.3f}, "
          f"acceptance {out.stats.acceptance_rate:.3f}")
    assert pvalue > ALPHA, f"χ² p-value {pvalue:.2e}: output law differs from the target's"
    if drafter == "self":
        assert out.stats.acceptance_rate > 0.99
    else:
        assert 0.0 < out.stats.acceptance_rate < 1.0


# ------------------------------------------------------------------------------ (b) greedy
@pytest.mark.parametrize("probs", [True, False])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_block_is_token_wise(gamma, probs):
    gen = torch.Generator().manual_seed(gamma)
    logits = torch.randn(64, gamma + 1, 6, generator=gen)
    drafts = torch.where(torch.rand(64, gamma, generator=gen) < 0.8, logits[:, :gamma].argmax(-1),
                         torch.randint(0, 6, (64, gamma), generator=gen))
    q = torch.softmax(torch.randn(64, gamma, 6, generator=gen), -1) if probs else None
    greedy = SamplingParams()
    token = verify(logits, drafts, q, greedy, acceptance="token")
    block = verify(logits, drafts, q, greedy, acceptance="block")
    assert torch.equal(token.num_accepted, block.num_accepted) and torch.equal(token.tokens, block.tokens)
    assert 0 < token.num_accepted.float().mean() < gamma


@pytest.mark.parametrize("drafter", ["model", "ngram", "self"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_engine_with_block_verification_matches_hf_generate(drafter, gamma):
    import test_greedy as greedy

    arch = "llama"
    target = greedy.target_model(arch)
    made = {"model": lambda: greedy.noisy_drafter(arch), "ngram": lambda: "ngram", "self": lambda: target}[drafter]()
    prompts = [list(p) for p in greedy.PROMPTS]
    expected = [greedy.hf_greedy(arch, tuple(p), greedy.NEW_TOKENS) for p in prompts]
    outputs = {}
    for acceptance in ("token", "block"):
        engine = SpeculativeEngine(target, [made], device="cpu", selector="fixed", acceptance=acceptance)
        outputs[acceptance] = engine.generate(prompts, max_new_tokens=greedy.NEW_TOKENS, do_sample=False,
                                              num_draft_tokens=gamma).sequences
    greedy.assert_rows_equal(outputs["block"], expected, f"{drafter} γ={gamma} block")
    assert outputs["block"] == outputs["token"]


def test_running_batch_verifies_with_the_engines_rule():
    """A running batch (SPEC.md §12) verifies each parameter set with ``acceptance="block"``: its
    greedy row equals ``generate``'s, its sampled row commits its whole budget."""
    import test_distribution as dist

    engine = SpeculativeEngine(dist.TARGET, [dist.DRAFTERS["noisy"]()], selector="fixed", acceptance="block")
    expected = engine.generate([dist.PROMPT], max_new_tokens=6, num_draft_tokens=3, eos_token_id=[]).sequences[0]
    with engine.batch(slots=2, max_length=32, num_draft_tokens=3, eos_token_id=[]) as batch:
        greedy = batch.add(dist.PROMPT, max_new_tokens=6)
        sampled = batch.add(dist.PROMPT, max_new_tokens=6, do_sample=True, temperature=0.7, seed=1)
        tokens = {greedy: [], sampled: []}
        while batch.free_slots < 2:
            for update in batch.step():
                tokens[update.handle].extend(update.tokens)
    assert tokens[greedy] == expected
    assert len(tokens[sampled]) == 6 and all(0 <= x < dist.V for x in tokens[sampled])


# ------------------------------------------------------------------------------ (c) acceptance
def _expected_accepted(p: list[Fraction], q: list[Fraction], gamma: int) -> tuple[Fraction, Fraction]:
    """Exact E[n] of token-wise and block verification for context-free laws ``p``, ``q``, by
    enumerating every block (SPEC.md: E[n] = Σ_i E[w_i], token-wise Σ_i E[Π min(1, p/q)])."""
    token = block = Fraction(0)
    for i in range(1, gamma + 1):
        for seq in itertools.product(range(len(p)), repeat=i):
            prob, w, prod = Fraction(1), Fraction(1), Fraction(1)
            for x in seq:
                prob *= q[x]
                w = min(Fraction(1), w * p[x] / q[x])
                prod *= min(Fraction(1), p[x] / q[x])
            token += prob * prod
            block += prob * w
    return token, block


def test_expected_accepted_length_paper_example():
    """V = 2, p = (1/3, 2/3), q = (2/3, 1/3), γ = 2 (the paper's example): 10/9 and 11/9."""
    token, block = _expected_accepted([Fraction(1, 3), Fraction(2, 3)], [Fraction(2, 3), Fraction(1, 3)], 2)
    assert (token, block) == (Fraction(10, 9), Fraction(11, 9))


def _monte_carlo(p: torch.Tensor, q: torch.Tensor | None, gamma: int, acceptance: str, rows: int = 40_000,
                 seed: int = 0) -> float:
    """Mean accepted drafts of ``verify`` over context-free laws (``p``, ``q`` given as logits)."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(do_sample=True)
    if q is None:
        drafts = p.argmax().expand(rows, gamma).clone()
    else:
        q_law = torch.softmax(q, -1)
        drafts = sample(q_law.expand(rows, gamma, -1), torch.rand(rows, gamma, generator=gen, dtype=torch.float64))
    logits = p.expand(rows, gamma + 1, -1)
    probs = None if q is None else torch.softmax(q, -1).expand(rows, gamma, -1)
    uniforms = torch.rand(rows, gamma + 1, generator=gen, dtype=torch.float64)
    return float(verify(logits, drafts, probs, params, uniforms, acceptance=acceptance).num_accepted.double().mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1, 3])
def test_block_accepts_at_least_as_many_drafts(seed, gamma):
    """Exact expectations by enumeration (block ≥ token-wise, strictly for γ > 1 here), and the
    implementation's Monte-Carlo means within 5 standard errors of them."""
    gen = torch.Generator().manual_seed(seed)
    p_logits, q_logits = 1.5 * torch.randn(V, generator=gen), 1.5 * torch.randn(V, generator=gen)
    p = [Fraction(float(x)) for x in torch.softmax(p_logits.double(), -1)]
    q = [Fraction(float(x)) for x in torch.softmax(q_logits.double(), -1)]
    token, block = _expected_accepted(p, q, gamma)
    assert block >= token
    if gamma > 1:
        assert block > token
    margin = 5 * gamma / np.sqrt(40_000)  # n ∈ [0, γ]: its standard deviation is at most γ / 2
    for acceptance, exact in (("token", token), ("block", block)):
        mean = _monte_carlo(p_logits, q_logits, gamma, acceptance, seed=seed)
        assert abs(mean - float(exact)) < margin / 2, f"{acceptance}: {mean:.4f} vs exact {float(exact):.4f}"


def test_point_mass_drafts_are_accepted_as_often_as_token_wise():
    """With a one-hot ``q``, ``w_i = Π p(d_j)``: the number kept has step 4's law."""
    p_logits = torch.tensor([1.0, 0.5, -0.3, 0.2])
    token = _monte_carlo(p_logits, None, 3, "token", seed=3)
    block = _monte_carlo(p_logits, None, 3, "block", seed=4)
    prob = float(torch.softmax(p_logits, -1).max())
    assert abs(token - (prob + prob**2 + prob**3)) < 0.02 and abs(block - token) < 0.03


# ------------------------------------------------------------------------------ (d) shapes
class _NoHostReads:
    """Make every tensor-to-host read raise while active (``item``, ``tolist``, ``bool``, ...)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")

    def __enter__(self) -> None:
        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def refuse(*args, **kwargs):
            raise AssertionError("a tensor value was read on the host")

        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse)

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 5), gamma=st.integers(0, 5), vocab=st.integers(1, 40), seed=st.integers(0, 2**16),
       with_q=st.booleans(), do_sample=st.booleans(), top_k=st.integers(0, 5))
def test_shapes_and_counts(batch, gamma, vocab, seed, with_q, do_sample, top_k):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(batch, gamma + 1, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (batch, gamma), generator=gen)
    q = torch.softmax(torch.randn(batch, gamma, vocab, generator=gen), -1) if with_q else None
    params = SamplingParams(do_sample=do_sample, temperature=0.8, top_k=top_k)
    uniforms = torch.rand(batch, gamma + 1, generator=gen, dtype=torch.float64)
    with _NoHostReads():
        result = verify(logits, drafts, q, params, uniforms, acceptance="block", backend="reference")
    n, tokens = result.num_accepted, result.tokens
    assert n.shape == (batch,) and tokens.shape == (batch, gamma + 1)
    assert n.dtype == tokens.dtype == torch.long
    assert bool(((n >= 0) & (n <= gamma)).all())
    columns = torch.arange(gamma + 1)
    assert torch.equal(tokens[:, :gamma][columns[:gamma] < n[:, None]], drafts[columns[:gamma] < n[:, None]])
    assert bool((tokens[columns > n[:, None]] == -1).all())
    final = tokens.gather(1, n[:, None]).squeeze(1)
    p_final = probabilities(logits, params)[torch.arange(batch), n]
    assert bool((p_final.gather(1, final[:, None]) > 0).all())  # never a token the target excludes


def test_traceable_without_graph_breaks():
    """``torch.compile(fullgraph=True)`` traces the whole rule: nothing reads back to the host."""
    import torch._dynamo

    torch._dynamo.reset()
    params = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9)
    logits, drafts = torch.randn(3, 4, 11), torch.randint(0, 11, (3, 3))
    q, uniforms = torch.softmax(torch.randn(3, 3, 11), -1), torch.rand(3, 4, dtype=torch.float64)
    compiled = torch.compile(lambda *a: verify_module._verify_block(*a), fullgraph=True, backend="eager")
    for probs in (q, None):
        got = compiled(logits, drafts, probs, params, uniforms)
        want = verify(logits, drafts, probs, params, uniforms, acceptance="block")
        assert torch.equal(got.tokens, want.tokens)


# ------------------------------------------------------------------------------ Triton
def _triton_runs() -> bool:
    from flashspec.kernels import shim

    return shim.importable() and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


needs_triton = pytest.mark.skipif(not _triton_runs(), reason="needs Triton (CUDA, or TRITON_INTERPRET=1)")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("batch,gamma,vocab", [(1, 1, 7), (3, 4, 50), (4, 0, 30), (2, 3, 5003), (5, 2, 9000)])
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("params", [SamplingParams(do_sample=True, temperature=0.7),
                                    SamplingParams(do_sample=True, top_k=5, top_p=0.9), SamplingParams()],
                         ids=["t0.7", "topk-topp", "greedy"])
def test_triton_parity(batch, gamma, vocab, with_q, params):
    """The Triton backend asked for block verification gives the reference's counts and tokens:
    sampled, it runs the reference's block rule; greedy, the kernels' token rule, which the block
    rule reduces to (these seeded cases hold no decision within rounding of its boundary)."""
    gen = torch.Generator().manual_seed(batch * 100 + gamma * 10 + vocab)
    logits = 3 * torch.randn(batch, gamma + 1, vocab, generator=gen)
    uniforms = torch.rand(batch, gamma + 1, generator=gen, dtype=torch.float64)
    law = params if params.do_sample else SamplingParams(do_sample=True)
    if with_q:  # a drafter near the target: accepts and rejections
        q = probabilities(logits[:, :gamma] + 2 * torch.randn(batch, gamma, vocab, generator=gen), law)
        drafts = sample(q, torch.rand(batch, gamma, generator=gen, dtype=torch.float64))
    else:
        q, drafts = None, logits[:, :gamma].argmax(-1)
    want = verify(logits, drafts, q, params, uniforms, backend="reference", acceptance="block")
    on = [x.to(TRITON_DEVICE) if x is not None else None for x in (logits, drafts, q, uniforms)]
    got = verify(*on[:3], params, on[3], backend="triton", acceptance="block")
    assert torch.equal(got.num_accepted.cpu(), want.num_accepted)
    assert torch.equal(got.tokens.cpu(), want.tokens)


# ------------------------------------------------------------------------------ (e) errors
@pytest.mark.parametrize("bad", ["blocks", "Token", "", None, 1])
def test_bad_acceptance_is_a_clear_error(bad):
    logits, drafts = torch.randn(1, 2, 5), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="acceptance must be 'token'.*or 'block'"):
        verify(logits, drafts, None, SamplingParams(), acceptance=bad)
    with pytest.raises(ValueError, match="acceptance must be 'token'.*or 'block'"):
        SpeculativeEngine("no-such-model-is-loaded", [], acceptance=bad)


def test_cli_acceptance_flag(monkeypatch):
    """``flashspec generate --acceptance block`` reaches the engine; a bad value is refused."""
    import argparse

    from flashspec.cli import main
    from flashspec.cli.options import add_sampling
    from flashspec.tuning import auto

    parser = argparse.ArgumentParser()
    add_sampling(parser)
    assert parser.parse_args([]).acceptance == "token"
    with pytest.raises(SystemExit):
        parser.parse_args(["--acceptance", "blocks"])
    seen = {}

    def engine(target, drafts, **options):
        seen.update(options)
        raise ValueError("stop here")

    monkeypatch.setattr(auto, "calibrated_engine", engine)
    assert main(["generate", "--target", "t", "--prompt", "x", "--acceptance", "block"]) == 2
    assert seen["acceptance"] == "block"
