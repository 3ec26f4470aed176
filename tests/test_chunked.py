"""Chunked drafting (SPEC.md §2, "Chunked drafting"): a step's drafts drafted, scored and verified in
chunks of ``block_size``, drafting stopped at the first rejection.

* the chunk rule itself: token-wise verification of the chain, bit for bit against ``verify``; block
  verification of each chunk against a row-by-row reference, and its law by χ² on a toy model;
* the engine: greedy output equals ``model.generate`` (b = 1, b = γ, b not dividing γ; Llama,
  Qwen2 over the static cache, GPT-2 over transformers' cache); sampled output follows the target's
  law (χ², 10,000 samples, the joint laws of tokens 1–3 and 2–4, so that a step's second chunk is
  inside the window) and is the unchunked step's sample for the same seed; on a CPU no chunk is
  drafted or scored after every row stopped; Hypothesis over γ, b and the batch;
* clear errors for bad sizes and for the settings chunks do not combine with.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import test_block_verify as toy
import test_greedy as greedy
from stats_helpers import ALPHA, chi2_pvalue

from flashspec import Draft, SamplingParams, SpeculativeEngine
from flashspec.cli import main
from flashspec.decode import chunks
from flashspec.decode.chunks import ChunkTally, check_chunking, chunk_spans, verify_chunks
from flashspec.drafters.base import DraftsInChunks, autoregress, autoregress_chunks
from flashspec.verify import verify

SAMPLES = 10_000


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------ the chunks
def test_chunk_spans():
    assert chunk_spans(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_spans(4, 4) == [(0, 4)]
    assert chunk_spans(3, 5) == [(0, 3)]
    assert chunk_spans(4, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert not chunks.chunked(None, 4) and not chunks.chunked(4, 4) and chunks.chunked(3, 4)
    assert not chunks.chunked(2, 0)  # a target-only step has nothing to chunk


def _case(batch: int, k: int, vocab: int, seed: int, with_q: bool, agree: float = 0.7):
    """Logits of a chain, drafts that mostly follow their argmax (long accepted prefixes), their
    laws and uniforms."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(batch, k + 1, vocab, generator=gen)
    guess = torch.randint(0, vocab, (batch, k), generator=gen)
    drafts = torch.where(torch.rand(batch, k, generator=gen) < agree, logits[:, :k].argmax(-1), guess)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1) if with_q else None
    uniforms = torch.rand(batch, k + 1, generator=gen, dtype=torch.float64)
    return logits, drafts, q, uniforms


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 4), k=st.integers(1, 6), size=st.integers(1, 7), vocab=st.integers(2, 9),
       with_q=st.booleans(), do_sample=st.booleans(), top_k=st.sampled_from([0, 2]), seed=st.integers(0, 2**16))
@example(batch=1, k=1, size=1, vocab=2, with_q=True, do_sample=True, top_k=0, seed=0)
def test_chunks_are_token_wise_verification_of_the_chain(batch, k, size, vocab, with_q, do_sample, top_k, seed):
    """The token rule in chunks is ``verify`` on the whole chain, bit for bit (SPEC.md §2)."""
    logits, drafts, q, uniforms = _case(batch, k, vocab, seed, with_q)
    params = SamplingParams(do_sample=do_sample, temperature=0.8 if do_sample else 1.0, top_k=top_k)
    whole = verify(logits, drafts, q, params, uniforms)
    pieces = verify_chunks(logits, drafts, q, params, uniforms, size)
    assert torch.equal(whole.num_accepted, pieces.num_accepted)
    assert torch.equal(whole.tokens, pieces.tokens)


@pytest.mark.parametrize("do_sample", [False, True])
def test_rows_cross_every_chunk_boundary(do_sample):
    """The same on a large batch whose rows stop in every chunk and keep every draft: the equality
    above is not only that of rows that stop in the first chunk."""
    logits, drafts, q, uniforms = _case(2048, 5, 6, 1, with_q=do_sample, agree=0.9)
    params = SamplingParams(do_sample=do_sample, temperature=0.9)
    whole = verify(logits, drafts, q, params, uniforms)
    pieces = verify_chunks(logits, drafts, q, params, uniforms, 2)
    assert torch.equal(whole.tokens, pieces.tokens)
    assert set(pieces.num_accepted.tolist()) == set(range(6))


def _block_reference(logits, drafts, q, params, uniforms, size):
    """Each chunk a block of its own, row by row with Python control flow (SPEC.md §2): the first
    chunk a row does not keep whole ends it with that chunk's new token; a whole last chunk ends it
    with its bonus; a whole earlier chunk hands over to the next."""
    batch, k = drafts.shape
    accepted, tokens = [], torch.full((batch, k + 1), -1, dtype=torch.long)
    for b in range(batch):
        for begin, end in chunk_spans(k, size):
            one = verify(logits[b : b + 1, begin : end + 1], drafts[b : b + 1, begin:end],
                         None if q is None else q[b : b + 1, begin:end], params,
                         torch.cat([uniforms[b : b + 1, begin:end], uniforms[b : b + 1, k:]], 1), acceptance="block")
            kept = int(one.num_accepted[0])
            if kept < end - begin or end == k:
                n = begin + kept
                tokens[b, :n] = drafts[b, :n]
                tokens[b, n] = one.tokens[0, kept]
                accepted.append(n)
                break
    return torch.tensor(accepted), tokens


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 4), k=st.integers(1, 6), size=st.integers(1, 7), vocab=st.integers(2, 7),
       with_q=st.booleans(), seed=st.integers(0, 2**16))
@example(batch=1, k=1, size=1, vocab=2, with_q=True, seed=0)
def test_block_in_chunks_is_each_chunk_as_a_block(batch, k, size, vocab, with_q, seed):
    logits, drafts, q, uniforms = _case(batch, k, vocab, seed, with_q)
    params = SamplingParams(do_sample=True, temperature=0.9)
    pieces = verify_chunks(logits, drafts, q, params, uniforms, size, acceptance="block")
    accepted, tokens = _block_reference(logits, drafts, q, params, uniforms, size)
    assert torch.equal(pieces.num_accepted, accepted) and torch.equal(pieces.tokens, tokens)
    if size >= k:  # one chunk: the block rule itself
        whole = verify(logits, drafts, q, params, uniforms, acceptance="block")
        assert torch.equal(whole.tokens, pieces.tokens)


def _toy_step(drafter: str, params: SamplingParams, gamma: int, size: int, seed: int, acceptance: str = "block"):
    """test_block_verify's toy step (drafts from a toy drafter, the row completed by the toy target
    after the step) with the drafts verified in chunks of ``size``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(toy, "verify", lambda *args, acceptance, backend: verify_chunks(
            *args, size, acceptance=acceptance, backend=backend))
        return toy.one_block(drafter, params, gamma, toy.SAMPLES, seed, acceptance=acceptance)


TOY_CASES = [("other", 0.8, 3, 1.0, 4, 2), ("other", 1.2, 0, 0.95, 3, 1), ("noisy", 1.0, 0, 1.0, 4, 3),
             ("noisy", 0.8, 0, 0.9, 3, 1), ("self", 0.7, 0, 1.0, 4, 2), ("point", 1.0, 0, 1.0, 4, 2)]


@pytest.mark.parametrize("drafter,temperature,top_k,top_p,gamma,size", TOY_CASES)
def test_block_in_chunks_samples_the_exact_law(drafter, temperature, top_k, top_p, gamma, size):
    """Block verification of each chunk keeps the target's law: the χ² test of test_block_verify on
    the whole step's γ + 1 tokens, 20,000 rows of a toy model (V = 4)."""
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    accepted, _, out = _toy_step(drafter, params, gamma, size, seed=7 * gamma + size)
    pvalue = toy.chi_square(out, toy.exact_joint(params, gamma + 1))
    assert pvalue > ALPHA, f"χ² p-value {pvalue:.2e}: block verification in chunks changed the law"
    if drafter == "self":
        assert bool((accepted == gamma).all())
    else:
        assert float((accepted > size).float().mean()) > 0.005  # rows kept drafts of a later chunk
        assert 0 < accepted.float().mean() < gamma


def test_power_a_rejected_chunk_must_end_the_row(monkeypatch):
    """The χ² test above has power: rows that go on after rejecting a draft of a chunk (each chunk's
    block rule applied as if the chain went on) are rejected."""
    def take_without_stopping(self, result, begin, end):
        kept = result.num_accepted
        stops = self.live & ((kept < end - begin) | (end == self.k))
        self.new = torch.where(stops, result.tokens.gather(1, kept[:, None])[:, 0], self.new)
        self.accepted = torch.where(self.live, begin + kept, self.accepted)
        self.live = self.live & (end < self.k)  # wrong: a rejection does not end the row

    params = SamplingParams(do_sample=True, temperature=0.8, top_k=3)
    monkeypatch.setattr(ChunkTally, "take", take_without_stopping)
    _, _, out = _toy_step("other", params, 4, 2, seed=9)
    assert toy.chi_square(out, toy.exact_joint(params, 5)) < ALPHA


def test_autoregress_chunks_concatenate_to_autoregress():
    """The draft loop in chunks runs the same steps in the same order as in one piece, and feeds a
    chunk's last draft only when the next chunk is asked for."""
    weights = torch.randn(7, 7, generator=torch.Generator().manual_seed(0))
    fed: list[int] = []

    def step(token, i):
        fed.append(i)
        return weights[token]

    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    uniforms = torch.rand(3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for params in (SamplingParams(), SamplingParams(do_sample=True, temperature=0.8)):
        tokens, probs = autoregress(logits, step, 5, params, uniforms)
        fed.clear()
        pieces = autoregress_chunks(logits, step, 5, 2, params, uniforms)
        first = next(pieces)
        assert fed == [0] and first[0].shape == (3, 2)  # d_2 is not fed yet
        rest = list(pieces)
        assert fed == [0, 1, 2, 3]
        assert torch.equal(torch.cat([first[0]] + [r[0] for r in rest], 1), tokens)
        if probs is not None:
            assert torch.equal(torch.cat([first[1]] + [r[1] for r in rest], 1), probs)


# ------------------------------------------------------------------------------ greedy, through the engine
def _engine(arch: str, drafter: str, block_size: int | None, **options) -> SpeculativeEngine:
    target = greedy.target_model(arch)
    made = {"model": lambda: greedy.noisy_drafter(arch), "ngram": lambda: "ngram", "self": lambda: target,
            "feature": lambda: f"feature:{greedy.feature_checkpoint(arch)}",
            "early-exit": lambda: "early-exit:1"}[drafter]()
    return SpeculativeEngine(target, [made], device="cpu", selector="fixed", block_size=block_size, **options)


GREEDY_SHAPES = [(4, 1), (4, 4), (5, 2), (6, 4)]  # (γ, b): b = 1, b = γ, b not dividing γ


@pytest.mark.parametrize("gamma,size", GREEDY_SHAPES)
@pytest.mark.parametrize("drafter", ["model", "ngram", "self", "feature"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_chunked_equals_hf_generate(arch, drafter, gamma, size):
    if drafter == "feature" and arch == "gpt2":
        pytest.skip("feature drafters read the static cache's features (Llama, Qwen2, Qwen3, Mistral)")
    engine = _engine(arch, drafter, size)
    prompts = [list(p) for p in greedy.PROMPTS]
    out = engine.generate(prompts, max_new_tokens=greedy.NEW_TOKENS, num_draft_tokens=gamma, eos_token_id=[])
    expected = [greedy.hf_greedy(arch, p, greedy.NEW_TOKENS) for p in greedy.PROMPTS]
    greedy.assert_rows_equal(out.sequences, expected, f"{arch}/{drafter}/γ={gamma}/b={size}")
    greedy.check_drafter_stats(drafter, [out.stats])
    if drafter == "model":
        assert 0 < out.stats.acceptance_rate < 1  # rows stop inside chunks and go on past them


def test_compiled_forwards_in_chunks_equal_hf_generate():
    """``compile=True`` (the static cache's compiled decode forwards, at the chunks' widths) with
    chunks of 2 at γ = 5: the target's greedy output."""
    engine = _engine("llama", "model", 2, compile=True)
    out = engine.generate([list(p) for p in greedy.PROMPTS], max_new_tokens=greedy.NEW_TOKENS, num_draft_tokens=5,
                          eos_token_id=[])
    assert out.sequences == [greedy.hf_greedy("llama", p, greedy.NEW_TOKENS) for p in greedy.PROMPTS]
    assert 0 < out.stats.acceptance_rate < 1


@pytest.mark.parametrize("acceptance", ["token", "block"])
def test_greedy_with_eos_and_short_budgets(acceptance):
    """Rows that stop at an EOS or at their budget inside a chunked step (block acceptance too)."""
    arch = "llama"
    eos = greedy.pick_eos(arch, "mid")
    engine = _engine(arch, "self", 2, acceptance=acceptance)
    for budget in (1, 3, greedy.NEW_TOKENS):
        out = engine.generate([list(p) for p in greedy.PROMPTS], max_new_tokens=budget, num_draft_tokens=5,
                              eos_token_id=eos)
        expected = [greedy.hf_greedy(arch, p, greedy.NEW_TOKENS, eos)[:budget] for p in greedy.PROMPTS]
        greedy.assert_rows_equal(out.sequences, expected, f"eos={eos} budget={budget}")


# ------------------------------------------------------------------------------ drafting stops
class Scripted:
    """A drafter in chunks that knows the target's greedy continuation of one prompt: each step its
    first ``right`` drafts are the target's next tokens, the rest wrong. It counts the chunks the
    engine asked for."""

    name = "scripted"

    def __init__(self, prompt: list[int], continuation: list[int], right: int, vocab: int) -> None:
        self.text = prompt + continuation + [0] * 64
        self.right, self.vocab = right, vocab
        self.asked: list[int] = []

    def begin(self, batch_size: int) -> None:
        pass

    def _drafts(self, history, num_tokens: int) -> torch.Tensor:
        length = int(history.length[0])  # a host read: a test drafter on the CPU
        true = self.text[length : length + num_tokens]
        return torch.tensor([[t if i < self.right else (t + 1) % self.vocab for i, t in enumerate(true)]])

    def propose(self, history, num_tokens, params, uniforms):
        return Draft(self._drafts(history, num_tokens), None)

    def propose_chunks(self, history, num_tokens, chunk, params, uniforms):
        drafts = self._drafts(history, num_tokens)
        self.asked.append(0)
        for begin in range(0, num_tokens, chunk):
            self.asked[-1] += 1
            yield Draft(drafts[:, begin : begin + chunk], None)


@pytest.mark.parametrize("right,chunks_used", [(1, 1), (3, 2), (6, 3)])
def test_drafting_stops_at_the_first_rejection_on_a_cpu(right, chunks_used, monkeypatch):
    """γ = 6 in chunks of 2: with the first wrong draft in chunk c the CPU asks the drafter for c
    chunks and scores c; with every chunk run (CUDA's schedule, never reading the device) all 3 are,
    and the output is the same: the target's greedy continuation."""
    arch = "llama"
    prompt = list(greedy.PROMPTS[2])
    expected = greedy.hf_greedy(arch, tuple(prompt), greedy.NEW_TOKENS)
    script = greedy.hf_greedy(arch, tuple(prompt), greedy.NEW_TOKENS + 8)  # drafts past the budget are right too
    counts = {}
    for early in (True, False):
        monkeypatch.setattr(chunks, "stops_early", lambda device, early=early: early)
        drafter = Scripted(prompt, script, right, greedy.VOCAB)
        engine = SpeculativeEngine(greedy.target_model(arch), [drafter], device="cpu", selector="fixed", block_size=2)
        forwards = []
        original = engine.target_lm.forward
        monkeypatch.setattr(engine.target_lm, "forward", lambda *a, **k: forwards.append(1) or original(*a, **k))
        out = engine.generate([prompt], max_new_tokens=greedy.NEW_TOKENS, num_draft_tokens=6, eos_token_id=[])
        assert out.sequences == [expected]
        counts[early] = (drafter.asked, len(forwards), out.stats.steps)
    asked, scored, steps = counts[True]
    assert asked == [chunks_used] * steps and scored == chunks_used * steps
    asked, scored, steps = counts[False]
    assert asked == [3] * steps and scored == 3 * steps


def test_a_model_drafter_stops_drafting_at_the_first_rejected_chunk(monkeypatch):
    """A model drafter in chunks of 1, γ = 4, batch 1: a step that keeps ``n`` drafts asks it for
    ``min(n + 1, γ)`` chunks, so it runs its re-feed and ``min(n + 1, γ) − 1`` one-token forwards
    (an unchunked proposal always runs ``γ − 1``)."""
    arch = "llama"
    engine = _engine(arch, "model", 1)
    drafter = engine.drafters[0]
    calls = []
    original = drafter._lm.forward
    monkeypatch.setattr(drafter._lm, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    prompt = list(greedy.PROMPTS[3])
    out = engine.generate([prompt], max_new_tokens=greedy.NEW_TOKENS, num_draft_tokens=4, eos_token_id=[])
    assert out.sequences == [greedy.hf_greedy(arch, tuple(prompt), greedy.NEW_TOKENS)]
    kept = [record.accepted for record in out.stats.step_log]
    assert len(calls) == sum(min(n + 1, 4) for n in kept)
    assert len(calls) < 4 * len(kept)  # some step stopped early


# ------------------------------------------------------------------------------ the same sample
@pytest.mark.parametrize("drafter,gamma,size", [("model", 5, 2), ("model", 4, 1), ("feature", 5, 3),
                                                ("ngram", 4, 3), ("early-exit", 3, 2)])
def test_chunked_and_unchunked_steps_give_the_same_sample(drafter, gamma, size, monkeypatch):
    """Same seed, same random numbers, same decisions: the chunked step is the unchunked step
    computed in pieces (SPEC.md §2), here to the token on 240 sampled rows (float32: the forwards of
    different widths differ by ~1e-7, far from any boundary here), with the CPU's early stop and
    with every chunk run."""
    arch = "llama"
    prompts = [list(p) for p in greedy.PROMPTS] * 60
    options = dict(max_new_tokens=16, num_draft_tokens=gamma, eos_token_id=[], do_sample=True, temperature=0.9,
                   top_p=0.95, seed=11)
    base = _engine(arch, drafter, None).generate(prompts, **options)
    for early in (True, False):
        monkeypatch.setattr(chunks, "stops_early", lambda device, early=early: early)
        out = _engine(arch, drafter, size).generate(prompts, **options)
        assert out.sequences == base.sequences
        assert (out.stats.accepted, out.stats.proposed) == (base.stats.accepted, base.stats.proposed)
    assert 0 < base.stats.acceptance_rate < 1


@functools.lru_cache(maxsize=None)
def _cached_engine(drafter: str, size: int | None) -> SpeculativeEngine:
    return _engine("llama", drafter, size)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gamma=st.integers(1, 6), size=st.integers(1, 7), rows=st.integers(1, 4),
       drafter=st.sampled_from(["model", "ngram", "feature"]), do_sample=st.booleans(), seed=st.integers(0, 99))
@example(gamma=1, size=1, rows=1, drafter="model", do_sample=False, seed=0)
@example(gamma=1, size=1, rows=1, drafter="feature", do_sample=True, seed=1)
@example(gamma=5, size=2, rows=4, drafter="model", do_sample=True, seed=2)
def test_any_shape_gives_the_greedy_output_and_the_unchunked_sample(gamma, size, rows, drafter, do_sample, seed):
    """γ = 1 … 6, b = 1 … 7 (b ≥ γ: unchunked), batch 1 … 4: greedy output is the target's; sampled
    output is the unchunked engine's for the same seed."""
    prompts = [list(p) for p in greedy.PROMPTS[:rows]]
    options = dict(max_new_tokens=10, num_draft_tokens=gamma, eos_token_id=[], seed=seed, do_sample=do_sample,
                   temperature=0.8, top_k=20)
    out = _cached_engine(drafter, size).generate(prompts, **options)
    if do_sample:
        assert out.sequences == _cached_engine(drafter, None).generate(prompts, **options).sequences
    else:
        assert out.sequences == [greedy.hf_greedy("llama", tuple(p), greedy.NEW_TOKENS)[:10] for p in prompts]


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_an_eagle3_head_drafts_in_chunks(draft_vocab, tmp_path):
    """EAGLE-3 heads draft in chunks as feature drafters do (SPEC.md §2): greedy output is the
    target's, a sampled run the unchunked engine's for the same seed (a draft vocabulary too)."""
    import test_eagle3 as eagle

    folder = eagle.checkpoint("eagle3", draft_vocab, str(tmp_path))
    prompts = [list(p) for p in eagle.PROMPTS]
    engines = {size: SpeculativeEngine(eagle.target_model(), [f"eagle3:{folder}"], device="cpu", selector="fixed",
                                       block_size=size) for size in (2, None)}
    assert isinstance(engines[2].drafters[0], DraftsInChunks)
    out = engines[2].generate(prompts, max_new_tokens=eagle.NEW_TOKENS, num_draft_tokens=5)
    assert out.sequences == [eagle.hf_greedy(p) for p in eagle.PROMPTS]
    sampled = dict(max_new_tokens=eagle.NEW_TOKENS, num_draft_tokens=5, do_sample=True, temperature=0.9, seed=1)
    chunked = engines[2].generate(prompts * 20, **sampled)
    assert chunked.sequences == engines[None].generate(prompts * 20, **sampled).sequences
    assert chunked.stats.accepted > 0


def test_running_batch_with_chunks():
    """A running batch (SPEC.md §12) drafts in chunks too: its greedy row equals ``generate``'s,
    its sampled row equals the same batch's without chunks (each row its own generator)."""
    arch = "llama"
    prompt = list(greedy.PROMPTS[3])
    results = {}
    for size in (2, None):
        engine = _engine(arch, "model", size)
        with engine.batch(slots=2, max_length=64, num_draft_tokens=5, eos_token_id=[]) as batch:
            first = batch.add(prompt, max_new_tokens=12)
            second = batch.add(prompt, max_new_tokens=12, do_sample=True, temperature=0.8, seed=3)
            tokens = {first: [], second: []}
            while batch.free_slots < 2:
                for update in batch.step():
                    tokens[update.handle].extend(update.tokens)
        results[size] = tokens[first], tokens[second]
    assert results[2][0] == greedy.hf_greedy(arch, tuple(prompt), greedy.NEW_TOKENS)[:12]
    assert results[2] == results[None]


# ------------------------------------------------------------------------------ the law, through the engine
@functools.lru_cache(maxsize=None)
def exact_law4(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """P(x1, x2, x3, x4) of test_distribution's tiny target after its prompt, ``[V] * 4``, by
    enumeration with transformers' warpers."""
    import test_distribution as dist

    v = dist.V
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    triples = torch.tensor(list(itertools.product(range(v), repeat=3)))  # x1 slowest
    ids = torch.cat([torch.tensor(dist.PROMPT).expand(len(triples), -1), triples], dim=1)
    with torch.no_grad():
        logits = dist.TARGET(ids).logits[:, -4:].float()

    def law(z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(warpers(None, z), dim=-1).double()

    p1 = law(logits[:1, 0])[0]
    p2 = law(logits[:, 1]).view(v, v, v, v)[:, 0, 0]  # [x1, x2]
    p3 = law(logits[:, 2]).view(v, v, v, v)[:, :, 0]  # [x1, x2, x3]
    p4 = law(logits[:, 3]).view(v, v, v, v)  # [x1, x2, x3, x4]
    return (p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p4).numpy()


def _sample(drafter: str, temperature: float, top_k: int, top_p: float, gamma: int, size: int,
            acceptance: str = "token", seed: int = 2024):
    import test_distribution as dist

    made = dist.DRAFTERS[drafter]()
    engine = SpeculativeEngine(dist.TARGET, [made], selector="fixed", acceptance=acceptance, block_size=size)
    out = engine.generate([dist.PROMPT] * SAMPLES, max_new_tokens=5, do_sample=True, temperature=temperature,
                          top_k=top_k, top_p=top_p, num_draft_tokens=gamma, eos_token_id=[], seed=seed)
    assert all(len(s) == 5 for s in out.sequences)
    return np.array([s[:4] for s in out.sequences]), out.stats


def _pvalues(samples: np.ndarray, law: np.ndarray) -> tuple[float, float]:
    """χ² p-values of the joint laws of tokens 1–3 and of tokens 2–4."""
    result = []
    for window, marginal in ((samples[:, :3], law.sum(axis=3)), (samples[:, 1:], law.sum(axis=0))):
        observed = np.bincount(np.ravel_multi_index(window.T, marginal.shape), minlength=marginal.size)
        result.append(chi2_pvalue(observed, marginal.ravel()))
    return result[0], result[1]


LAW_CASES = [
    ("noisy", 0.7, 4, 0.9, 5, 2, "token"),  # p != q, b not dividing γ
    ("independent", 1.3, 5, 1.0, 4, 3, "token"),  # many rejections
    ("self", 0.6, 0, 0.8, 3, 1, "token"),  # drafter == target: zero-mass residuals
    ("ngram", 0.9, 6, 1.0, 4, 1, "token"),  # proposed at once, verified in chunks (one-hot q)
    ("feature", 0.8, 0, 0.9, 4, 2, "token"),  # drafts in chunks, reads the target's features
    ("early-exit", 0.7, 4, 0.9, 3, 2, "token"),  # drafts inside the target's cache
    ("noisy", 0.8, 0, 0.9, 4, 2, "block"),  # each chunk a block of its own
]


@pytest.mark.parametrize("drafter,temperature,top_k,top_p,gamma,size,acceptance", LAW_CASES)
def test_chunked_samples_the_exact_target_law(drafter, temperature, top_k, top_p, gamma, size, acceptance):
    samples, stats = _sample(drafter, temperature, top_k, top_p, gamma, size, acceptance)
    first, second = _pvalues(samples, exact_law4(temperature, top_k, top_p))
    assert first > ALPHA and second > ALPHA, f"χ² p-values {first:.2e} (tokens 1-3), {second:.2e} (2-4)"
    if drafter == "self":
        assert stats.acceptance_rate > 0.99
    else:
        assert 0 < stats.acceptance_rate < 1


def test_power_a_chunk_tested_against_the_wrong_laws_fails(monkeypatch):
    """The engine's χ² test sees a later chunk: testing a chunk's first draft against the law after
    it (the carried law dropped) is rejected on tokens 2–4 (the first step's second chunk, b = 2)."""
    monkeypatch.setattr(chunks, "chunk_laws", lambda carry, fresh: torch.cat([fresh[:, :1], fresh], dim=1))
    samples, _ = _sample("noisy", 0.7, 4, 0.9, 5, 2)
    _, second = _pvalues(samples, exact_law4(0.7, 4, 0.9))
    assert second < ALPHA


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("value", [0, -1, 65, True, False, 2.0, "2", [2]])
def test_bad_block_size_is_a_clear_error(value):
    with pytest.raises(ValueError, match="block_size"):
        SpeculativeEngine(greedy.target_model("llama"), ["ngram"], device="cpu", block_size=value)


@pytest.mark.parametrize("value", [None, 1, 64, np.int64(3)])
def test_good_block_sizes(value):
    engine = SpeculativeEngine(greedy.target_model("llama"), ["ngram"], device="cpu", block_size=value)
    assert engine.block_size == (None if value is None else int(value))


def test_refused_combinations_are_clear_errors():
    import test_distribution as dist

    engine = _engine("llama", "ngram", 2)
    with pytest.raises(ValueError, match="block_size=None"):
        engine.generate_tree([[1, 2, 3]], max_new_tokens=4)
    with pytest.raises(ValueError, match="reuse_shallow"):
        SpeculativeEngine(dist.TARGET, [f"shallow:{dist.SHALLOW}"], reuse_shallow=True, block_size=2)
    with pytest.raises(ValueError, match="tensor-parallel"):
        check_chunking(2, tensor_parallel=object())
    assert check_chunking(None, tensor_parallel=object(), reuse_shallow=True) is None


class _Broken(Scripted):
    """A drafter in chunks that breaks the protocol: too few chunks, or laws with some chunks only."""

    def __init__(self, fault: str) -> None:
        super().__init__([], [], 0, greedy.VOCAB)
        self.fault = fault

    def propose_chunks(self, history, num_tokens, chunk, params, uniforms):
        first = torch.zeros(history.length.shape[0], chunk, dtype=torch.long)
        yield Draft(first, torch.full((*first.shape, self.vocab), 1.0 / self.vocab))
        if self.fault == "laws":
            yield Draft(torch.zeros(first.shape[0], num_tokens - chunk, dtype=torch.long), None)


@pytest.mark.parametrize("fault,message", [("short", "every chunk"), ("laws", "some chunks")])
def test_a_drafter_breaking_the_chunk_protocol_is_a_clear_error(fault, message, monkeypatch):
    monkeypatch.setattr(chunks, "stops_early", lambda device: False)  # every chunk is asked for
    engine = SpeculativeEngine(greedy.target_model("llama"), [_Broken(fault)], device="cpu", selector="fixed",
                               block_size=2)
    with pytest.raises(ValueError, match=message):
        engine.generate([[1, 2, 3]], max_new_tokens=6, num_draft_tokens=4, do_sample=True, seed=0)


@pytest.mark.parametrize("command", [["generate", "--target", "/nonexistent/model.gguf", "--prompt", "x"],
                                     ["bench", "acceptance", "--target", "/nonexistent", "--draft", "ngram"]])
@pytest.mark.parametrize("value", ["0", "65"])
def test_bad_block_size_flags_are_checked_before_any_model_loads(command, value, capsys):
    assert main([*command, "--block-size", value]) == 2
    err = capsys.readouterr().err
    assert "block" in err and "does not exist" not in err
