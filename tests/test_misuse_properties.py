"""Generated misuse (SPEC.md §5): malformed and edge-case arguments thrown at ``generate``, the
constructor and the command line. Every call either returns a result that passes the exactness
checks (greedy: token for token the target-only engine's output; sampled: ids in the vocabulary,
every row its full length) or raises ``ValueError``/``TypeError`` with a message naming the
argument — never another exception, a hang or a silent clamp."""

from __future__ import annotations

import contextlib
import io
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from flashspec import SpeculativeEngine
from flashspec.cli import main
from flashspec.decode.request import prompt_rows

VOCAB = 32
CONTEXT = 64


def llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=CONTEXT,
                         initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


TARGET, DRAFT = llama(0), llama(1)
ENGINE = SpeculativeEngine(TARGET, [DRAFT, "ngram"], gammas=[1, 3], selector="thompson", selector_options={"seed": 0})
REFERENCE = SpeculativeEngine(TARGET, [])
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ODD = st.one_of(  # values of the wrong kind for almost any argument
    st.none(), st.booleans(), st.text(max_size=4), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**12), max_value=10**12), st.lists(st.integers(-3, 40), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.just(np.int64(3)), st.just(np.bool_(True)),
    st.just(torch.tensor([1.5])),
)

# generate's arguments: a valid strategy, and the words an error about each must contain.
VALID = {
    "max_new_tokens": st.integers(0, 10),
    "do_sample": st.booleans(),
    "temperature": st.floats(0.3, 2.0),
    "top_k": st.integers(0, 40),
    "top_p": st.floats(0.2, 1.0),
    "num_draft_tokens": st.integers(1, 6),
    "eos_token_id": st.one_of(st.just([]), st.integers(0, VOCAB - 1), st.lists(st.integers(0, VOCAB - 1), max_size=2)),
    "seed": st.one_of(st.none(), st.integers(0, 2**32)),
    "sync_every": st.one_of(st.none(), st.integers(1, 4)),
    "context": st.one_of(st.none(), st.text(max_size=3), st.integers(0, 3)),
    "progress": st.just(False),
}
NAMES = {
    "input_ids": ("input_ids", "Prompt", "batch", "tokenizer"),
    "attention_mask": ("attention_mask",),
    "max_new_tokens": ("max_new_tokens",),
    "do_sample": ("do_sample",),
    "temperature": ("temperature",),
    "top_k": ("top_k",),
    "top_p": ("top_p",),
    "num_draft_tokens": ("num_draft_tokens",),
    "eos_token_id": ("eos_token_id",),
    "seed": ("seed",),
    "sync_every": ("sync_every",),
    "context": ("context",),
    "progress": ("progress",),
}
PROMPTS = st.one_of(
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=3),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),  # one flat prompt
)
BAD_PROMPTS = st.one_of(
    ODD, st.just([]), st.just([[]]), st.lists(st.lists(st.integers(-5, 2 * VOCAB), max_size=4), max_size=3),
    st.just(torch.zeros(2, 0, dtype=torch.long)), st.just(torch.ones(1, 3)), st.just([[1, 2], 3]),
    st.just("text without a tokenizer"), st.just(torch.ones(2, 2, 2, dtype=torch.long)),
)


def assert_names(error: BaseException, argument: str) -> None:
    assert isinstance(error, (ValueError, TypeError)), f"{type(error).__name__} for {argument}: {error}"
    assert any(word in str(error) for word in NAMES.get(argument, (argument,))), f"{argument}: {error}"


def assert_exact(out, kwargs: dict, input_ids, attention_mask) -> None:
    rows = prompt_rows(input_ids, attention_mask, None, VOCAB)
    n = kwargs.get("max_new_tokens", 32)
    assert len(out.sequences) == len(rows)
    assert all(0 <= t < VOCAB for row in out.sequences for t in row)
    eos = kwargs.get("eos_token_id", None)
    no_eos = isinstance(eos, list) and not eos or eos is None and TARGET.generation_config.eos_token_id is None
    if no_eos:
        assert all(len(row) == n for row in out.sequences)
    if not kwargs.get("do_sample", False):
        reference = dict(max_new_tokens=n, eos_token_id=eos)
        assert out.sequences == REFERENCE.generate(rows, **reference).sequences


@SETTINGS
@given(data=st.data())
def test_generate_returns_an_exact_result_or_names_the_bad_argument(data):
    kwargs = {k: data.draw(v, label=k) for k, v in VALID.items() if data.draw(st.booleans(), label=f"pass {k}")}
    input_ids = data.draw(PROMPTS, label="input_ids")
    attention_mask = None
    bad = data.draw(st.sampled_from([None, "input_ids", "attention_mask", *VALID]), label="bad argument")
    if bad == "input_ids":
        input_ids = data.draw(BAD_PROMPTS, label="bad input_ids")
    elif bad == "attention_mask":
        attention_mask = data.draw(st.one_of(ODD, st.just([[1, 0]]), st.just(torch.ones(1, 2))), label="bad mask")
    elif bad is not None:
        kwargs[bad] = data.draw(ODD, label=f"bad {bad}")
    try:
        out = ENGINE.generate(input_ids, attention_mask=attention_mask, **kwargs)
    except (ValueError, TypeError) as error:
        assert bad is not None, f"valid arguments refused: {error}"
        assert_names(error, bad)
        return
    assert_exact(out, kwargs, input_ids, attention_mask)


CONSTRUCTOR = {
    "drafters": (st.one_of(ODD, st.just(["NGRAM"]), st.just(b"ngram"), st.just([None])),
                 ("drafter", "Drafter", "ngram", "neither a local")),
    "gammas": (ODD, ("gammas",)),
    "selector": (st.one_of(ODD, st.just("thompsen"), st.just("UCB1")), ("selector", "Selector")),
    "selector_options": (st.one_of(ODD, st.just({"windw": 3}), st.just({"seed": "x"}), st.just({"reward": "speed"})),
                         ("selector_options", "option", "seed", "reward", "window", "arm")),
    "share_selector": (ODD, ("share_selector",)),
    "tokenizer": (st.one_of(ODD, st.just(object())), ("tokenizer", "neither a local", "Could not load")),
    "device": (st.one_of(ODD, st.just("banana"), st.just("cuda:7")), ("device",)),
    "dtype": (st.one_of(ODD, st.just("float64x"), st.just(torch.int64)), ("dtype",)),
    "compile": (ODD, ("compile",)),
}


@SETTINGS
@given(data=st.data())
def test_the_constructor_builds_a_working_engine_or_names_the_bad_argument(data):
    argument = data.draw(st.sampled_from(sorted(CONSTRUCTOR)), label="argument")
    values, names = CONSTRUCTOR[argument]
    value = data.draw(values, label=argument)
    kwargs = {"drafters": ["ngram"], "selector": "ucb1"} | {argument: value}
    if argument == "gammas" or argument == "selector":
        kwargs["drafters"] = [DRAFT, "ngram"]
    try:
        engine = SpeculativeEngine(TARGET, **kwargs)
    except (ValueError, TypeError) as error:
        assert any(word in str(error) for word in names), f"{argument}={value!r}: {error}"
        return
    out = engine.generate([[1, 2, 3]], max_new_tokens=6, eos_token_id=[])
    assert out.sequences == REFERENCE.generate([[1, 2, 3]], max_new_tokens=6, eos_token_id=[]).sequences


FLAGS = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--num-draft-tokens", "--seed", "--dtype",
         "--device"]
FLAG_VALUES = st.one_of(st.sampled_from(["-1", "0", "nan", "inf", "-inf", "1e-9", "abc", "", "1.5", "99999999999",
                                         "cuda:9", "float64", "bfloat16"]),
                        st.text(alphabet="0123456789.-e", max_size=6))


@settings(max_examples=80, deadline=None)
@given(flag=st.sampled_from(FLAGS), value=FLAG_VALUES)
def test_the_command_line_reports_bad_flags_as_errors(flag, value):
    """With a target that does not exist, every outcome is an error exit (2) with a message: a
    bad flag's before the target's (argparse's own errors exit 2 too), never a traceback."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = main(["generate", "--target", "/nonexistent/model.gguf", "--prompt", "x", flag, value])
        except SystemExit as exit_:  # argparse: a value of the wrong type or choice
            code = exit_.code
    assert code == 2
    err = stderr.getvalue()
    assert "error" in err
    if flag == "--temperature" and _number(value) and not (math.isfinite(float(value)) and float(value) >= 0):
        assert "--temperature" in err and "does not exist" not in err  # before: decoded greedily, exit 0


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("bad", [10**6, 2**70])
def test_huge_values_are_refused_quickly(bad):
    """A value that would allocate terabytes, or overflow a C integer, is a ValueError naming it."""
    with pytest.raises(ValueError, match="num_draft_tokens"):
        ENGINE.generate([[1, 2]], num_draft_tokens=bad)
    with pytest.raises(ValueError, match="seed"):
        ENGINE.generate([[1, 2]], seed=bad * 2**70)
    with pytest.raises(ValueError, match="max_new_tokens|context window"):
        ENGINE.generate([[1, 2]], max_new_tokens=bad)
