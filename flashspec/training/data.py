"""Training text: files cut so that the held-out part is never read, and tokenized once.

Each file's text (``.txt`` or ``.xz``) is cut like the corpus (:mod:`flashspec.data.corpus`):
the last 5 % (from a line start) is never read. Training takes the first 90 %; the 5 % between
is where the progress bar's acceptance estimate comes from.
"""

from __future__ import annotations

import hashlib
import lzma
from pathlib import Path
from typing import Any

import torch

__all__ = ["draft_vocab", "read_text", "token_chunks"]

HELDOUT = 0.05  # never read
ESTIMATE = 0.05  # just before it: the acceptance estimate's text


def read_text(path: str | Path, part: str = "train") -> str:
    """The text of ``path`` (``.xz`` decompressed): ``part="train"`` its first 90 %, ``"estimate"``
    the 5 % after that; the last 5 % is never returned. Cuts are at line starts."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Training data file {str(path)!r} does not exist.")
    data = path.read_bytes()
    if path.suffix == ".xz":
        try:
            data = lzma.decompress(data)
        except lzma.LZMAError as error:
            raise ValueError(f"Training data file {str(path)!r} is not a valid .xz file: {error}") from None

    def cut(fraction: float) -> int:
        at = data.find(b"\n", int(len(data) * fraction))
        return len(data) if at < 0 else at + 1

    end = cut(1 - HELDOUT)
    middle = cut(1 - HELDOUT - ESTIMATE)
    if part == "train":
        return data[:middle].decode("utf-8", errors="replace")
    if part == "estimate":
        return data[middle:end].decode("utf-8", errors="replace")
    raise ValueError(f"part must be 'train' or 'estimate'; got {part!r}.")


def token_chunks(texts: list[str], tokenizer: Any, seq_len: int, cache: str | Path | None = None) -> torch.Tensor:
    """``[N, seq_len]`` token ids: the texts tokenized, joined and cut into whole chunks.

    ``cache``: a folder keeping each text's ids (keyed by its sha256 and the tokenizer's name and
    size), so that training several drafters on the same files tokenizes them once."""
    ids: list[int] = []
    for text in texts:
        ids.extend(_tokenized(text, tokenizer, cache))
    count = len(ids) // seq_len
    if count == 0:
        raise ValueError(f"The training data holds {len(ids)} tokens, fewer than one sequence of {seq_len}.")
    return torch.tensor(ids[: count * seq_len]).view(count, seq_len)


PIECE = 1 << 18  # characters per piece a long text is tokenized in (at line starts, in one batch)


def _tokenize(text: str, tokenizer: Any) -> list[int]:
    """``text``'s ids, tokenized in pieces cut at line starts, as one batch (a fast tokenizer
    spreads a batch over its threads); a piece boundary only ever falls before a line."""
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + PIECE)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    if len(pieces) <= 1:
        return tokenizer(text)["input_ids"]
    return [i for ids in tokenizer(pieces)["input_ids"] for i in ids]


def _tokenized(text: str, tokenizer: Any, cache: str | Path | None) -> list[int]:
    if cache is None:
        return _tokenize(text, tokenizer)
    key = hashlib.sha256(text.encode("utf-8", errors="replace"))
    key.update(f"{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}".encode())
    path = Path(cache) / f"{key.hexdigest()[:32]}.pt"
    if path.is_file():
        try:
            return torch.load(path).tolist()
        except Exception:  # noqa: BLE001 - a damaged cache entry is tokenized again
            pass
    ids = _tokenize(text, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(torch.tensor(ids, dtype=torch.int32), path)
    return ids


def draft_vocab(chunks: torch.Tensor, size: int, always: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``chunks`` (ties: lower id first), plus ``always``
    (e.g. the end-of-sequence ids): a reduced draft vocabulary (SPEC.md §11.4)."""
    counts = torch.bincount(chunks.flatten())
    order = torch.argsort(-counts, stable=True)  # most frequent first, ties by id
    chosen = set(always)
    for token in order[counts[order] > 0].tolist():  # only tokens that occur
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)
