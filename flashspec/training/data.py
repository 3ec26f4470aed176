"""Training data: text files cut so that the held-out part is never read, tokenized once; and
distilled folders, already token ids.

Each file's text (``.txt`` or ``.xz``) is cut like the corpus (:mod:`flashspec.data.corpus`):
the last 5 % (from a line start) is never read. Training takes the first 90 %; the 5 % between
is where the progress bar's acceptance estimate comes from. A distilled folder
(``flashspec distill --out DIR``, :mod:`~flashspec.training.shards`) splits its samples into a
train and an estimate part itself (:func:`flashspec.data.sharegpt.part_of`).
"""

from __future__ import annotations

import hashlib
import lzma
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .shards import is_distilled, load_distilled, read_manifest

__all__ = ["check_data", "distilled_chunks", "draft_vocab", "read_text", "token_chunks", "training_chunks"]

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
    return _cut([np.asarray(_tokenized(text, tokenizer, cache), dtype=np.int64) for text in texts], seq_len)


def check_data(paths: list[str | Path]) -> None:
    """A ``ValueError`` for any of ``paths`` that is neither a readable text file nor a distilled
    folder (before a target is loaded)."""
    for path in paths:
        if is_distilled(path):
            read_manifest(path)
        elif Path(path).is_dir():
            raise ValueError(f"Training data folder {str(path)!r} has no manifest.json: it is not a distilled "
                             "folder (flashspec distill --out DIR makes one).")
        else:
            read_text(path, "train")


def training_chunks(paths: list[str | Path], tokenizer: Any, seq_len: int, part: str = "train",
                    cache: str | Path | None = None) -> torch.Tensor:
    """``[N, seq_len]`` token ids from ``paths`` (text files and distilled folders, mixed), joined
    and cut into whole chunks: the ``part`` (``"train"`` or ``"estimate"``) of each."""
    pieces: list[np.ndarray] = []
    for path in paths:
        if is_distilled(path):
            _check_tokenizer(path, tokenizer)
            pieces += [sample.ids.astype(np.int64) for sample in load_distilled(path, part)]
        else:
            pieces.append(np.asarray(_tokenized(read_text(path, part), tokenizer, cache), dtype=np.int64))
    return _cut(pieces, seq_len, f"The training data's {part} part")


def distilled_chunks(folder: str | Path, seq_len: int, part: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """A distilled folder's samples of ``part``, joined and cut into ``[N, seq_len]`` token ids and
    the matching loss mask (True on the target's answer tokens), for a loss over answers only."""
    samples = list(load_distilled(folder, part))
    what = f"The {part} part of {str(folder)!r}"
    return _cut([s.ids.astype(np.int64) for s in samples], seq_len, what), _cut([s.mask for s in samples], seq_len, what)


def _check_tokenizer(folder: str | Path, tokenizer: Any) -> None:
    made = read_manifest(folder)["identity"].get("tokenizer", {}).get("size")
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    if made is not None and size is not None and made != size:
        raise ValueError(f"{str(folder)!r} was distilled with a tokenizer of {made} tokens; this one has {size}: "
                         "its token ids mean other text here.")


def _cut(pieces: list[np.ndarray], seq_len: int, what: str = "The training data") -> torch.Tensor:
    """``pieces`` joined and cut into whole ``[N, seq_len]`` chunks (the rest dropped)."""
    joined = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    count = len(joined) // seq_len
    if count == 0:
        raise ValueError(f"{what} holds {len(joined)} tokens, fewer than one sequence of {seq_len}.")
    return torch.from_numpy(joined[: count * seq_len].copy()).view(count, seq_len)


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
