"""Engine behaviour beyond exactness: caches, seeds, strings, statistics, stopping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from flashspec import SpeculativeEngine
from flashspec.models.graphs import Graphs, window_widths


def llama(seed: int = 0, vocab: int = 40) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


TARGET = llama()


def record_forward_lengths(lm):
    """Token counts of every forward of a cache wrapper (StaticLM or CachedLM), prefills included."""
    lengths = []
    for name in ("forward", "prefill"):
        original = getattr(lm, name)

        def forward(tokens, *args, _original=original, **kwargs):
            lengths.append(tokens.shape[1])
            return _original(tokens, *args, **kwargs)

        setattr(lm, name, forward)
    return lengths


def test_target_forwards_are_prompt_once_then_gamma_plus_one():
    target, drafter = llama(), llama(seed=3)
    engine = SpeculativeEngine(target, [drafter])
    lengths = record_forward_lengths(engine._target_lm)
    gamma = 3
    out = engine.generate([list(range(1, 21))], max_new_tokens=14, num_draft_tokens=gamma, eos_token_id=[])
    assert lengths[0] == 20  # the prefix once
    assert all(n <= gamma + 1 for n in lengths[1:])  # no step re-runs the prefix
    assert len(lengths) == 1 + out.stats.steps  # one target forward per step
    assert lengths[1] == gamma + 1


def test_drafter_forwards_catch_up_without_rerunning_the_prefix():
    target, drafter = llama(), llama(seed=3)
    engine = SpeculativeEngine(target, [drafter])
    lengths = record_forward_lengths(engine.drafters[0]._lm)
    engine.generate([list(range(1, 21))], max_new_tokens=14, num_draft_tokens=3, eos_token_id=[])
    assert lengths[0] == 21  # prompt + the first new token, once
    assert all(n <= 2 for n in lengths[1:])  # later: at most the unseen committed tokens


def test_seed_reproducible_and_seed_matters():
    engine = SpeculativeEngine(TARGET, [llama(seed=5)])
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=0.9, eos_token_id=[])
    a = engine.generate([[1, 2, 3], [4, 5]], seed=11, **kwargs).sequences
    b = engine.generate([[1, 2, 3], [4, 5]], seed=11, **kwargs).sequences
    c = engine.generate([[1, 2, 3], [4, 5]], seed=12, **kwargs).sequences
    assert a == b
    assert a != c


def test_stats_are_consistent():
    engine = SpeculativeEngine(TARGET, [TARGET])
    out = engine.generate([[1, 2, 3]], max_new_tokens=21, num_draft_tokens=4, eos_token_id=[])
    s = out.stats
    assert s.new_tokens == 21
    assert s.acceptance_rate == 1.0  # the drafter is the target
    assert s.steps == 4  # 1 token from the prefill, then 4 steps of 5 (4 drafts + bonus)
    assert s.mean_tokens_per_step == 5.0  # 20 tokens / 4 steps
    assert s.per_drafter[engine.drafters[0].name].accepted == s.accepted
    assert 0.0 <= s.overhead_fraction < 1.0
    assert s.tokens_per_second > 0


def test_max_new_tokens_zero_and_one():
    engine = SpeculativeEngine(TARGET, ["ngram"])
    assert engine.generate([[1, 2]], max_new_tokens=0).sequences == [[]]
    assert len(engine.generate([[1, 2]], max_new_tokens=1, eos_token_id=[]).sequences[0]) == 1


def test_rows_stop_on_their_own_eos():
    engine = SpeculativeEngine(TARGET, [llama(seed=4)])
    free = engine.generate([[1, 2, 3], [7, 8]], max_new_tokens=12, eos_token_id=[]).sequences
    eos = free[0][4]
    out = engine.generate([[1, 2, 3], [7, 8]], max_new_tokens=12, eos_token_id=eos).sequences
    for row_free, row in zip(free, out):
        if eos in row_free:
            cut = row_free.index(eos) + 1
            assert row == row_free[:cut]
        else:
            assert row == row_free


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<unk>"] + [chr(ord("a") + i) for i in range(26)] + ["the", "cat"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_strings_in_text_out():
    engine = SpeculativeEngine(TARGET, ["ngram"], tokenizer=tiny_tokenizer())
    out = engine.generate(["the cat a b", "c"], max_new_tokens=5, eos_token_id=[])
    assert len(out.text) == 2 and all(isinstance(t, str) for t in out.text)
    single = engine.generate("the cat", max_new_tokens=3, eos_token_id=[])
    assert len(single.sequences) == 1 and len(single.sequences[0]) == 3


def test_right_padded_tensor_with_mask():
    engine = SpeculativeEngine(TARGET, ["ngram"])
    ids = torch.tensor([[5, 6, 7, 0], [9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    padded = engine.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[]).sequences
    alone = engine.generate([[5, 6, 7], [9, 9, 9, 9]], max_new_tokens=6, eos_token_id=[]).sequences
    assert padded == alone


def test_sync_every_changes_nothing_but_when_the_host_looks():
    engine = SpeculativeEngine(TARGET, [llama(seed=5)])
    kwargs = dict(max_new_tokens=25, do_sample=True, temperature=0.9, eos_token_id=[3], seed=2)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    a = engine.generate(prompts, sync_every=1, **kwargs)
    b = engine.generate(prompts, sync_every=7, **kwargs)
    assert a.sequences == b.sequences
    assert a.stats.decode_tokens == b.stats.decode_tokens


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_sync_every_raises(bad):
    with pytest.raises(ValueError, match="sync_every"):
        SpeculativeEngine(TARGET, []).generate([[1, 2]], max_new_tokens=3, sync_every=bad)


def test_model_drafters_are_prefilled_with_the_target():
    """The drafter's pass over the prompt belongs to the prefill: it comes before the first
    step's target forward, and every step re-feeds at most 2 tokens (one CUDA graph on a GPU)."""
    target, drafter = llama(), llama(seed=3)
    engine = SpeculativeEngine(target, [drafter])
    calls = []
    for who, lm in (("target", engine._target_lm), ("drafter", engine.drafters[0]._lm)):
        for name in ("forward", "prefill"):
            original = getattr(lm, name)

            def forward(tokens, *args, _who=who, _original=original, **kwargs):
                calls.append((_who, tokens.shape[1]))
                return _original(tokens, *args, **kwargs)

            setattr(lm, name, forward)
    out = engine.generate([list(range(1, 21)), [4, 5, 6]], max_new_tokens=9, num_draft_tokens=3, eos_token_id=[])
    assert calls[:2] == [("target", 20), ("drafter", 21)]  # prompts, then prompt + first token
    steps = calls[2:]
    assert [n for who, n in steps if who == "target"] == [4] * out.stats.steps
    assert all(n <= 2 for who, n in steps if who == "drafter")


class _RecordingGraphs(Graphs):
    """CUDA graphs as the loop meets them, on the CPU: each key is recorded at its first run and
    every run runs the function (which reads the same buffers a replay would)."""

    def __init__(self) -> None:
        super().__init__(enabled=False)
        self.enabled = True
        self.keys: list = []

    def __contains__(self, key) -> bool:
        return key in self.keys

    def run(self, key, fn, warm=False):
        new = key not in self.keys
        if new:
            self.keys.append(key)
        result = fn()
        if warm and new:  # the warming replay right after a capture runs it once more
            fn()
        return result

    def clear(self) -> None:
        self.keys.clear()


@pytest.mark.parametrize("do_sample", [False, True])
def test_prefills_padded_to_graph_widths_change_nothing(do_sample):
    """SPEC.md §7, "The prefill is a graph too": with graphs the prefill feeds the prompts at the
    narrowest graph width that holds the longest (zeros past each row), and the first prefill of
    a workspace captures every width; the tokens are those of the unpadded eager prefill, greedy
    and sampled, alone and in a ragged batch."""
    sampling = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=4) if do_sample else {}
    for prompts in ([[1, 2, 3]], [[4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]],
                    [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]):
        kwargs = dict(max_new_tokens=10, eos_token_id=[], **sampling)
        plain = SpeculativeEngine(TARGET, [llama(seed=5)]).generate(prompts, **kwargs)
        engine = SpeculativeEngine(TARGET, [llama(seed=5)])
        engine._graphs = graphs = _RecordingGraphs()
        out = engine.generate(prompts, **kwargs)
        assert out.sequences == plain.sequences
        capacity = engine._buffers.tokens.shape[1]
        widths = window_widths(capacity, 16)
        prefills = [key for key in graphs.keys if key[1:] == ("prefill",)]
        longest = max(map(len, prompts))
        own = next(w for w in widths if w >= longest)
        assert prefills == [(w, "prefill") for w in widths if w != own] + [(own, "prefill")]


@settings(max_examples=20, deadline=None)
@given(max_new=st.integers(2, 40), sync_every=st.integers(1, 9), gamma=st.integers(1, 5),
       batch=st.integers(1, 3), ahead=st.booleans())
def test_polls_come_sooner_near_the_end_and_no_step_is_wasted(max_new, sync_every, gamma, batch, ahead):
    """SPEC.md §7: without an EOS no step runs after every row reached its budget (each step the
    drafter proposes for is a step with an active row), whatever sync_every and queueing ahead,
    and the tokens are those of the loop that polls every step; with drafts accepted, the rows
    finish well before the loop's last step."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]][:batch]
    kwargs = dict(max_new_tokens=max_new, eos_token_id=[], num_draft_tokens=gamma)
    drafter = llama(seed=0)  # the target's weights: greedy drafts are accepted, rows finish early
    reference = SpeculativeEngine(TARGET, [drafter], selector="fixed").generate(prompts, sync_every=1, **kwargs)
    engine = SpeculativeEngine(TARGET, [drafter], selector="fixed")
    engine.queue_ahead = ahead
    drafter, calls = engine.drafters[0], []
    propose = drafter.propose
    drafter.propose = lambda *a, **k: calls.append(1) or propose(*a, **k)
    out = engine.generate(prompts, sync_every=sync_every, **kwargs)
    assert out.sequences == reference.sequences
    assert len(calls) == out.stats.steps
    assert out.stats.accepted > 0 or max_new == 2


@settings(max_examples=15, deadline=None)
@given(max_new=st.integers(2, 70), sync_every=st.integers(1, 9), gamma=st.integers(1, 6),
       batch=st.integers(1, 3), ahead=st.booleans())
def test_target_only_steps_of_an_engine_with_drafters_poll_as_a_target_only_engine(
        max_new, sync_every, gamma, batch, ahead):
    """SPEC.md §7: the loop counts what the launched steps can commit (a target-only step: 1
    token per row), so an engine with drafters whose steps all run the target alone polls (and
    queues ahead) exactly as a target-only engine does, not as often as its largest γ would need."""
    from unittest import mock

    from flashspec.decode import loop

    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]][:batch]
    kwargs = dict(max_new_tokens=max_new, eos_token_id=[], sync_every=sync_every)
    polls, steps = [], []
    poll, step = loop._Run.poll, loop._Run.step
    schedules = []
    with mock.patch.object(loop._Run, "poll", lambda self, *a: polls.append(len(self.chosen)) or poll(self, *a)), \
            mock.patch.object(loop._Run, "step", lambda self: steps.append(1) or step(self)):
        for drafters, options in (([], {}), ([llama(seed=5)], dict(gammas=[gamma], target_only=True, slack=None,
                                                                   selector="fixed", selector_options={"arm": 1}))):
            engine = SpeculativeEngine(TARGET, drafters, **options)
            engine.queue_ahead = ahead
            polls.clear(), steps.clear()
            out = engine.generate(prompts, **kwargs)
            schedules.append((list(polls), len(steps), out.sequences))
    alone, with_drafters = schedules
    assert with_drafters == alone


@pytest.mark.parametrize("sync_every", [1, 3])
def test_queueing_a_step_ahead_of_the_poll_changes_nothing_but_timing(sync_every):
    """On a GPU the loop queues the next step before a poll waits (``queue_ahead``); the same
    loop on the CPU must give the same tokens, including when rows stop early on EOS."""
    kwargs = dict(max_new_tokens=25, do_sample=True, temperature=0.9, eos_token_id=[3], seed=2, sync_every=sync_every)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    results = []
    for ahead in (False, True):
        engine = SpeculativeEngine(TARGET, [llama(seed=5)])
        engine.queue_ahead = ahead
        results.append(engine.generate(prompts, **kwargs))
    plain, ahead = results
    assert plain.sequences == ahead.sequences
    assert plain.stats.decode_tokens == ahead.stats.decode_tokens == sum(len(s) for s in plain.sequences) - 3
    assert ahead.stats.steps >= plain.stats.steps  # at most one more (it commits nothing)
    assert ahead.stats.steps <= plain.stats.steps + 1


def test_captures_after_the_first_skip_torch_s_gc_collect_and_empty_cache(monkeypatch):
    """Graphs (SPEC.md §7): torch.cuda.graph collects garbage and empties the allocator's cache
    before every capture; only the first capture of a process does (a warm-up captures a hundred
    graphs), and both are restored after each capture."""
    import gc

    import flashspec.models.graphs as graphs

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *args, **kwargs: calls.append("gc") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(graphs, "_collected", False)
    for _ in range(3):
        with graphs._capture_without_collecting():
            gc.collect()
            torch.cuda.empty_cache()
    assert calls == ["gc", "empty"]
    gc.collect()
    torch.cuda.empty_cache()
    assert calls == ["gc", "empty", "gc", "empty"]


# ----------------------------------------------------------------------------- warm shapes (SPEC.md §7)
@pytest.mark.default_configuration
def test_a_warm_engine_compiles_nothing_inside_requests():
    """With compile=True the engine's shapes are fixed and warmed at construction: requests of
    other prompt lengths, output lengths, batch sizes (within the warmed ones) and sampling
    parameters compile nothing and take no cold step; a batch size never warmed is reported as
    cold steps, the one-off cost it is."""
    from flashspec.models.graphs import compile_events

    engine = SpeculativeEngine(llama(), ["ngram"], compile=True, warmup=True, warmup_batch_sizes=(1, 2), max_length=128)
    assert engine.fixed_shapes and engine.warmup_seconds > 0 and engine.arm_costs  # measured while warming
    before = compile_events()
    for length, new, rows, sampling in [(5, 10, 1, {}), (37, 23, 2, {}), (60, 40, 1, {"do_sample": True,
                                        "temperature": 0.5, "top_k": 5}), (3, 50, 2, {}), (60, 60, 1, {})]:
        out = engine.generate([[t % 40 for t in range(1, length + 1)]] * rows, max_new_tokens=new, eos_token_id=[],
                              **sampling)
        assert out.stats.cold_steps == 0 and [len(s) for s in out.sequences] == [new] * rows
    assert compile_events() == before
    cold = engine.generate([[1, 2, 3]] * 3, max_new_tokens=8, eos_token_id=[])  # 3 rows run as 4: never warmed
    assert cold.stats.cold_steps > 0 and len(cold.sequences) == 3


def test_padded_rows_change_no_output():
    """Where shapes are fixed a call of B prompts runs over 2^⌈log₂ B⌉ rows; the extra rows are
    inactive from the start, so greedy output (float32) equals the unpadded engine's."""
    target, drafter = llama(), llama(seed=3)
    prompts = [list(range(1, 9)), [4, 5, 6], list(range(20, 31))]
    plain = SpeculativeEngine(target, [drafter])
    padded = SpeculativeEngine(target, [drafter], max_length=64)
    padded.fixed_shapes = True  # as with CUDA graphs or compile=True, without compiling here
    out = padded.generate(prompts, max_new_tokens=12, eos_token_id=[])
    assert padded._buffers.shape[:2] == (4, 256)  # padded rows; the capacity of max_length
    assert out.sequences == plain.generate(prompts, max_new_tokens=12, eos_token_id=[]).sequences
    assert out.stats.row_steps <= 3 * out.stats.steps  # padded rows never count as active
