"""Requests whose right answer quotes the prompt: code edits and extraction, cut from the corpus's held-out text.

* ``code-edit``: a held-out code snippet, cut at line boundaries, inside an instruction whose
  answer restates the whole code with small changes (:data:`CODE_EDIT_INSTRUCTIONS`).
* ``extraction``: a held-out prose snippet, cut at sentence or line boundaries, inside an
  instruction whose answer copies sentences of the text word for word (:data:`EXTRACTION_INSTRUCTIONS`).

On such requests much of the answer is already in the prompt, so drafting from the prompt's
n-grams pays where a model drafter pays on free text. Snippets come from the held-out last 5 %
of the corpus only (:func:`~flashspec.data.corpus.heldout_text`), never from the training part.
Instructions are cycled; the snippets are drawn with a fixed seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..checks import check_int
from .corpus import DOMAINS, heldout_text

__all__ = ["CODE_EDIT_INSTRUCTIONS", "EXTRACTION_INSTRUCTIONS", "QUOTING_SOURCES", "heldout_snippets",
           "quoting_messages"]

CODE_EDIT_INSTRUCTIONS = (
    "Add a docstring to every function and class in the following code and return the whole code, "
    "otherwise unchanged:\n```\n{s}\n```",
    "Add type hints to every function signature in the following code and return the complete code, "
    "otherwise unchanged:\n```\n{s}\n```",
    "Rename every variable with a one- or two-letter name in the following code to a descriptive name "
    "and return the complete code, otherwise unchanged:\n```\n{s}\n```",
    "Add a short comment above each block of the following code saying what it does, and return the "
    "whole code, otherwise unchanged:\n```\n{s}\n```",
)
EXTRACTION_INSTRUCTIONS = (
    "List, word for word, every sentence of the following text that contains a number or a name, "
    "one per line:\n\n{s}",
    "Return the following text as a numbered list of its sentences, unchanged:\n\n{s}",
    "Correct any spelling or punctuation mistakes in the following text and return it in full, "
    "otherwise unchanged:\n\n{s}",
)
# Per workload: the corpus domain its snippets come from, whether a snippet may also end at a
# sentence end (not only a line end), and its instructions.
QUOTING_SOURCES: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    "code-edit": ("code", False, CODE_EDIT_INSTRUCTIONS),
    "extraction": ("prose", True, EXTRACTION_INSTRUCTIONS),
}
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=[ \t])")


def _boundaries(text: str, start: int, stop: int, sentences: bool) -> list[int]:
    """Where a snippet starting at ``start`` may end, up to ``stop``: line ends, and sentence
    ends too where ``sentences``."""
    window = text[start:stop]
    ends = {start + m.start() for m in re.finditer("\n", window)}
    if stop >= len(text):
        ends.add(len(text))
    if sentences:
        ends.update(start + m.end() for m in _SENTENCE_END.finditer(window))
    return sorted(e for e in ends if e > start)


def heldout_snippets(corpus_dir: str | Path, domain: str, count: int, tokenizer: Any, *, seed: int = 0,
                     snippets: Sequence[int] = (192,), sentences: bool = False) -> list[str]:
    """``count`` snippets of the domain's held-out text, each from a random non-blank line start
    to the first line end (or sentence end, where ``sentences``) at which it holds at least
    ``snippets[i % len(snippets)]`` tokens; a start whose first such end is more than twice
    that long is drawn again, and so is a start already drawn while others remain. Fixed seed:
    the same snippets for the same corpus and tokenizer."""
    check_int("count", count, 1)
    if not snippets:
        raise ValueError("snippets must name at least one snippet length in tokens.")
    for n in snippets:
        check_int("snippet length", n, 1)
    if domain not in DOMAINS:
        raise ValueError(f"Unknown domain {domain!r}; choose from {', '.join(DOMAINS)}.")
    text = heldout_text(Path(corpus_dir), domain)
    starts = [m.start() for m in re.finditer(r"(?m)^[ \t]*\S", text)]
    top = [s for s in starts if not text[s].isspace()]  # code: prefer unindented lines
    candidates = top or starts
    if not candidates:
        raise ValueError(f"The held-out {domain} text holds no non-blank line.")
    rng = random.Random(f"quoting-{domain}-{seed}")
    out: list[str] = []
    used: set[int] = set()
    attempts = 0
    while len(out) < count:
        attempts += 1
        want = snippets[len(out) % len(snippets)]
        if attempts > 100 * count:
            raise ValueError(f"The held-out {domain} text is too short for snippets of {want} tokens.")
        start = rng.choice(candidates)
        if start in used and len(used) < len(candidates):
            continue  # another snippet while unused starts remain
        used.add(start)
        for end in _boundaries(text, start, start + 16 * want, sentences):
            snippet = text[start:end].rstrip()
            tokens = len(tokenizer(snippet)["input_ids"])
            if tokens >= want:
                if tokens <= 2 * want:
                    out.append(snippet)
                break
    return out


def quoting_messages(workload: str, corpus_dir: str | Path, count: int, tokenizer: Any, *, seed: int = 0,
                     snippets: Sequence[int] = (192,)) -> list[str]:
    """The user messages of ``count`` ``workload`` requests (:data:`QUOTING_SOURCES`): request
    ``i`` is instruction ``i`` (cycled) around a held-out snippet whose length in tokens cycles
    through ``snippets`` every full round of instructions."""
    if workload not in QUOTING_SOURCES:
        raise ValueError(f"Unknown quoting workload {workload!r}; choose from {', '.join(QUOTING_SOURCES)}.")
    check_int("count", count, 1)
    domain, sentences, instructions = QUOTING_SOURCES[workload]
    path = Path(corpus_dir) / DOMAINS[domain]
    if not path.is_file():
        raise ValueError(f"The {workload} workload needs the corpus's {domain} file {path}; it is not there.")
    lengths = [snippets[(i // len(instructions)) % len(snippets)] for i in range(count)] if snippets else []
    cut = heldout_snippets(corpus_dir, domain, count, tokenizer, seed=seed, snippets=lengths, sentences=sentences)
    return [instructions[i % len(instructions)].format(s=s) for i, s in enumerate(cut)]
