"""The server's output text (``flashspec.serve.text``, SPEC.md §12): incremental decoding equals
the decode of all the tokens, and stop strings cost each token the same however long the output."""

from __future__ import annotations

import random

import pytest
from tiny_models import CharTokenizer

from flashspec.serve.text import MAX_STOP_CHARS, Detokenizer, StopText

TEXTS = ["def f(x):\n    return x * 2  # doubled\n", "naïve café — 東京 and 北京 😀😀 done.",
         "  spaces   and\ttabs\n\nnew lines ", "ünïcödé everywhere: ß, Ω, ж, 한국어, emoji 🎉🎈!"]


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE (as Qwen's and GPT-2's) trained here on a little text: its multi-byte
    characters are split over several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"])
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>")


class Counting(CharTokenizer):
    """Counts the ids each decode is given."""

    decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        Counting.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


def _stream(text: StopText, ids: list[int], rng: random.Random) -> tuple[str, bool]:
    """Feed ``ids`` in chunks of 1 to 5 (as steps commit them); the text released and whether it stopped."""
    out, at = [], 0
    while at < len(ids):
        n = rng.randint(1, 5)
        delta, stopped = text.add(ids[at:at + n])
        out.append(delta)
        at += n
        if stopped:
            return "".join(out), True
    delta, stopped = text.finish()
    return "".join(out) + delta, stopped


def test_incremental_text_equals_the_decode_of_all_tokens(byte_bpe):
    rng = random.Random(0)
    split = 0
    for source in TEXTS:
        ids = byte_bpe(source)["input_ids"]
        split += sum("\ufffd" in byte_bpe.decode(ids[:k]) for k in range(1, len(ids)))  # a character cut in two
        ids = ids[:5] + [byte_bpe.eos_token_id] + ids[5:]  # a special token, skipped as decode skips it
        text = StopText(byte_bpe, [])
        got, stopped = _stream(text, ids, rng)
        assert got == byte_bpe.decode(ids, skip_special_tokens=True) == source and not stopped
        assert text.tokens == len(ids)
    assert split >= 10


def test_an_unfinished_character_is_released_at_the_end_as_decode_shows_it(byte_bpe):
    ids = byte_bpe("ok 😀")["input_ids"][:-1]  # the emoji's last byte never comes
    detokenizer = Detokenizer(byte_bpe)
    text = "".join(detokenizer.add(t) for t in ids) + detokenizer.flush()
    assert text == byte_bpe.decode(ids) and text.endswith("\ufffd")


@pytest.mark.parametrize("seed", range(20))
def test_the_stop_string_completed_first_ends_the_text_and_the_tokens_of_the_text_returned_are_counted(
        byte_bpe, seed):
    """Whatever the steps' grouping of tokens: the text ends where a stop string is first
    completed (at a tie, the longer one starting earlier)."""
    rng = random.Random(seed)
    source = rng.choice(TEXTS) * 2
    ids = byte_bpe(source)["input_ids"]
    stops = []
    for _ in range(rng.randint(1, 4)):
        start = rng.randrange(len(source) - 1)
        stops.append(source[start:start + rng.randint(1, 6)])
    text = StopText(byte_bpe, stops)
    got, stopped = _stream(text, ids, rng)
    cut = min((source.find(s) + len(s), source.find(s)) for s in stops)[1]
    assert stopped and got == source[:cut]
    lengths = [len(byte_bpe.decode(ids[:k])) for k in range(len(ids) + 1)]
    fewest = next(k for k, n in enumerate(lengths) if n >= cut and "\ufffd" not in byte_bpe.decode(ids[:k])[cut - 1:cut])
    assert text.tokens == fewest


def test_a_long_stop_string_costs_time_proportional_to_the_new_text():
    """Each token decodes a window of a few ids (never the whole output), and what is searched
    for a stop string is only the held-back text plus the new: at most the longest stop string's
    length − 1 characters stay held between tokens, however long the output grows."""
    stops = ["\x01" * MAX_STOP_CHARS, "\x02" * 2_500, "zz top"]
    text = StopText(Counting(), stops)
    rng = random.Random(0)
    tokens = 0
    Counting.decoded = 0
    for _ in range(3_000):
        chunk = [rng.randrange(32, 120) for _ in range(rng.randint(1, 5))]
        tokens += len(chunk)
        _, stopped = text.add(chunk)
        assert not stopped and len(text.pending) <= text.hold == MAX_STOP_CHARS - 1
    assert Counting.decoded <= 4 * tokens  # two windows of at most two ids per token
    assert text.finish()[1] is False
    assert text.sent == tokens and text.released() == tokens


def test_without_stop_strings_text_is_released_at_once():
    text = StopText(CharTokenizer(), [])
    assert text.add([104, 105]) == ("hi", False) and text.released() == 2 and text.finish() == ("", False)
