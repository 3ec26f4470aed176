"""Greedy speculative decoding equals the target's own greedy decoding, token for token.

CI gate for SPEC.md §2 (greedy corollary), §3 (ragged batches, holes, rollback) and §5 (the
engine contract): for every architecture, drafter kind, γ and batch layout,
``SpeculativeEngine(target, drafter).generate(..., do_sample=False)`` must return exactly the new
tokens of ``target.generate(..., do_sample=False)`` run on each unpadded prompt alone.

The models are tiny random-weight ones built from configs (``tests/tiny_models.py``), so nothing
is downloaded. HF reference outputs are computed once per (architecture, prompt, length, EOS)
and cached for the whole module.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flashspec
from flashspec.models.static import StaticLM
from tiny_models import ARCHITECTURES, CONTEXT, noisy_copy, tiny_model

VOCAB = 128
NEW_TOKENS = 20
PAD = 7  # a real token id, so a padded position that leaked into attention would show
# Rows of different lengths (1, 3, 7, 12). The repeated patterns give the n-gram drafter
# matches in the prompt itself; the target's own output (random weights, greedy) repeats too.
PROMPTS = (
    (11,),
    (5, 9, 17),
    (3, 8, 3, 8, 3, 8, 3),
    (40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42, 43),
)
DRAFTERS = ("model", "ngram", "self", "early-exit", "feature", "feature-fused", "none")
FROM_TARGET = ("early-exit", "feature", "feature-fused")  # drafters made from the target: the static cache
GAMMAS = (1, 4)
NOISE = 0.05  # relative weight noise of the model drafter: accepts about half its drafts


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core machine the OpenMP
    hand-off costs ~15 ms per matmul. Restored afterwards so other modules are unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------- helpers
@functools.lru_cache(maxsize=None)
def target_model(arch: str):
    # A different seed per architecture, so e.g. Llama and Mistral do not share weights.
    return tiny_model(arch, seed=ARCHITECTURES.index(arch), vocab_size=VOCAB)


@functools.lru_cache(maxsize=None)
def feature_checkpoint(arch: str) -> str:
    """An untrained (seeded) feature drafter for the architecture's target, saved once."""
    import tempfile

    from flashspec.drafters.checkpoint import save_drafter

    folder = tempfile.mkdtemp(prefix=f"flashspec-feature-{arch}-")
    torch.manual_seed(ARCHITECTURES.index(arch))
    save_drafter(flashspec.FeatureHead(target_model(arch).config, 1), target_model(arch), folder)
    return folder


@functools.lru_cache(maxsize=None)
def fused_checkpoint(arch: str) -> str:
    """An untrained (seeded) fused-feature drafter (SPEC.md §11, "Fused features") tapping EAGLE-3's
    layers of the architecture's target (both of its 2 layers), saved once."""
    import tempfile

    from flashspec.drafters.checkpoint import save_drafter
    from flashspec.drafters.feature import default_taps

    folder = tempfile.mkdtemp(prefix=f"flashspec-fused-{arch}-")
    torch.manual_seed(100 + ARCHITECTURES.index(arch))
    model = target_model(arch)
    head = flashspec.FeatureHead(model.config, 1, taps=default_taps(model.config.num_hidden_layers))
    save_drafter(head, model, folder)
    return folder


@functools.lru_cache(maxsize=None)
def noisy_drafter(arch: str):
    return noisy_copy(target_model(arch), NOISE, seed=1000 + ARCHITECTURES.index(arch))


def make_engine(arch: str, drafter: str) -> flashspec.SpeculativeEngine:
    target = target_model(arch)
    if drafter in FROM_TARGET and not StaticLM.supports(target):
        pytest.skip("drafters made from the target run over the static cache (Llama, Qwen2, Qwen3, Mistral)")
    drafters = {
        "model": lambda: noisy_drafter(arch),  # an independent model: agrees often, not always
        "ngram": lambda: "ngram",
        "self": lambda: target,  # drafter == target: every draft must be accepted
        "early-exit": lambda: "early-exit:1",  # the target's first layer, sharing its cache (SPEC §11)
        "feature": lambda: f"feature:{feature_checkpoint(arch)}",  # untrained: reads the target's features
        "feature-fused": lambda: f"feature:{fused_checkpoint(arch)}",  # reads several of its layers (EAGLE-3)
        "none": lambda: [],  # target-only decoding through the same loop
    }[drafter]()
    return flashspec.SpeculativeEngine(target, drafters, device="cpu")


@functools.lru_cache(maxsize=None)
def hf_greedy(arch: str, prompt: tuple[int, ...], max_new_tokens: int, eos=None) -> list[int]:
    """``target.generate`` on the prompt alone: its new tokens (through the first EOS, if any)."""
    model = target_model(arch)
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=list(eos) if isinstance(eos, tuple) else eos,
        )
    new = out[0, len(prompt) :].tolist()
    assert len(new) <= max_new_tokens
    return cut_at_eos(new, eos)


def cut_at_eos(tokens: list[int], eos) -> list[int]:
    """``tokens`` up to and including the first EOS (HF pads finished rows after it)."""
    stop = set(eos) if isinstance(eos, tuple) else ({eos} if eos is not None else set())
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def padded(prompts, side: str, pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[B, L]`` batch padded on ``side`` with its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[b, cols] = torch.tensor(p)
        mask[b, cols] = 1
    return ids, mask


def run(engine, layout: str, prompts, **kwargs) -> tuple[list[list[int]], list]:
    """Generate for ``prompts`` laid out as ``layout``; return the sequences and the stats of
    every generate call made."""
    kwargs.setdefault("do_sample", False)
    if layout == "alone":  # one call per row, batch of one, on the same (reused) engine
        outs = [engine.generate([list(p)], **kwargs) for p in prompts]
        return [o.sequences[0] for o in outs], [o.stats for o in outs]
    if layout == "ragged":  # a list of token lists of different lengths
        out = engine.generate([list(p) for p in prompts], **kwargs)
    elif layout in ("left_padded", "right_padded"):
        ids, mask = padded(prompts, layout.split("_")[0])
        out = engine.generate(ids, attention_mask=mask, **kwargs)
    else:
        raise AssertionError(layout)
    return out.sequences, [out.stats]


def assert_rows_equal(got, expected, context: str) -> None:
    assert len(got) == len(expected), context
    for b, (g, e) in enumerate(zip(got, expected)):
        first = next((i for i, (x, y) in enumerate(zip(g, e)) if x != y), min(len(g), len(e)))
        assert g == e, f"{context}: row {b} differs at new token {first}:\n  flashspec {g}\n  HF        {e}"


def check_drafter_stats(drafter: str, stats_list) -> None:
    proposed = sum(s.proposed for s in stats_list)
    accepted = sum(s.accepted for s in stats_list)
    assert 0 <= accepted <= proposed
    if drafter == "none":
        assert proposed == 0 and accepted == 0
    elif drafter == "self":
        # Drafter == target: the drafts are the target's own argmaxes (SPEC.md §2 greedy rule),
        # so acceptance is 1 up to float noise between a 1-token and a (k+1)-token forward.
        assert proposed > 0
        assert accepted / proposed >= 0.9, f"self-drafting acceptance {accepted}/{proposed}"
    elif drafter == "model":
        assert proposed > 0


# ---------------------------------------------------------------------------------- tests
# Every layout with γ = 4; with γ = 1 the three layouts the gate requires (right padding, also
# accepted by §5, only once to keep the file fast).
GAMMA_LAYOUTS = [(g, layout) for g in GAMMAS for layout in ("alone", "ragged", "left_padded")] + [(4, "right_padded")]


@pytest.mark.parametrize("gamma, layout", GAMMA_LAYOUTS, ids=[f"g{g}-{layout}" for g, layout in GAMMA_LAYOUTS])
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_hf_generate(arch, drafter, gamma, layout):
    engine = make_engine(arch, drafter)
    got, stats = run(engine, layout, PROMPTS, max_new_tokens=NEW_TOKENS, num_draft_tokens=gamma, eos_token_id=[])
    expected = [hf_greedy(arch, p, NEW_TOKENS) for p in PROMPTS]
    assert_rows_equal(got, expected, f"{arch}/{drafter}/γ={gamma}/{layout}")
    assert all(len(s) == NEW_TOKENS for s in got)
    check_drafter_stats(drafter, stats)
    if drafter == "ngram" and layout != "alone":
        assert stats[0].proposed > 0, "the repeated prompts should give the n-gram drafter matches"


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_model_drafter_is_both_accepted_and_rejected(arch, gamma):
    """The noisy drafter exercises both verify paths (accept and reject + rollback), in one
    ragged batch where rows accept different numbers of drafts in the same step."""
    engine = make_engine(arch, "model")
    out = engine.generate([list(p) for p in PROMPTS], max_new_tokens=NEW_TOKENS, do_sample=False,
                          num_draft_tokens=gamma, eos_token_id=[])
    assert_rows_equal(out.sequences, [hf_greedy(arch, p, NEW_TOKENS) for p in PROMPTS], arch)
    rate = out.stats.acceptance_rate
    assert 0.0 < rate < 1.0, f"acceptance rate {rate}: the test should see both accepts and rejects"
    per = out.stats.per_drafter
    assert sum(d.proposed for d in per.values()) == out.stats.proposed


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_short_budgets(arch, drafter, max_new_tokens):
    """γ = 4 with budgets at or below γ + 1: the draft length is cut near the end, and
    ``max_new_tokens = 1`` is the prefill's token alone."""
    engine = make_engine(arch, drafter)
    got, _ = run(engine, "ragged", PROMPTS, max_new_tokens=max_new_tokens, num_draft_tokens=4, eos_token_id=[])
    expected = [hf_greedy(arch, p, NEW_TOKENS)[:max_new_tokens] for p in PROMPTS]
    assert_rows_equal(got, expected, f"{arch}/{drafter}/max_new_tokens={max_new_tokens}")


# ---------------------------------------------------------------------------------- EOS
def pick_eos(arch: str, kind: str):
    """An EOS that the target's greedy output really produces, chosen from the outputs without
    EOS so that rows stop at different times.

    ``mid``: the token whose first occurrences are at the most distinct positions across rows
    (a row without it runs to the length limit), excluding tokens that are some row's first
    output. ``first``: the first token of row 1, so that row ends right after the prefill.
    ``pair``: two ids (a list EOS), the ``mid`` one and the first token of another row's
    second half.
    """
    outputs = [hf_greedy(arch, p, NEW_TOKENS) for p in PROMPTS]
    if kind == "first":
        return outputs[1][0]

    def stop_positions(token):
        return tuple(o.index(token) if token in o else NEW_TOKENS for o in outputs)

    candidates = sorted({t for o in outputs for t in o} - {o[0] for o in outputs})
    best = max(candidates, key=lambda t: (len(set(stop_positions(t))), -t))
    if kind == "mid":
        return best
    others = [o[NEW_TOKENS // 2] for o in outputs if o[NEW_TOKENS // 2] != best]
    return (best, others[0]) if others else best


EOS_CASES = [
    ("mid", 4, "alone"),
    ("mid", 4, "ragged"),
    ("mid", 4, "left_padded"),
    ("mid", 1, "ragged"),
    ("first", 4, "ragged"),
    ("pair", 4, "ragged"),
]


@pytest.mark.parametrize("kind, gamma, layout", EOS_CASES, ids=[f"{k}-g{g}-{lay}" for k, g, lay in EOS_CASES])
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_eos_rows_stop_at_different_times(arch, drafter, kind, gamma, layout):
    eos = pick_eos(arch, kind)
    eos_set = set(eos) if isinstance(eos, tuple) else {eos}
    expected = [hf_greedy(arch, p, NEW_TOKENS, eos) for p in PROMPTS]
    # The reference itself: HF with EOS is HF without EOS cut at the first EOS.
    assert expected == [cut_at_eos(hf_greedy(arch, p, NEW_TOKENS), eos) for p in PROMPTS]
    stopped = [e[-1] in eos_set for e in expected]
    assert any(stopped), "the chosen EOS must occur in the target's output"
    assert len({len(e) for e in expected}) > 1, "rows should stop at different times"

    engine = make_engine(arch, drafter)
    eos_arg = list(eos) if isinstance(eos, tuple) else eos
    got, stats = run(engine, layout, PROMPTS, max_new_tokens=NEW_TOKENS, num_draft_tokens=gamma, eos_token_id=eos_arg)
    assert_rows_equal(got, expected, f"{arch}/{drafter}/γ={gamma}/EOS {eos}/{layout}")
    for seq, stop in zip(got, stopped):
        # Ends with EOS exactly when it was produced; no EOS before the end.
        assert (seq[-1] in eos_set) == stop
        assert not eos_set & set(seq[:-1])
        assert stop or len(seq) == NEW_TOKENS
    if not (kind == "first" and layout == "alone"):  # row 1 alone stops after the prefill
        check_drafter_stats(drafter, stats)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_default_eos_comes_from_generation_config(arch):
    """``eos_token_id=None`` takes the target's ``generation_config.eos_token_id`` (SPEC.md §5)."""
    target = target_model(arch)
    eos = pick_eos(arch, "mid")
    expected = [hf_greedy(arch, p, NEW_TOKENS, eos) for p in PROMPTS]
    engine = make_engine(arch, "model")
    saved = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = eos
    try:
        out = engine.generate([list(p) for p in PROMPTS], max_new_tokens=NEW_TOKENS, do_sample=False, num_draft_tokens=4)
    finally:
        target.generation_config.eos_token_id = saved
    assert_rows_equal(out.sequences, expected, f"{arch}/default EOS {eos}")


# ---------------------------------------------------------------------------------- context window
WINDOW_NEW_TOKENS = 12
# Learned absolute position embeddings (GPT-2, OPT) fail on a position past the window, so a
# drafter that fed drafts for a finished row at the window would crash here (a bug once).


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_row_ending_at_the_context_window(arch, drafter):
    """prompt + max_new_tokens == context window is allowed (SPEC.md §5). The long row ends at
    the window while the short row is still generating, so it rides along as holes."""
    long_prompt = tuple(([40, 41, 42, 43] * CONTEXT)[: CONTEXT - WINDOW_NEW_TOKENS])
    prompts = (long_prompt, PROMPTS[2])
    engine = make_engine(arch, drafter)
    out = engine.generate([list(p) for p in prompts], max_new_tokens=WINDOW_NEW_TOKENS, do_sample=False,
                          num_draft_tokens=4, eos_token_id=[])
    expected = [hf_greedy(arch, p, WINDOW_NEW_TOKENS) for p in prompts]
    assert_rows_equal(out.sequences, expected, f"{arch}/{drafter}/context window")


# ---------------------------------------------------------------------------------- random batches
@settings(max_examples=24, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(ARCHITECTURES),
    drafter=st.sampled_from(DRAFTERS),
    gamma=st.integers(1, 6),
    max_new_tokens=st.integers(1, 16),
    layout=st.sampled_from(["ragged", "left_padded", "right_padded"]),
    # A small alphabet makes repeats (n-gram matches) likely; a single-row batch is allowed.
    prompts=st.lists(
        st.lists(st.integers(0, 5), min_size=1, max_size=10).map(tuple), min_size=1, max_size=4
    ),
)
def test_random_batches_match_hf_generate(arch, drafter, gamma, max_new_tokens, layout, prompts):
    assume(drafter not in FROM_TARGET or StaticLM.supports(target_model(arch)))  # static cache
    engine = make_engine(arch, drafter)
    got, _ = run(engine, layout, prompts, max_new_tokens=max_new_tokens, num_draft_tokens=gamma, eos_token_id=[])
    expected = [hf_greedy(arch, p, NEW_TOKENS)[:max_new_tokens] for p in prompts]
    assert got == expected, f"{arch}/{drafter}/γ={gamma}/{layout}/{prompts}"
