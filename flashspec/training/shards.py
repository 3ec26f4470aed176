"""Distilled samples on disk: token shards and a manifest that a run can continue from.

A distilled folder (``flashspec distill --out DIR``) holds:

* ``<source>-NNNNN.npz`` shards, each the samples of a fixed range of its source's items
  (conversations or corpus prompts), compressed numpy arrays: ``ids`` (uint32, every sample's
  tokens one after another), ``mask`` (uint8, 1 on the target's answer tokens), ``offsets``
  (int64, ``n + 1``: sample ``i`` is ``ids[offsets[i]:offsets[i + 1]]``), ``item`` (int64, the
  item each sample came from, within its source) and ``estimate`` (uint8, 1 for samples of the
  estimate part, :func:`flashspec.data.sharegpt.part_of`);
* ``manifest.json``: the ``identity`` of the data (the options that shape it, the target's
  weights checksum, the tokenizer, the source files' checksums), the command's arguments, the
  target's and tokenizer's names, one entry per finished shard (its counts, seconds spent
  generating and sha256) and the totals over them.

A shard is written to a temporary name, renamed, and then entered in the manifest, so a run
stopped at any moment leaves only finished shards listed; running the same command again keeps
them (:func:`finished`) and makes the rest. Another identity in the same folder is a
``ValueError`` (:func:`open_manifest`). :func:`load_distilled` reads the samples back.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .conversations import Sample

__all__ = ["FORMAT", "MANIFEST", "DistilledSample", "finished", "is_distilled", "load_distilled", "open_manifest",
           "read_manifest", "save_manifest", "shard_name", "write_shard"]

FORMAT = 1
MANIFEST = "manifest.json"
PARTS = ("train", "estimate", "all")
TOTALS = ("items", "samples", "tokens", "answer_tokens", "answers", "answers_cut", "conversations", "skipped", "seconds")


@dataclass(frozen=True)
class DistilledSample:
    """One sample read back: ``ids`` (uint32) and ``mask`` (bool, True on the target's answer
    tokens), the ``source`` and ``item`` it came from, and whether it is in the estimate part."""

    ids: np.ndarray
    mask: np.ndarray
    source: str
    item: int
    estimate: bool


def shard_name(source: str, number: int) -> str:
    return f"{source}-{number:05d}.npz"


def is_distilled(path: str | Path) -> bool:
    """Whether ``path`` is a distilled folder (a folder with a ``manifest.json``)."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The folder's manifest, checked to be one this version writes."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} is not a distilled folder: it has no {MANIFEST}.")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("shards"), list):
        raise ValueError(f"{path} is not a distilled-data manifest of format {FORMAT}.")
    return manifest


def open_manifest(folder: str | Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The manifest to continue in ``folder``: the existing one if its identity is ``identity``
    (else ``ValueError`` naming what differs), or a new one (a folder holding other files is
    refused, so nothing is mixed into or written over)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {str(folder)!r} is a file; distilled data goes to a folder.")
    if (folder / MANIFEST).is_file():
        manifest = read_manifest(folder)
        before = json.loads(json.dumps(manifest.get("identity")))
        now = json.loads(json.dumps(identity))  # tuples as lists, as the file holds them
        if before != now:
            differ = sorted(_differences(before, now))
            raise ValueError(f"{str(folder)!r} holds data distilled with other settings ({'; '.join(differ[:6])}). "
                             "Use another output folder, or delete this one to start over.")
        return manifest
    if folder.is_dir() and any(folder.iterdir()):
        raise ValueError(f"{str(folder)!r} is not empty and holds no {MANIFEST}: give an empty or new folder.")
    return {"format": FORMAT, "identity": identity, "shards": [], "totals": {}}


def _differences(before: Any, now: Any, at: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(now, dict):
        out = []
        for key in sorted(set(before) | set(now)):
            out += _differences(before.get(key), now.get(key), f"{at}.{key}" if at else key)
        return out
    return [] if before == now else [f"{at or 'identity'}: {before!r} before, {now!r} now"]


def save_manifest(folder: str | Path, manifest: dict[str, Any]) -> None:
    """Write the manifest with its totals over the shards, atomically (a new file renamed)."""
    manifest["totals"] = {name: sum(entry.get(name, 0) for entry in manifest["shards"]) for name in TOTALS}
    manifest["totals"]["shards"] = len(manifest["shards"])
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / MANIFEST
    temporary = path.with_suffix(".json.partial")
    temporary.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(temporary, path)


def finished(folder: str | Path, manifest: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The manifest's entry for shard ``name`` if the shard is there and its sha256 matches."""
    for entry in manifest["shards"]:
        if entry["name"] == name:
            path = Path(folder) / name
            if path.is_file() and _sha256(path) == entry["sha256"]:
                return entry
    return None


def write_shard(folder: str | Path, name: str, samples: list[Sample], estimate: list[bool]) -> dict[str, Any]:
    """Write ``samples`` (``estimate[i]``: sample ``i`` is in the estimate part) as shard ``name``;
    return its counts and sha256 for the manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lengths = [len(s.ids) for s in samples]
    ids = np.fromiter((t for s in samples for t in s.ids), dtype=np.uint32, count=sum(lengths))
    mask = np.fromiter((m for s in samples for m in s.mask), dtype=np.uint8, count=sum(lengths))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    temporary = folder / (name + ".partial")
    with open(temporary, "wb") as out:
        np.savez_compressed(out, ids=ids, mask=mask, offsets=offsets,
                            item=np.array([s.item for s in samples], dtype=np.int64),
                            estimate=np.array(estimate, dtype=np.uint8))
    os.replace(temporary, folder / name)
    return {"name": name, "samples": len(samples), "tokens": int(ids.size), "answer_tokens": int(mask.sum()),
            "sha256": _sha256(folder / name)}


def load_distilled(folder: str | Path, part: str = "all", check: bool = True) -> Iterator[DistilledSample]:
    """The samples of a distilled folder's finished shards, in manifest order; ``part``:
    ``"train"``, ``"estimate"`` or ``"all"``. ``check``: verify each shard's sha256 first (a
    changed or missing shard is a ``ValueError``)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}; got {part!r}.")
    folder = Path(folder)
    for entry in read_manifest(folder)["shards"]:
        path = folder / entry["name"]
        if not path.is_file():
            raise ValueError(f"Shard {path} of the manifest is missing.")
        if check and _sha256(path) != entry["sha256"]:
            raise ValueError(f"Shard {path} does not match its sha256 in the manifest: it changed or is damaged.")
        with np.load(path) as data:
            ids, mask, offsets = data["ids"], data["mask"].astype(bool), data["offsets"]
            items, estimate = data["item"], data["estimate"].astype(bool)
        for i in range(len(items)):
            if part != "all" and estimate[i] != (part == "estimate"):
                continue
            start, end = offsets[i], offsets[i + 1]
            yield DistilledSample(ids[start:end], mask[start:end], entry["source"], int(items[i]), bool(estimate[i]))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
