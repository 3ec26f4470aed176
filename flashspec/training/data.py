"""Training data: text files cut so that the held-out part is never read, tokenized once; and
distilled folders, already token ids with a loss mask.

Each file's text (``.txt`` or ``.xz``) is cut like the corpus (:mod:`flashspec.data.corpus`):
the last 5 % (from a line start) is never read. Training takes the first 90 %; the 5 % between
is where the progress bar's acceptance estimate comes from. A distilled folder
(``flashspec distill --out DIR``, :mod:`~flashspec.training.shards`) splits its samples into a
train and an estimate part itself (:func:`flashspec.data.sharegpt.part_of`).

Chunks come with a loss mask (SPEC.md §11, "Training data in the target's own words"). Text
files are joined and cut into chunks, every token a target. A distilled sample keeps its own
rows (:func:`sample_windows`): a chunk never holds two samples, so an answer is only ever scored
in a context the target answered in (its own conversation, from its start or from a window of it).
"""

from __future__ import annotations

import hashlib
import lzma
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .shards import is_distilled, load_distilled, read_manifest

__all__ = ["check_data", "distilled_chunks", "draft_vocab", "read_text", "sample_windows", "token_chunks",
           "training_chunks"]

HELDOUT = 0.05  # never read
ESTIMATE = 0.05  # just before it: the acceptance estimate's text
OVERLAP = 4  # a sample's next window starts seq_len // OVERLAP tokens before its previous one ends
PAD = 0  # the token id after a sample's end in its last window (masked out, and after every real token)


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
                    cache: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, seq_len]`` token ids from ``paths`` (text files and distilled folders, mixed), the
    ``part`` (``"train"`` or ``"estimate"``) of each, and their loss mask (bool, True on the tokens
    the drafter learns to predict). Text files: joined and cut into whole chunks, every token a
    target. Distilled folders: each sample in windows of its own (:func:`sample_windows`), True on
    the target's answer tokens."""
    text: list[np.ndarray] = []
    ids: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for path in paths:
        if is_distilled(path):
            _check_tokenizer(path, tokenizer)
            windows = sample_windows(load_distilled(path, part), seq_len)
            ids.append(windows[0])
            masks.append(windows[1])
        else:
            text.append(np.asarray(_tokenized(read_text(path, part), tokenizer, cache), dtype=np.int64))
    if text:
        chunks = _cut(text, seq_len, f"The training data's {part} part")
        ids.insert(0, chunks)
        masks.insert(0, torch.ones_like(chunks, dtype=torch.bool))
    if not ids or sum(len(i) for i in ids) == 0:
        raise ValueError(f"The training data's {part} part holds no sequence of {seq_len} tokens with a token to learn.")
    return torch.cat(ids), torch.cat(masks)


def distilled_chunks(folder: str | Path, seq_len: int, part: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """A distilled folder's samples of ``part`` as ``[N, seq_len]`` token ids and the matching loss
    mask (True on the target's answer tokens), in windows of one sample each (:func:`sample_windows`)."""
    ids, mask = sample_windows(load_distilled(folder, part), seq_len)
    if len(ids) == 0:
        raise ValueError(f"The {part} part of {str(folder)!r} holds no answer token to learn.")
    return ids, mask


def sample_windows(samples: Iterable[Any], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[N, seq_len]`` of token ids and their loss mask from ``samples`` (each with ``ids``
    and ``mask``: True on the target's answer tokens), never two samples in a row.

    Why: a chunk that ran across a sample's end would score the next sample's answers in a context
    the target never answered in (another conversation before them). So each sample starts a row;
    one longer than ``seq_len`` goes on in further rows, each starting ``seq_len // OVERLAP``
    tokens before the previous one ends, those tokens context only (masked: they were scored in
    the previous row), so that every answer token is scored exactly once and, past the first row,
    after at least that much of its own conversation. A last row is padded after the sample's end
    (``PAD``, masked; causal attention keeps it from every real position). Rows with no token to
    score (all prompt) are left out."""
    overlap = seq_len // OVERLAP
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for sample in samples:
        tokens, mask = np.asarray(sample.ids, dtype=np.int64), np.asarray(sample.mask, dtype=bool)
        start = 0
        while True:
            end = min(start + seq_len, len(tokens))
            row, scored = np.full(seq_len, PAD, dtype=np.int64), np.zeros(seq_len, dtype=bool)
            row[: end - start], scored[: end - start] = tokens[start:end], mask[start:end]
            if start:
                scored[:overlap] = False  # context only: the previous row scored them
            if scored[1:].any():  # (a row's first token has no position before it to predict it)
                ids.append(row)
                masks.append(scored)
            if end == len(tokens):
                break
            start = end - overlap
    if not ids:
        return torch.zeros(0, seq_len, dtype=torch.long), torch.zeros(0, seq_len, dtype=torch.bool)
    return torch.from_numpy(np.stack(ids)), torch.from_numpy(np.stack(masks))


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
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # ranks of one training write it at once
    torch.save(torch.tensor(ids, dtype=torch.int32), partial)
    os.replace(partial, path)
    return ids


def draft_vocab(chunks: torch.Tensor, size: int, always: list[int] | tuple[int, ...] = (),
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``chunks`` (ties: lower id first) where the loss
    ``mask`` is True (the tokens the drafter will draft; None: all), plus ``always`` (e.g. the
    end-of-sequence ids): a reduced draft vocabulary (SPEC.md §11.4)."""
    counts = torch.bincount(chunks.flatten() if mask is None else chunks[mask])
    order = torch.argsort(-counts, stable=True)  # most frequent first, ties by id
    chosen = set(always)
    for token in order[counts[order] > 0].tolist():  # only tokens that occur
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)
