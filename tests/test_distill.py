"""Self-distilled training text (flashspec/training/distill.py): the target's answers to prompts from the
corpus's first 90 % only — never the 5 % after it nor the held-out 5 % — written as one text file; the CLI."""

from __future__ import annotations

import argparse
import lzma

import pytest
import torch
from chat_tokenizer import ChatCharTokenizer, save_tiny_chat_pair
from tiny_models import tiny_model, write_tiny_corpus

from flashspec.data.corpus import DOMAINS, chat_requests, heldout_prompts
from flashspec.cli.train import add_parsers
from flashspec.training.distill import distill, write_distilled

MARK = "QQQQQ"  # replaces "alpha" (same length: the cuts stay put) in the last 10 % only


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = write_tiny_corpus(tmp_path_factory.mktemp("corpus"), lines=1500)
    for name in DOMAINS.values():
        data = lzma.decompress((folder / name).read_bytes())
        cut = data.index(b"\n", int(len(data) * 0.90)) + 1
        held = data[cut:].replace(b"alpha", MARK.encode())
        assert MARK.encode() in held
        (folder / name).write_bytes(lzma.compress(data[:cut] + held))
    return folder


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model("llama", seed=0)


@pytest.mark.parametrize("style", ["chat", "text"])
def test_documents_are_training_prompts_with_the_targets_answers(corpus, target, style):
    tok = ChatCharTokenizer()
    docs = distill(target, tok, corpus, "prose", 5, style=style, max_new_tokens=8, batch=2, progress=False,
                   prompt_tokens=40)
    assert len(docs) == 5
    if style == "chat":
        prompts = chat_requests(corpus, "prose", 5, tok, part="fit", snippet_tokens=40)
    else:
        prompts = heldout_prompts(corpus, "prose", 5, 40, tok, part="fit")
    for doc, prompt in zip(docs, prompts):
        text = tok.decode(prompt)
        assert doc.startswith(text) and len(doc) == len(text) + 8  # no EOS: every answer is 8 tokens
        assert MARK not in doc
    if style == "chat":
        assert all("</u><a>" in doc for doc in docs)


def test_nothing_past_the_first_90_percent_is_ever_used(corpus, target):
    tok = ChatCharTokenizer()
    for domain in DOMAINS:
        docs = distill(target, tok, corpus, domain, 12, max_new_tokens=2, batch=12, progress=False,
                      prompt_tokens=40)
        assert not any(MARK in d for d in docs)


def test_write_distilled_and_errors(corpus, target, tmp_path):
    path = write_distilled(["one doc", "two\ndoc"], tmp_path / "sub" / "d.txt")
    assert path.read_text() == "one doc\n\ntwo\ndoc\n"
    with pytest.raises(ValueError, match=r"\.txt"):
        write_distilled(["x"], tmp_path / "d.json")
    tok = ChatCharTokenizer()
    for bad, message in (({"count": 0}, "count"), ({"batch": 0}, "batch"), ({"max_new_tokens": 0}, "max_new_tokens"),
                         ({"temperature": -1.0}, "temperature"), ({"style": "poem"}, "style")):
        kwargs = {"count": 2, **bad}
        with pytest.raises(ValueError, match=message):
            distill(target, tok, corpus, "code", progress=False, **kwargs)
    with pytest.raises(ValueError, match="Unknown domain"):
        distill(target, tok, corpus, "poetry", 2, progress=False)


def test_add_parser_registers_the_command():
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["distill", "--target", "t", "--out", "x.txt", "--domain", "code", "--count", "3"])
    assert args.run.__name__ == "distill_command" and args.count == 3 and args.style == "chat" and args.batch == 64


def test_cli_end_to_end(corpus, tmp_path, capsys):
    from flashspec.cli import main
    target_dir, _ = save_tiny_chat_pair(tmp_path)
    out = tmp_path / "distilled.txt"
    rc = main(["distill", "--target", str(target_dir), "--corpus", str(corpus), "--domain", "all", "--count", "2",
               "--max-new-tokens", "4", "--batch", "2", "--prompt-tokens", "24", "--device", "cpu", "--dtype", "float32",
               "--out", str(out),
               "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    text = out.read_text()
    assert text.count("<a>") == 2 * len(DOMAINS) and MARK not in text
    assert main(["distill", "--target", "/nonexistent", "--count", "0", "--out", str(out)]) == 2
    assert "count must be" in capsys.readouterr().err
