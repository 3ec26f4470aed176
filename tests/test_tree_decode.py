"""Decoding with one draft tree per step made of several drafters' chains and top-k expansions
(``SpeculativeEngine.generate_tree``, flashspec/decode/tree_loop.py, tree_build.py; SPEC.md §7, "Draft
trees in the decode loop", "Top-k expansion of a feature drafter"): greedy output equals the target's
own greedy output, sampled output follows the target's exact law (χ², SPEC.md §6), a wrong tree rule
is caught, the per-drafter statistics are the full information they claim, a step reads the device
once, and bad input is a clear error."""

from __future__ import annotations

import functools
import itertools
import tempfile

import numpy as np
import pytest
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from stats_helpers import ALPHA, chi2_pvalue
from test_tree_expansion import READS, eagle3_head
from tiny_models import ARCHITECTURES, noisy_copy, tiny_model

import flashspec
from flashspec.decode import tree_loop
from flashspec import FeatureDrafter, FeatureHead, ShallowHead, TreeExpansion
from flashspec.draft_tree import DraftTree, tree_from_chains
from flashspec.drafters.checkpoint import save_drafter
from flashspec.drafters.eagle3 import Eagle3Drafter
from flashspec.drafters.expansion import candidates
from flashspec.drafters.model import ModelDrafter
from flashspec.drafters.ngram import NgramDrafter
from flashspec.models.static import StaticLM

VOCAB = 128
NEW = 16
PAD = 7
ARCHS = [a for a in ARCHITECTURES if a in StaticLM.ARCHITECTURES]
PROMPTS = ((11,), (5, 9, 17), (3, 8, 3, 8, 3, 8, 3))  # ragged; repeats give the n-gram drafter matches
KINDS = ("ngram", "noisy", "self")
THREADS = torch.get_num_threads()  # the default: batches of 10,000 rows do gain from several threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads on a busy 2-core machine (as test_greedy.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------- greedy
@functools.cache
def target_model(arch: str):
    return tiny_model(arch, seed=ARCHITECTURES.index(arch), vocab_size=VOCAB)


@functools.cache
def noisy_model(arch: str):
    return noisy_copy(target_model(arch), 0.05, seed=1000 + ARCHITECTURES.index(arch))


def drafter(arch: str, kind: str):
    """A drafter of the engine: the n-gram lookup, a noisy copy of the target, or the target itself."""
    return {"ngram": lambda: "ngram", "noisy": lambda: noisy_model(arch), "self": lambda: target_model(arch)}[kind]()


@functools.cache
def engine(arch: str, kinds: tuple[str, ...] = KINDS) -> flashspec.SpeculativeEngine:
    return flashspec.SpeculativeEngine(target_model(arch), [drafter(arch, k) for k in kinds], device="cpu")


@functools.cache
def hf_greedy(arch: str, prompt: tuple[int, ...], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """``generate(do_sample=False)`` on the prompt alone: its new tokens, through the first EOS."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = target_model(arch).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                          do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


@pytest.mark.parametrize("layout", ["alone", "ragged"])
@pytest.mark.parametrize("gammas", [(1, 1, 1), (3, 2, 4), (4, 4, 4)])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate(arch, gammas, layout):
    """Drafters [n-gram, noisy copy, the target itself], batch 1 (each prompt alone) and a ragged
    batch of 3: every row is the target's own greedy continuation."""
    e = engine(arch)
    if layout == "alone":
        outs = [e.generate_tree([list(p)], max_new_tokens=NEW, gammas=list(gammas)) for p in PROMPTS]
        got, stats = [o.sequences[0] for o in outs], [o.stats for o in outs]
    else:
        out = e.generate_tree([list(p) for p in PROMPTS], max_new_tokens=NEW, gammas=list(gammas))
        got, stats = out.sequences, [out.stats]
    assert got == [hf_greedy(arch, p, NEW) for p in PROMPTS]
    assert sum(s.new_tokens for s in stats) == len(PROMPTS) * NEW
    self_name = e.drafters[2].name
    self_stats = [s.per_drafter[self_name] for s in stats]
    # The target as a drafter: its chain is the target's greedy continuation, so every step commits
    # all of it but where a budget cut the step short.
    assert sum(s.accepted for s in self_stats) >= 0.8 * sum(s.proposed for s in self_stats)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_eos_stops_rows_early(arch):
    """An EOS id that the target produces mid-way in some rows: those rows end with it, exactly where
    ``generate`` ends them; the others run to the budget."""
    eos = hf_greedy(arch, PROMPTS[1], NEW)[4]
    out = engine(arch).generate_tree([list(p) for p in PROMPTS], max_new_tokens=NEW, gammas=[3, 2, 4],
                                     eos_token_id=eos)
    expected = [hf_greedy(arch, p, NEW, eos) for p in PROMPTS]
    assert out.sequences == expected
    assert any(len(s) < NEW and s[-1] == eos for s in out.sequences)


def test_padded_tensor_prompts_are_accepted_as_generate_accepts_them():
    """A left-padded ``[B, L]`` tensor with its attention mask gives the ragged rows' output."""
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), PAD)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(PROMPTS):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
    out = engine("llama").generate_tree(ids, attention_mask=mask, max_new_tokens=NEW, gammas=[2, 3, 1])
    assert out.sequences == [hf_greedy("llama", p, NEW) for p in PROMPTS]


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True),
       gammas=st.lists(st.integers(1, 4), min_size=3, max_size=3), max_new_tokens=st.integers(1, 12),
       seed=st.integers(0, 2**16))
def test_any_shape_gives_the_greedy_output(batch, kinds, gammas, max_new_tokens, seed):
    """Hypothesis over batch (1–3), drafters (1–3 of n-gram, noisy copy, the target, in any order),
    γ per drafter (1–4) and max_new_tokens (1–12), on ragged random prompts: every row is ``generate``'s
    greedy output, of exactly ``max_new_tokens`` tokens (no EOS)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(0, VOCAB, (int(n),), generator=generator).tolist())
               for n in torch.randint(1, 9, (batch,), generator=generator)]
    out = engine("llama", tuple(kinds)).generate_tree([list(p) for p in prompts], max_new_tokens=max_new_tokens,
                                                      gammas=gammas[: len(kinds)])
    assert out.sequences == [hf_greedy("llama", p, 12)[:max_new_tokens] for p in prompts]
    assert all(len(s) == max_new_tokens for s in out.sequences)
    assert out.stats.steps <= max_new_tokens - 1


def test_default_gammas_are_the_engines():
    """Without ``gammas`` each drafter drafts its arms' largest γ (``num_draft_tokens`` for arms
    without one of their own)."""
    target = target_model("llama")
    plain = flashspec.SpeculativeEngine(target, ["ngram"], device="cpu").generate_tree(
        [[1, 2, 1, 2]], max_new_tokens=8, num_draft_tokens=3)
    assert plain.stats.per_drafter["ngram"].proposed == 3 * plain.stats.steps
    armed = flashspec.SpeculativeEngine(target, ["ngram"], gammas=[2, 5], device="cpu").generate_tree(
        [[1, 2, 1, 2]], max_new_tokens=8)
    assert armed.stats.per_drafter["ngram"].proposed == 5 * armed.stats.steps
    assert armed.sequences == plain.sequences == [hf_greedy("llama", (1, 2, 1, 2), 8)]


# ---------------------------------------------------------------------------------- feature drafters
@functools.cache
def head_folder(model: transformers.PreTrainedModel, taps: tuple[int, ...] | None = None, kind: str = "feature") -> str:
    """An untrained (mostly rejected) head for ``model`` saved as a checkpoint: a feature head, with
    ``taps`` fused, or a shallow one; loads as ``"{kind}:FOLDER"``."""
    folder = tempfile.mkdtemp(prefix=f"tree-{kind}-")
    torch.manual_seed(0)
    head = FeatureHead(model.config, 1, taps=taps) if kind == "feature" else ShallowHead(model.config, 1, 1)
    save_drafter(head, model, folder)
    return folder


# (arch, taps): the last layer's feature, and fused taps (both layers' outputs: two buffers at once)
FEATURE_HEADS = [("llama", None), ("qwen2", (0, 1))]


@functools.cache
def feature_engine(arch: str, taps: tuple[int, ...] | None) -> flashspec.SpeculativeEngine:
    """Drafters [a feature head over the target's features, n-gram, the target itself]."""
    spec = f"feature:{head_folder(target_model(arch), taps)}"
    return flashspec.SpeculativeEngine(target_model(arch), [spec, "ngram", target_model(arch)], device="cpu")


@pytest.mark.parametrize("layout", ["alone", "ragged"])
@pytest.mark.parametrize("gammas", [[1, 1, 1], [3, 2, 4], "auto"])
@pytest.mark.parametrize("arch, taps", FEATURE_HEADS)
def test_greedy_with_a_feature_drafter_equals_hf_generate(arch, taps, gammas, layout):
    """A drafter that reads the target's features (last layer, or fused taps) beside the n-gram and
    the target itself, fixed γ (also 1) and ``gammas="auto"``, batch 1 and a ragged batch of 3: every
    row is the target's own greedy continuation, and the feature drafter proposed at every step it
    ran (its catch-up read the features the tree steps wrote)."""
    e = feature_engine(arch, taps)
    e.tree_budget = None  # "auto" learns across calls: start each case afresh
    if layout == "alone":
        outs = [e.generate_tree([list(p)], max_new_tokens=NEW, gammas=gammas) for p in PROMPTS]
        got, stats = [o.sequences[0] for o in outs], [o.stats for o in outs]
    else:
        out = e.generate_tree([list(p) for p in PROMPTS], max_new_tokens=NEW, gammas=gammas)
        got, stats = out.sequences, [out.stats]
    assert got == [hf_greedy(arch, p, NEW) for p in PROMPTS]
    assert sum(s.new_tokens for s in stats) == len(PROMPTS) * NEW
    if gammas != "auto":
        assert all(s.per_drafter[e.drafters[0].name].steps == s.steps for s in stats)


def test_a_feature_drafter_reads_a_chain_forwards_features_at_every_committed_position(monkeypatch):
    """At every proposal of a fused-taps feature drafter in tree steps (ragged batch, branches of other
    drafters committed too), the feature buffers hold, at every committed position but the pending one,
    what a chain forward of the row's committed tokens writes: the root's from the tree forward, the
    kept nodes' from the commit."""
    seen = []
    propose = FeatureDrafter.propose

    def recording(self, history, num_tokens, params, uniforms):
        seen.append((history.tokens.clone(), history.length.clone(), history.active.clone(),
                     {n: h.clone() for n, h in history.hidden.items()}))
        return propose(self, history, num_tokens, params, uniforms)

    monkeypatch.setattr(FeatureDrafter, "propose", recording)
    arch, taps = FEATURE_HEADS[1]
    e = feature_engine(arch, taps)
    out = e.generate_tree([list(p) for p in PROMPTS], max_new_tokens=NEW, gammas=[2, 3, 4])
    assert out.sequences == [hf_greedy(arch, p, NEW) for p in PROMPTS]
    assert len(seen) == out.stats.steps and out.stats.accepted > 0
    chain = StaticLM(target_model(arch))
    for tokens, length, active, hidden in seen:
        for b in range(len(PROMPTS)):
            n = int(length[b]) - 1
            if not active[b] or n == 0:
                continue
            chain.reset(1, tokens.shape[1])
            buffers = {k: torch.zeros_like(h[:1]) for k, h in hidden.items()}
            chain.forward(tokens[b : b + 1, :n], torch.zeros(1, dtype=torch.long), hidden_out=buffers)
            for k in hidden:
                torch.testing.assert_close(hidden[k][b, :n], buffers[k][0, :n], atol=5e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- full information
class Recording:
    """A drafter that records, at each proposal, the rows' lengths, which rows were active, and its chain."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.log = inner, inner.name, []

    def begin(self, batch_size: int) -> None:
        self.inner.begin(batch_size)
        self.log = []

    def propose(self, history, num_tokens, params, uniforms):
        draft = self.inner.propose(history, num_tokens, params, uniforms)
        self.log.append((history.length.clone(), history.active.clone(), draft.tokens.clone()))
        return draft


def committed_per_step(recorder: Recording, prompts, sequences) -> list[list[list[int] | None]]:
    """Per step recorded, per row: the tokens it committed in that step (None: it was not active),
    read from the final rows."""
    rows = [list(p) + s for p, s in zip(prompts, sequences)]
    ends = [entry[0] for entry in recorder.log[1:]] + [torch.tensor([len(r) for r in rows])]
    return [[row[int(length[b]) : int(end[b])] if active[b] else None for b, row in enumerate(rows)]
            for (length, active, _), end in zip(recorder.log, ends)]


def brute_force_counts(recorder: Recording, committed) -> list[int]:
    """Per step, summed over the rows active in it: the longest prefix of the recorded chain equal to
    the tokens the row committed in that step."""
    counts = []
    for (_, _, chain), step in zip(recorder.log, committed):
        counts.append(sum(next((i for i, (x, y) in enumerate(zip(chain[b].tolist(), c)) if x != y),
                               min(chain.shape[1], len(c))) for b, c in enumerate(step) if c is not None))
    return counts


@pytest.mark.parametrize("eos", [False, True])
def test_per_drafter_counts_are_each_drafters_would_be_accepted_length(eos):
    """Greedy: each drafter's ``accepted`` equals a brute-force recomputation from its chain at every
    step and the tokens committed in that step (also where an EOS cuts a step short); at the first
    step (the same committed state) it equals what that drafter alone, as a fixed chain arm, had
    accepted. The target as a drafter, with a shorter chain than the others, has its whole chain
    committed at every step (up to the step's length): its cache caught up on the tokens that came
    from the other branches (SPEC.md §4, catch-up windows)."""
    arch, gammas = "llama", [3, 4, 2]
    eos_id = hf_greedy(arch, PROMPTS[1], 24)[9] if eos else None
    inner = [NgramDrafter(), ModelDrafter(noisy_model(arch), VOCAB, name="noisy"),
             ModelDrafter(target_model(arch), VOCAB, name="self")]
    recorders = [Recording(d) for d in inner]
    e = flashspec.SpeculativeEngine(target_model(arch), recorders, device="cpu")
    prompts = [list(p) for p in PROMPTS]
    out = e.generate_tree(prompts, max_new_tokens=24, gammas=gammas, eos_token_id=eos_id)
    assert out.sequences == [hf_greedy(arch, p, 24, eos_id) for p in PROMPTS]
    committed = committed_per_step(recorders[0], prompts, out.sequences)
    for recorder, d, g in zip(recorders, inner, gammas):
        counts = brute_force_counts(recorder, committed)
        stats = out.stats.per_drafter[d.name]
        assert stats.accepted == sum(counts)
        assert stats.steps == out.stats.steps == len(recorder.log)
        assert stats.proposed == g * sum(int(active.sum()) for _, active, _ in recorder.log)
        if not eos:  # alone, from the same state: the first step's chain is the same
            alone = flashspec.SpeculativeEngine(target_model(arch), [d], selector="fixed", device="cpu")
            first = alone.generate(prompts, max_new_tokens=24, num_draft_tokens=g)
            assert first.stats.step_log[0].accepted == counts[0]
    assert counts == [sum(min(gammas[2], len(c)) for c in step if c is not None) for step in committed]
    assert any(len(c) > gammas[2] + 1 for step in committed for c in step if c)  # other branches went further
    assert 0 < out.stats.per_drafter["noisy"].accepted < out.stats.per_drafter["noisy"].proposed


# ---------------------------------------------------------------------------------- the law
V = 8
SAMPLES = 10_000  # SPEC.md §6's minimum: a tree step over 20,000 rows costs twice as much
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so the n-gram drafter finds matches


def tiny_llama(seed: int) -> transformers.LlamaForCausalLM:
    """As tests/test_distribution.py's: V = 8, peaked laws."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


TARGET = tiny_llama(0)
RIGHT_RULE = tree_loop.sampled_tree
NOISY = noisy_copy(TARGET, 0.3, seed=7)  # p != q, often accepted
INDEPENDENT = tiny_llama(99)  # p and q unrelated: many rejections


def exact_law(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """P(x1, x2, x3) of the target's first three tokens, ``[V, V, V]``, by enumeration with
    transformers' own warpers."""
    warpers = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = TARGET(ids).logits[:, -3:].float()

    def law(z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(warpers(None, z), dim=-1).double()

    joint = law(logits[:1, 0])[0][:, None, None] * law(logits[:, 1]).view(V, V, V)[:, 0][:, :, None] \
        * law(logits[:, 2]).view(V, V, V)
    return joint.numpy()


def pvalue(out, law: np.ndarray) -> float:
    samples = np.array([s[:3] for s in out.sequences])
    observed = np.bincount(np.ravel_multi_index(samples.T, law.shape), minlength=law.size)
    return chi2_pvalue(observed, law.ravel())


def sample(drafters, gammas, temperature, top_k, top_p, seed=1234, samples=SAMPLES, expand_first=None):
    """``samples`` continuations of PROMPT, generated as one batch, with the default thread count;
    ``expand_first``: the first drafter's expansion. ``gammas="auto"`` runs unguarded: two steps of
    10,000 rows would otherwise both wait for the guard's first target-only step."""
    e = flashspec.SpeculativeEngine(TARGET, drafters, device="cpu")
    expand = None if expand_first is None else {e.drafters[0].name: expand_first}
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        out = e.generate_tree([PROMPT] * samples, max_new_tokens=3, gammas=gammas, do_sample=True,
                              temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=[], seed=seed,
                              expand=expand, **({"slack": None} if gammas == "auto" else {}))
    finally:
        torch.set_num_threads(before)
    assert all(len(s) == 3 for s in out.sequences)
    return out


CASES = {
    # a point-mass branch (n-gram: no q), a drawn one with p != q and one drawn from the target itself
    # (zero-mass residuals), of different depths, in one tree; top-k and top-p on
    "ngram+noisy+self": (["ngram", NOISY, TARGET], [2, 2, 1], 0.7, 5, 0.9),
    # two branches drawn from one peaked law unlike the target's: they often hold the same token, which
    # the second branch offers again against the residual (drawn siblings are never merged)
    "independent x2": ([INDEPENDENT, INDEPENDENT], [2, 2], 0.5, 4, 1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tree_decoding_follows_the_target_law(case):
    drafters, gammas, temperature, top_k, top_p = CASES[case]
    out = sample(drafters, gammas, temperature, top_k, top_p)
    p = pvalue(out, exact_law(temperature, top_k, top_p))
    assert p > ALPHA, f"χ² p-value {p:.2e}: the output law differs from the target's"
    per = out.stats.per_drafter
    assert sum(s.accepted for s in per.values()) == out.stats.accepted  # branches are disjoint
    assert all(s.accepted > 0 for s in per.values())  # every branch was kept somewhere
    assert 0 < out.stats.acceptance_rate < 1


def test_sampled_tree_decoding_with_a_feature_drafter_follows_the_target_law():
    """χ² as above: a feature head's drawn branch (its laws ``q`` over the target's features, which
    the tree steps wrote) beside a noisy copy's, at T = 0.7 with top-k and top-p."""
    temperature, top_k, top_p = 0.7, 5, 0.9
    out = sample([f"feature:{head_folder(TARGET)}", NOISY], [2, 2], temperature, top_k, top_p)
    p = pvalue(out, exact_law(temperature, top_k, top_p))
    assert p > ALPHA, f"χ² p-value {p:.2e}: the output law differs from the target's"
    per = out.stats.per_drafter
    assert sum(s.accepted for s in per.values()) == out.stats.accepted
    assert all(s.accepted > 0 for s in per.values())
    assert 0 < out.stats.acceptance_rate < 1


def drawn_siblings_merged(chains, laws):
    """Wrong: equal drawn siblings merged into one node, as equal chosen ones may be."""
    tree = tree_from_chains(torch.stack(chains, dim=1))
    drawn = torch.ones_like(tree.tokens, dtype=torch.bool)
    return DraftTree(tree.tokens, tree.parents, torch.cat(laws, dim=1), drawn, tree.present)


def chosen_tested_as_drawn(chains, laws):
    """Wrong: chosen tokens (each law's most likely token, as a top-k expansion picks them) tested as
    if drawn from the law (``u·q(x) < p(x)``); chosen tokens are exact only as point masses."""
    return RIGHT_RULE([q.argmax(dim=-1) for q in laws], laws)


@pytest.mark.parametrize("wrong, samples", [(drawn_siblings_merged, SAMPLES), (chosen_tested_as_drawn, 4_000)])
def test_a_wrong_tree_rule_fails_the_test(wrong, samples, monkeypatch):
    """The χ² test has power: the run of "independent x2" with a wrong tree construction is rejected
    (the second bias is so large that 4,000 samples show it). Testing drawn tokens as point masses
    would not be wrong: a point mass is exact whatever chose its token (SPEC.md §2)."""
    monkeypatch.setattr(tree_loop, "sampled_tree", wrong)
    drafters, gammas, temperature, top_k, top_p = CASES["independent x2"]
    out = sample(drafters, gammas, temperature, top_k, top_p, samples=samples)
    assert pvalue(out, exact_law(temperature, top_k, top_p)) < ALPHA


def test_a_seed_fixes_the_sample():
    e = flashspec.SpeculativeEngine(TARGET, ["ngram", NOISY], device="cpu")
    runs = [e.generate_tree([PROMPT] * 4, max_new_tokens=8, gammas=[2, 3], do_sample=True, temperature=0.9, seed=s)
            for s in (5, 5, 6)]
    assert runs[0].sequences == runs[1].sequences != runs[2].sequences


# ---------------------------------------------------------------------------------- errors
def test_bad_input_is_a_clear_error():
    target = target_model("llama")
    for spec in ("early-exit:1", f"shallow:{head_folder(target, kind='shallow')}"):  # they share the target's cache
        name = flashspec.SpeculativeEngine(target, [spec], device="cpu").drafters[0].name
        with pytest.raises(ValueError, match=f"'{name}'.*target's own cache"):
            flashspec.SpeculativeEngine(target, ["ngram", spec], device="cpu").generate_tree([[1, 2]])
    accepted = flashspec.SpeculativeEngine(target, ["ngram", f"feature:{head_folder(target)}"], device="cpu")
    assert accepted.generate_tree([[1, 2]], max_new_tokens=4).sequences == [hf_greedy("llama", (1, 2), 4)]
    e = engine("llama", ("ngram",))
    with pytest.raises(ValueError, match=r"gammas\[0\].*from 1 to 64; got 0"):
        e.generate_tree([[1, 2]], gammas=[0])
    with pytest.raises(ValueError, match="one draft length per drafter"):
        e.generate_tree([[1, 2]], gammas=[2, 3])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        e.generate_tree([[1, 2]], num_draft_tokens=0)
    with pytest.raises(ValueError, match="at least one drafter"):
        flashspec.SpeculativeEngine(target, [], device="cpu").generate_tree([[1, 2]])
    with pytest.raises(ValueError, match="architecture"):
        flashspec.SpeculativeEngine(tiny_model("gpt2", vocab_size=VOCAB), ["ngram"], device="cpu").generate_tree([[1]])
    assert e.generate_tree([[1, 2], [3]], max_new_tokens=0).sequences == [[], []]


# ---------------------------------------------------------------------------------- top-k expansion
@functools.cache
def copy_head_folder(model: transformers.PreTrainedModel) -> str:
    """A feature head whose draft law is the target's: ``fc`` passes the token's embedding through (the
    feature times 0), then copies of the target's decoder layers; saved unquantised."""
    folder = tempfile.mkdtemp(prefix="tree-copy-")
    hidden = model.config.hidden_size
    head = FeatureHead(model.config, model.config.num_hidden_layers)
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1))
        head.fc.bias.zero_()
        for mine, theirs in zip(head.layers, model.model.layers):
            mine.load_state_dict(theirs.state_dict())
    save_drafter(head, model, folder, storage="same")
    return folder


# the expanded head: a random feature head (last layer; fused taps), the target as a feature head, an
# EAGLE-3 head with a 48-token draft vocabulary
EXPANDED = ["feature", "taps", "copy", "eagle3"]


@functools.cache
def expanding_engine(kind: str, others: tuple[str, ...] = ("ngram", "self")) -> flashspec.SpeculativeEngine:
    """Drafters [the expanded head, then ``others`` of n-gram, a noisy copy and the target itself]."""
    arch = "qwen2" if kind == "taps" else "llama"
    model = target_model(arch)
    head = {"feature": lambda: f"feature:{head_folder(model)}", "taps": lambda: f"feature:{head_folder(model, (0, 1))}",
            "copy": lambda: f"feature:{copy_head_folder(model)}",
            "eagle3": lambda: Eagle3Drafter(StaticLM(model), eagle3_head(model))}[kind]()
    return flashspec.SpeculativeEngine(model, [head, *(drafter(arch, k) for k in others)], device="cpu")


def arch_of(kind: str) -> str:
    return "qwen2" if kind == "taps" else "llama"


@pytest.mark.parametrize("layout", ["alone", "ragged"])
@pytest.mark.parametrize("gammas, option", [([3, 2, 4], (3, 8)), ([1, 1, 1], (2, 2)), ([4, 2, 1], (4, 30))])
@pytest.mark.parametrize("kind", EXPANDED)
def test_greedy_with_expansions_equals_hf_generate(kind, gammas, option, layout):
    """An expanded head beside the n-gram and the target itself, batch 1 and a ragged batch of 3: every
    row is the target's own greedy continuation; the head proposes its ``nodes`` at every step, and the
    target as a feature head has nodes accepted."""
    e = expanding_engine(kind)
    name = e.drafters[0].name
    expand = {name: TreeExpansion(*option)}
    if layout == "alone":
        outs = [e.generate_tree([list(p)], max_new_tokens=NEW, gammas=gammas, expand=expand) for p in PROMPTS]
        got, stats = [o.sequences[0] for o in outs], [o.stats for o in outs]
    else:
        out = e.generate_tree([list(p) for p in PROMPTS], max_new_tokens=NEW, gammas=gammas, expand=expand)
        got, stats = out.sequences, [out.stats]
    arch = arch_of(kind)
    assert got == [hf_greedy(arch, p, NEW) for p in PROMPTS]
    assert all(s.per_drafter[name].steps == s.steps and s.per_drafter[name].proposed == option[1] * s.row_steps
               for s in stats)
    assert all(list(s.per_arm) == [f"{name}@{gammas[0]}(top{option[0]},{option[1]})+ngram@{gammas[1]}+"
                                   f"{e.drafters[2].name}@{gammas[2]}"] for s in stats)
    if kind == "copy":
        assert sum(s.per_drafter[name].accepted for s in stats) > 0


@pytest.mark.parametrize("layout", ["alone", "ragged"])
def test_auto_budget_with_an_expansion_equals_hf_generate(layout):
    """``gammas="auto"`` with an expanded head (a copy of the target's own layers, so it is often
    right): the budget chooses the head's depth, the head keeps ``min(nodes, topk + (γ − 1)·topk²)``
    nodes at depth γ, and the output is the target's greedy continuation. Unguarded: the budget's own
    choices (the guard, which reads the clock, is tested in test_tree_guard.py)."""
    e = expanding_engine("copy")
    e.tree_budget = None  # "auto" learns across calls: start afresh
    name, expand = e.drafters[0].name, {e.drafters[0].name: TreeExpansion(2, 5)}
    if layout == "alone":
        stats = []
        for p in PROMPTS:
            out = e.generate_tree([list(p)], max_new_tokens=NEW, gammas="auto", expand=expand, slack=None)
            assert out.sequences == [hf_greedy("llama", p, NEW)]
            stats.append(out.stats)
    else:
        out = e.generate_tree([list(p) for p in PROMPTS], max_new_tokens=NEW, gammas="auto", expand=expand,
                              slack=None)
        assert out.sequences == [hf_greedy("llama", p, NEW) for p in PROMPTS]
        stats = [out.stats]
    depths = {1: 2, 2: 5, 3: 5, 4: 5}  # min(5, 2 + (γ − 1)·4)
    labels = [label for s in stats for label in s.per_arm if label.startswith(f"{name}@")]
    assert labels and all(label.split("+")[0] in {f"{name}@0"} | {f"{name}@{g}(top2,{n})" for g, n in depths.items()}
                          for label in labels)
    assert any("(top2,2)" in label for label in labels) or any("(top2,5)" in label for label in labels)
    assert e.tree_budget.node_count((4, 0, 0)) == 5 and e.tree_budget.node_count((1, 2, 0)) == 4


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), depth=st.integers(1, 4), topk=st.integers(1, 4), pick=st.integers(0, 10**6),
       max_new_tokens=st.integers(1, 10), seed=st.integers(0, 2**16))
@example(batch=1, depth=1, topk=1, pick=0, max_new_tokens=4, seed=0)
def test_any_expansion_gives_the_greedy_output(batch, depth, topk, pick, max_new_tokens, seed):
    """Hypothesis over batch (1–3), depth (1–4), topk (1–4), any node budget they allow and
    max_new_tokens (1–10), ragged random prompts, the target as an expanded feature head beside the
    n-gram: every row is ``generate``'s greedy output, of exactly ``max_new_tokens`` tokens."""
    nodes = 1 + pick % candidates(depth, topk)
    generator = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(0, VOCAB, (int(n),), generator=generator).tolist())
               for n in torch.randint(1, 9, (batch,), generator=generator)]
    e = expanding_engine("copy", ("ngram",))
    out = e.generate_tree([list(p) for p in prompts], max_new_tokens=max_new_tokens, gammas=[depth, 2],
                          expand={e.drafters[0].name: (topk, nodes)})
    assert out.sequences == [hf_greedy("llama", p, 12)[:max_new_tokens] for p in prompts]
    assert all(len(s) == max_new_tokens for s in out.sequences)


class ExpandLog:
    """Records every expansion of one drafter class: the rows' lengths, which were active, the tree."""

    def __init__(self, monkeypatch, cls=FeatureDrafter) -> None:
        self.log: list = []
        expand = cls.expand

        def recording(drafter, history, depth, topk, nodes, params):
            tree = expand(drafter, history, depth, topk, nodes, params)
            self.log.append((history.length.clone(), history.active.clone(), tree))
            return tree

        monkeypatch.setattr(cls, "expand", recording)


def deepest_paths(log: ExpandLog, committed) -> list[int]:
    """Per step, summed over active rows: how many of the committed tokens form a path of the tree."""
    counts = []
    for (_, _, tree), step in zip(log.log, committed):
        total = 0
        for b, c in enumerate(step):
            if c is None:
                continue
            node, depth = -1, 0
            for token in c:
                node = next((j for j in range(tree.tokens.shape[1]) if int(tree.parents[b, j]) == node
                             and int(tree.tokens[b, j]) == token), None)
                if node is None:
                    break
                depth += 1
            total += depth
        counts.append(total)
    return counts


@pytest.mark.parametrize("eos", [False, True])
def test_expanded_counts_are_the_trees_would_be_accepted_length(eos, monkeypatch):
    """Greedy: the expanded drafter's ``accepted`` equals a brute-force recount — per step and active
    row, how many committed tokens form a path of its tree (also where an EOS cuts a step short) — and
    at the first step it equals what its tree alone had accepted."""
    arch, gammas, option = "llama", [3, 2, 2], (2, 5)
    eos_id = hf_greedy(arch, PROMPTS[1], 24)[9] if eos else None
    e = expanding_engine("copy", ("ngram", "noisy"))
    name = e.drafters[0].name
    log = ExpandLog(monkeypatch)
    prompts = [list(p) for p in PROMPTS]
    out = e.generate_tree(prompts, max_new_tokens=24, gammas=gammas, expand={name: option}, eos_token_id=eos_id)
    assert out.sequences == [hf_greedy(arch, p, 24, eos_id) for p in PROMPTS]
    committed = committed_per_step(log, prompts, out.sequences)
    counts = deepest_paths(log, committed)
    stats = out.stats.per_drafter[name]
    assert stats.accepted == sum(counts) > 0 and len(counts) == stats.steps == out.stats.steps
    assert stats.proposed == option[1] * sum(int(active.sum()) for _, active, _ in log.log)
    if not eos:  # alone, from the same state: the first step's tree is the same
        alone = expanding_engine("copy", ())
        first = alone.generate_tree(prompts, max_new_tokens=24, gammas=gammas[:1],
                                    expand={alone.drafters[0].name: option})
        assert first.stats.step_log[0].accepted == counts[0]


def test_sampled_tree_decoding_with_an_expansion_follows_the_target_law():
    """χ² (10,000 samples): the target as a feature head expanded (depth 2, topk 3, 6 nodes: point
    masses tested first) beside the n-gram (point masses, often the same tokens) and a noisy copy
    (drawn), T = 0.7 with top-k and top-p."""
    temperature, top_k, top_p = 0.7, 5, 0.9
    out = sample([f"feature:{copy_head_folder(TARGET)}", "ngram", NOISY], [2, 2, 2], temperature, top_k, top_p,
                 expand_first=TreeExpansion(3, 6))
    p = pvalue(out, exact_law(temperature, top_k, top_p))
    assert p > ALPHA, f"χ² p-value {p:.2e}: the output law differs from the target's"
    per = out.stats.per_drafter
    assert sum(s.accepted for s in per.values()) == out.stats.accepted
    assert all(s.accepted > 0 for s in per.values())
    assert 0 < out.stats.acceptance_rate < 1


def test_sampled_auto_with_an_expansion_follows_the_target_law():
    """χ² (10,000 samples): ``gammas="auto"`` chooses each step's depths (the expanded head's among
    them) from the earlier steps of the whole batch; every step's tree is verified exactly whatever
    it chose, so each row's law is still the target's. T = 0.7 with top-k and top-p."""
    temperature, top_k, top_p = 0.7, 5, 0.9
    out = sample([f"feature:{copy_head_folder(TARGET)}", "ngram", NOISY], "auto", temperature, top_k, top_p,
                 expand_first=TreeExpansion(3, 6))
    p = pvalue(out, exact_law(temperature, top_k, top_p))
    assert p > ALPHA, f"χ² p-value {p:.2e}: the output law differs from the target's"
    assert len(out.stats.per_arm) > 1  # the budget chose more than one allocation


def test_expanded_nodes_tested_as_drawn_fail_the_test(monkeypatch):
    """The χ² test has power on this path: the run above with the expanded nodes tested as if drawn
    from a law (here the uniform one) instead of as point masses is rejected."""
    right = tree_loop.step_tree

    def wrong(parts, sample):
        for part in parts:
            if part.parents is not None:
                part.laws = torch.full((*part.tokens.shape, V), 1.0 / V)
        return right(parts, sample)

    monkeypatch.setattr(tree_loop, "step_tree", wrong)
    temperature, top_k, top_p = 0.7, 5, 0.9
    out = sample([f"feature:{copy_head_folder(TARGET)}", "ngram", NOISY], [2, 2, 2], temperature, top_k, top_p,
                 expand_first=TreeExpansion(3, 6), samples=3_000)
    assert pvalue(out, exact_law(temperature, top_k, top_p)) < ALPHA


def test_bad_expand_options_are_clear_errors():
    e = expanding_engine("feature")
    name = e.drafters[0].name
    cases = [({"nope": (2, 2)}, [2, 1, 1], "'nope', which is not a drafter of this engine"),
             ({e.drafters[2].name: (2, 2)}, [2, 1, 1], f"'{e.drafters[2].name}' cannot expand"),
             ([(2, 2)], [2, 1, 1], "expand must map drafter names"),
             ({name: 3}, [2, 1, 1], r"must be a TreeExpansion\(topk, nodes\) or a \(topk, nodes\) pair"),
             ({name: (0, 2)}, [2, 1, 1], "topk must be an integer from 1 to 64; got 0"),
             ({name: (2, 7)}, [2, 1, 1], "makes at most 6"),
             ({name: (2, 40)}, "auto", "makes at most")]  # nodes past what its largest depth holds
    for expand, gammas, message in cases:
        with pytest.raises(ValueError, match=message):
            e.generate_tree([[1, 2]], gammas=gammas, expand=expand)
    small = expanding_engine("eagle3")
    with pytest.raises(ValueError, match="draft vocabulary has 48 tokens"):
        small.generate_tree([[1, 2]], gammas=[4, 1, 1], expand={small.drafters[0].name: (50, 50)})
    assert e.generate_tree([[1, 2]], max_new_tokens=4, expand={}).sequences == [hf_greedy("llama", (1, 2), 4)]


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("expanded", [False, True])
def test_a_tree_step_reads_the_device_once(expanded, sampled, monkeypatch):
    """Inside every tree step, one ``tolist`` (the step's read) and no other read of a tensor back to the
    host: the trees are built unchecked, the drafters' outputs checked on the host. Drafters: a feature
    head (expanded or as a chain), the n-gram and a noisy copy; a ragged batch."""
    inside, per_step = [False], []

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            if inside[0]:
                per_step[-1][name] = per_step[-1].get(name, 0) + 1
            return original(self, *args, **kwargs)
        return wrapper

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    step = tree_loop._TreeRun.tree_step

    def observed(run):
        inside[0] = True
        per_step.append({})
        try:
            return step(run)
        finally:
            inside[0] = False

    monkeypatch.setattr(tree_loop._TreeRun, "tree_step", observed)
    e = expanding_engine("feature", ("ngram", "noisy"))
    expand = {e.drafters[0].name: (3, 6)} if expanded else None
    out = e.generate_tree([list(p) for p in PROMPTS], max_new_tokens=NEW, gammas=[2, 2, 3], expand=expand,
                          do_sample=sampled, temperature=0.8, seed=3)
    assert len(per_step) == out.stats.steps > 1
    assert all(reads == {"tolist": 1} for reads in per_step), per_step
