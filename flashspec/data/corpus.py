"""The three-domain corpus the benchmarks draw on: held-out prompts and training text.

Each domain is one xz-compressed text file of ``shared/corpus`` (:data:`DOMAINS`). Its last 5 %
of decompressed bytes (from the first line start after the 95 % mark, :data:`HELDOUT_FRACTION`)
is held out: no training script reads it, and benchmark prompts come from there
(:func:`heldout_prompts`). The 5 % just before it is training text that learners may warm up on
(``part="train"``); training data is cut from the first 90 % (``part="fit"``), and :func:`training_text` / :func:`store_drafters` index the end of the
first 95 % for retrieval drafters. :func:`chat_requests` wraps snippets of the same text in a
user instruction and the tokenizer's chat template (requests as a chat model receives them).
"""

from __future__ import annotations

import lzma
import random
import re
from pathlib import Path
from typing import Any

from ..checks import check_int

__all__ = ["CHAT_INSTRUCTIONS", "DOMAINS", "HELDOUT_FRACTION", "chat_ids", "chat_requests", "heldout_prompts", "heldout_text",
           "store_drafters", "training_text"]

DOMAINS = {"code": "code.txt.xz", "prose": "prose.txt.xz", "chat": "dialogue.txt.xz"}
HELDOUT_FRACTION = 0.05
# The user instructions a chat request wraps its snippet ({s}) in, per domain: continuations and
# free-form tasks, so that answers range from near-copies of the snippet to new text.
CHAT_INSTRUCTIONS = {
    "code": (
        "Complete this code:\n```\n{s}\n```",
        "Explain what this code does:\n```\n{s}\n```",
        "Write a function in the same style as:\n```\n{s}\n```",
        "Write unit tests for:\n```\n{s}\n```",
    ),
    "prose": (
        "Continue this passage:\n{s}",
        "Summarize this text:\n{s}",
        "Write a short story that begins like this:\n{s}",
        "What do you think the author wants the reader to feel here, and why?\n{s}",
    ),
    "chat": (
        "{s}\n\nContinue this conversation.",
        "{s}\n\nReply as the next speaker.",
        "{s}\n\nWhat advice would you give here?",
    ),
}


def _split(corpus_dir: Path, domain: str) -> tuple[bytes, int]:
    """The domain's decompressed corpus file and where its held-out part (a line start) begins."""
    if domain not in DOMAINS:
        raise ValueError(f"Unknown domain {domain!r}; choose from {', '.join(DOMAINS)}.")
    path = Path(corpus_dir) / DOMAINS[domain]
    if not path.is_file():
        raise ValueError(f"Corpus file {path} not found; pass --corpus pointing at shared/corpus.")
    data = lzma.decompress(path.read_bytes())
    return data, data.index(b"\n", int(len(data) * (1 - HELDOUT_FRACTION))) + 1


def heldout_text(corpus_dir: Path, domain: str, part: str = "heldout") -> str:
    """The last 5 % of the domain's corpus file (decompressed), cut at a line start.
    ``part="train"``: the 5 % just before it instead (inside the 95 % that training may read),
    for warming up learners without touching the evaluation text. ``part="fit"``: the first
    90 %, the only text a drafter's training data may be cut from."""
    if part not in ("heldout", "train", "fit"):
        raise ValueError(f"part must be 'heldout', 'train' or 'fit', got {part!r}.")
    data, cut = _split(corpus_dir, domain)
    if part == "heldout":
        return data[cut:].decode("utf-8", errors="replace")
    begin = data.index(b"\n", int(len(data) * (1 - 2 * HELDOUT_FRACTION))) + 1
    if part == "fit":
        return data[:begin].decode("utf-8", errors="replace")
    return data[begin:cut].decode("utf-8", errors="replace")


def _line_starts(text: str) -> list[int]:
    """Where each line of ``text`` begins (not past its end)."""
    return [0] + [m.end() for m in re.finditer("\n", text) if m.end() < len(text)]


def training_text(corpus_dir: Path, domain: str, max_bytes: int = 4_000_000) -> str:
    """The last ``max_bytes`` of the domain's training part (the first 95 %, cut at line
    starts): text a retrieval drafter may index without seeing the held-out prompts."""
    check_int("max_bytes", max_bytes, 1)
    data, cut = _split(corpus_dir, domain)
    begin = max(0, cut - max_bytes)
    if begin:
        begin = data.index(b"\n", begin) + 1
    return data[begin:cut].decode("utf-8", errors="replace")


def store_drafters(specs: list[str], corpus_dir: Path, tokenizer: Any, max_bytes: int = 4_000_000) -> list[Any]:
    """``"store:DOMAIN"`` entries of ``specs`` become :class:`DatastoreDrafter` objects named
    ``store-DOMAIN`` over that domain's training text; other entries pass through."""
    from ..drafters import DatastoreDrafter

    out = []
    for spec in specs:
        if isinstance(spec, str) and spec.startswith("store:"):
            domain = spec.split(":", 1)[1]
            text = training_text(corpus_dir, domain, max_bytes)
            out.append(DatastoreDrafter.from_text(text, tokenizer, name=f"store-{domain}"))
        else:
            out.append(spec)
    return out


def heldout_prompts(
    corpus_dir: Path, domain: str, count: int, prompt_tokens: int, tokenizer: Any, seed: int = 0,
    part: str = "heldout",
) -> list[list[int]]:
    """``count`` prompts of ``prompt_tokens`` tokens, each starting at a random line of the
    held-out text (fixed seed); ``part="train"`` or ``"fit"`` cuts them from that part instead
    (:func:`heldout_text`)."""
    text = heldout_text(corpus_dir, domain, part)
    line_starts = _line_starts(text)
    rng = random.Random(f"{domain}-{seed}")
    prompts = []
    while len(prompts) < count:
        start = rng.choice(line_starts[: int(len(line_starts) * 0.9)])
        ids = tokenizer(text[start : start + 8 * prompt_tokens])["input_ids"][:prompt_tokens]
        if len(ids) == prompt_tokens:
            prompts.append(ids)
    return prompts


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` through the tokenizer's chat template with the generation prompt: token ids
    (whether the tokenizer returns a list, a tensor or a BatchEncoding)."""
    if not hasattr(tokenizer, "apply_chat_template") or getattr(tokenizer, "chat_template", "") is None:
        raise ValueError("Chat requests need a tokenizer with a chat template; this one has none "
                         "(use style 'text', or a chat model's tokenizer).")
    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    except ValueError as error:
        raise ValueError(f"Chat requests need a tokenizer with a chat template: {error}") from None
    if hasattr(ids, "keys"):  # BatchEncoding / dict
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one conversation
        ids = ids[0]
    return [int(t) for t in ids]


def _chat_ids(tokenizer: Any, content: str) -> list[int]:
    """One user message through the chat template (:func:`chat_ids`)."""
    return chat_ids(tokenizer, [{"role": "user", "content": content}])


def chat_requests(
    corpus_dir: Path, domain: str, count: int, tokenizer: Any, seed: int = 0, part: str = "heldout",
    snippet_tokens: int = 192,
) -> list[list[int]]:
    """``count`` chat-formatted requests: each a random line-start snippet of ``snippet_tokens``
    tokens of the domain's held-out text (``part="train"`` or ``"fit"``: that part, as in
    :func:`heldout_prompts`) inside a user instruction drawn from :data:`CHAT_INSTRUCTIONS`,
    tokenized through the tokenizer's chat template with the generation prompt (fixed seed)."""
    check_int("count", count, 1)
    check_int("snippet_tokens", snippet_tokens, 1)
    text = heldout_text(corpus_dir, domain, part)
    _chat_ids(tokenizer, "")  # no chat template: say so before cutting snippets
    line_starts = _line_starts(text)
    candidates = line_starts[: max(1, int(len(line_starts) * 0.9))]
    rng = random.Random(f"chat-{domain}-{seed}")
    requests: list[list[int]] = []
    attempts = 0
    while len(requests) < count:
        attempts += 1
        if attempts > 100 * count:
            raise ValueError(f"The {part} text of {domain!r} is too short for snippets of {snippet_tokens} tokens.")
        start = rng.choice(candidates)
        template = rng.choice(CHAT_INSTRUCTIONS[domain])
        ids = tokenizer(text[start : start + 8 * snippet_tokens])["input_ids"][:snippet_tokens]
        if len(ids) < snippet_tokens:
            continue
        snippet = tokenizer.decode(ids, skip_special_tokens=True).strip("\n")
        requests.append(_chat_ids(tokenizer, template.format(s=snippet)))
    return requests
