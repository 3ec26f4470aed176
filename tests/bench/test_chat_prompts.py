"""Chat-formatted benchmark requests (flashspec.data.corpus.chat_requests), ``bench e2e --style
chat`` and ``bench e2e`` with drafters made from the target (``early-exit:N``, ...)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_tokenizer import ChatCharTokenizer, save_tiny_chat_pair
from tiny_models import CharTokenizer, tiny_model, write_tiny_corpus

from flashspec.bench import e2e as bench_e2e
from flashspec.data.corpus import (
    CHAT_INSTRUCTIONS,
    DOMAINS,
    chat_requests,
    heldout_text,
)
from flashspec.bench.e2e import Regime, make_prompts
from flashspec.cli import main

QWEN = Path(__file__).resolve().parents[2].parent / "shared" / "tokenizers" / "qwen2.5"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"), lines=1500)


def _text(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def _snippet(domain: str, ids: list[int]) -> str:
    """The corpus snippet inside a chat request (checking the template and the instruction)."""
    text = _text(ids)
    assert text.startswith("<u>") and text.endswith("</u><a>")
    content = text[3:-7]
    matched = [t for t in CHAT_INSTRUCTIONS[domain] if content.startswith(t.split("{s}")[0])
               and content.endswith(t.split("{s}")[1])]
    assert matched, content
    prefix, suffix = matched[0].split("{s}")
    return content[len(prefix): len(content) - len(suffix)]


def test_chat_requests_wrap_heldout_snippets_in_instructions(corpus):
    for as_list in (False, True):  # a BatchEncoding-like dict or a plain list from apply_chat_template
        tok = ChatCharTokenizer(as_list=as_list)
        for domain in DOMAINS:
            requests = chat_requests(corpus, domain, 6, tok, snippet_tokens=20)
            assert len(requests) == 6
            held = heldout_text(corpus, domain)
            for ids in requests:
                snippet = _snippet(domain, ids)
                assert len(snippet) >= 18 and snippet in held
            assert chat_requests(corpus, domain, 6, tok, snippet_tokens=20) == requests  # seeded
    train = heldout_text(corpus, "code", part="train")
    for ids in chat_requests(corpus, "code", 4, ChatCharTokenizer(), part="train", snippet_tokens=20):
        assert _snippet("code", ids) in train


def test_chat_requests_need_a_chat_template(corpus):
    with pytest.raises(ValueError, match="chat template"):
        chat_requests(corpus, "prose", 2, CharTokenizer())

    class NoTemplate(ChatCharTokenizer):
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        chat_requests(corpus, "prose", 2, NoTemplate())
    for bad in ({"count": 0}, {"snippet_tokens": 0}):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            chat_requests(corpus, "prose", **{"count": 2, "tokenizer": ChatCharTokenizer(), **bad})


@pytest.mark.skipif(not QWEN.is_dir(), reason="no Qwen tokenizer in shared/tokenizers")
def test_chat_requests_with_a_real_chat_template(corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN)
    (ids,) = chat_requests(corpus, "chat", 1, tok, snippet_tokens=24)
    text = tok.decode(ids)
    assert "<|im_start|>user\n" in text and text.endswith("<|im_start|>assistant\n")


def test_make_prompts_chat_style_keeps_requests_whole(corpus):
    regimes = {"long": Regime(24, 40, 12), "short": Regime(8, 8, 6)}
    prompts = make_prompts(regimes, 2, tokenizer=ChatCharTokenizer(), corpus=corpus, style="chat")
    assert prompts["long"] == prompts["short"]
    for ps in prompts["short"].values():
        assert all(_text(p).endswith("</u><a>") and len(p) > 8 for p in ps)
    assert make_prompts(regimes, 2, tokenizer=ChatCharTokenizer(), corpus=corpus) != prompts  # text: the default
    with pytest.raises(ValueError, match="style must be one of"):
        make_prompts(regimes, 2, tokenizer=ChatCharTokenizer(), corpus=corpus, style="poem")


def test_drafter_names_of_self_drafters():
    assert bench_e2e.drafter_name("early-exit:2") == "early-exit-2"
    assert bench_e2e.drafter_name("feature:runs/eagle1/") == "feature-eagle1"
    assert bench_e2e.drafter_name("shallow:/x/sh") == "shallow-sh"
    assert bench_e2e.drafter_name("ngram") == "ngram"


def test_e2e_runs_drafters_made_from_the_target(corpus):
    torch.set_num_threads(1)
    regimes = {"short": Regime(8, 8, 6)}
    prompts = make_prompts(regimes, 2, tokenizer=ChatCharTokenizer(), corpus=corpus, style="chat")
    results = bench_e2e.run(tiny_model("llama"), {"early-exit-1": "early-exit:1", "ngram": "ngram"}, prompts,
                            regimes, systems=["flashspec", "flashspec-fixed", "flashspec-bandit"], gammas=[2],
                            progress=False)
    assert [s["name"] for s in results["systems"]] == ["flashspec", "flashspec early-exit-1@2",
                                                       "flashspec ngram@2", "flashspec bandit"]
    assert next(s for s in results["systems"] if s["name"] == "flashspec bandit")["arms"] == [
        "early-exit-1@2", "ngram@2"]
    cell = results["cells"][0]
    assert "early-exit-1" in cell["forward_costs"]["not_timed"] and "ngram" in cell["forward_costs"]["drafters"]
    rows = {(r["system"], r["domain"]): r for r in cell["summary"]}
    assert "predicted" not in rows[("flashspec early-exit-1@2", "all")]
    assert "predicted" in rows[("flashspec ngram@2", "all")]
    assert all(g["differing"] == [] for g in cell["greedy"]["systems"].values())
    assert bench_e2e.summarize(results)


def test_cli_e2e_chat_style_with_early_exit(corpus, tmp_path, capsys):
    target, _ = save_tiny_chat_pair(tmp_path)
    out = tmp_path / "out"
    rc = main(["bench", "e2e", "--target", str(target), "--draft", "early-exit:1", "--corpus", str(corpus),
               "--prompts-per-domain", "1", "--regimes", "short", "--style", "chat", "--snippet-tokens", "16",
               "--systems", "flashspec,flashspec-fixed", "--gammas", "2", "--device", "cpu", "--dtype", "float32",
               "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads((out / "e2e.json").read_text())
    assert saved["settings"]["style"] == "chat"
    assert [s["name"] for s in saved["systems"]] == ["flashspec", "flashspec early-exit-1@2"]
    assert all(len(c["prompt_tokens"]) == 1 and c["prompt_tokens"][0] > 8 for c in saved["cells"][0]["calls"])
    assert "chat-formatted requests" in (out / "e2e.md").read_text()
    assert main(["bench", "e2e", "--shaped", "--style", "chat", "--no-progress"]) == 2
    assert "--style chat needs corpus prompts" in capsys.readouterr().err
