"""The code-edit and extraction workloads (``flashspec.data.quoting`` through
``flashspec.data.workloads``): held-out snippets cut at line or sentence boundaries, inside
instructions cycled, never from the training text. A corpus of numbered lines shows where each
snippet came from; no network."""

from __future__ import annotations

import lzma
import re
from pathlib import Path

from test_workloads import role_tokenizer

from flashspec.data import quoting, workloads
from flashspec.data.corpus import DOMAINS, heldout_text


def numbered_corpus(folder: Path, lines: int = 4000) -> Path:
    """Corpus files whose every line is unique: code (a function every fourth line, its body
    indented), prose (three sentences a line) and dialogue."""
    text = {
        "code": [f"def f{i}(a, b):" if i % 4 == 0 else f"    v{i} = a + b * {i}" for i in range(lines)],
        "prose": [f"Line {i} has a name. It has a number too! Then it ends {i}." for i in range(lines)],
        "chat": [f"A: line {i}" for i in range(lines)],
    }
    folder.mkdir(exist_ok=True)
    for domain, name in DOMAINS.items():
        (folder / name).write_bytes(lzma.compress("\n".join(text[domain]).encode()))
    return folder


def training_lines(corpus: Path, domain: str) -> set[str]:
    return set((heldout_text(corpus, domain, "fit") + heldout_text(corpus, domain, "train")).splitlines())


def snippets_of(tok, requests, instructions) -> list[str]:
    """Each request's snippet, checked to sit in its instruction (cycled) through the chat template."""
    out = []
    for i, r in enumerate(requests):
        text = tok.decode(r.ids)
        before, after = instructions[i % len(instructions)].split("{s}")
        assert text.startswith("<user>" + before) and text.endswith(after + "</user><assistant>")
        out.append(text[len("<user>" + before): len(text) - len(after + "</user><assistant>")])
    return out


def test_code_edit_quotes_held_out_code_cut_at_line_boundaries(tmp_path):
    tok = role_tokenizer()
    corpus = numbered_corpus(tmp_path / "corpus")
    requests = workloads.load("code-edit", tok, count=8, corpus=corpus, snippets=(120,))
    assert [(r.workload, r.category, r.name) for r in requests[:2]] == [("code-edit", "code-edit", "code-edit/0"),
                                                                       ("code-edit", "code-edit", "code-edit/1")]
    snippets = snippets_of(tok, requests, quoting.CODE_EDIT_INSTRUCTIONS)  # four instructions, cycled twice
    heldout, train = heldout_text(corpus, "code"), training_lines(corpus, "code")
    assert len(set(snippets)) == 8
    for s in snippets:
        lines = s.split("\n")
        assert f"\n{s}\n" in heldout and not set(lines) & train  # whole lines of the held-out text only
        assert lines[0].startswith("def ")  # an unindented line where there is one
        assert 120 <= len(s) < 120 + max(map(len, lines)) + 1  # one token per character here
    numbers = [int(n) for s in snippets for n in re.findall(r"\d+", s) if int(n) > 9]
    assert min(numbers) >= 0.95 * 4000  # the last 5 %


def test_extraction_quotes_held_out_prose_cut_at_sentence_ends(tmp_path):
    tok = role_tokenizer()
    corpus = numbered_corpus(tmp_path / "corpus")
    requests = workloads.load("extraction", tok, count=6, corpus=corpus, snippets=(30, 140))
    assert {(r.workload, r.category) for r in requests} == {("extraction", "text-extraction")}
    snippets = snippets_of(tok, requests, quoting.EXTRACTION_INSTRUCTIONS)  # three instructions, cycled twice
    heldout, train = heldout_text(corpus, "prose"), training_lines(corpus, "prose")
    for s in snippets:
        assert f"\n{s}" in heldout and not set(s.split("\n")) & train
    # 30 tokens end in the middle of the line, at its second sentence; 140 span lines
    assert all(re.fullmatch(r"Line \d+ has a name\. It has a number too!", s) for s in snippets[:3])
    assert all(s.count("\n") >= 1 and s.endswith((".", "!")) and 140 <= len(s) for s in snippets[3:])


def test_the_snippets_are_fixed_by_the_seed(tmp_path):
    tok = role_tokenizer()
    corpus = numbered_corpus(tmp_path / "corpus")
    for workload in ("code-edit", "extraction"):
        first = workloads.load(workload, tok, count=4, corpus=corpus, snippets=(40,))
        assert [r.ids for r in workloads.load(workload, tok, count=4, corpus=corpus, snippets=(40,))] == [
            r.ids for r in first]
        assert [r.ids for r in workloads.load(workload, tok, count=2, corpus=corpus, snippets=(40,))] == [
            r.ids for r in first[:2]]  # a longer list begins with the shorter one
        assert [r.ids for r in workloads.load(workload, tok, count=4, corpus=corpus, snippets=(40,), seed=1)] != [
            r.ids for r in first]
    described = workloads.describe("code-edit", workloads.load("code-edit", tok, count=3, corpus=corpus))
    assert described == "code-edit, 3 requests: 3 code-edit requests (held-out code)"
