"""The three-domain corpus the benchmarks draw on: held-out prompts and training text.

Each domain is one xz-compressed text file of ``shared/corpus`` (:data:`DOMAINS`). Its last 5 %
of decompressed bytes (from the first line start after the 95 % mark, :data:`HELDOUT_FRACTION`)
is held out: no training script reads it, and benchmark prompts come from there
(:func:`heldout_prompts`). The 5 % just before it is training text that learners may warm up on
(``part="train"``), and :func:`training_text` / :func:`store_drafters` index the end of the
first 95 % for retrieval drafters.
"""

from __future__ import annotations

import lzma
import random
from pathlib import Path
from typing import Any

__all__ = ["DOMAINS", "HELDOUT_FRACTION", "heldout_prompts", "heldout_text", "store_drafters", "training_text"]

DOMAINS = {"code": "code.txt.xz", "prose": "prose.txt.xz", "chat": "dialogue.txt.xz"}
HELDOUT_FRACTION = 0.05


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
    for warming up learners without touching the evaluation text."""
    if part not in ("heldout", "train"):
        raise ValueError(f"part must be 'heldout' or 'train', got {part!r}.")
    data, cut = _split(corpus_dir, domain)
    if part == "heldout":
        return data[cut:].decode("utf-8", errors="replace")
    begin = data.index(b"\n", int(len(data) * (1 - 2 * HELDOUT_FRACTION))) + 1
    return data[begin:cut].decode("utf-8", errors="replace")


def training_text(corpus_dir: Path, domain: str, max_bytes: int = 4_000_000) -> str:
    """The last ``max_bytes`` of the domain's training part (the first 95 %, cut at line
    starts): text a retrieval drafter may index without seeing the held-out prompts."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be an integer >= 1; got {max_bytes!r}.")
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
    held-out text (fixed seed); ``part="train"`` cuts them from training text instead."""
    text = heldout_text(corpus_dir, domain, part)
    line_starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
    rng = random.Random(f"{domain}-{seed}")
    prompts = []
    while len(prompts) < count:
        start = rng.choice(line_starts[: int(len(line_starts) * 0.9)])
        ids = tokenizer(text[start : start + 8 * prompt_tokens])["input_ids"][:prompt_tokens]
        if len(ids) == prompt_tokens:
            prompts.append(ids)
    return prompts
