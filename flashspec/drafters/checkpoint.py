"""Drafter checkpoints (SPEC.md §11): ``drafter.safetensors`` holds only the trainable part,
``drafter.json`` its kind and size (a fused-feature drafter's ``taps`` and ``fuse_rank`` too), the
target it belongs to and a checksum of the target tensors it shares, so that loading it onto
another target is a clear error. Matrices are stored as int8 rows with a scale each unless asked
otherwise; a per-domain drafter may be a low-rank delta over a base checkpoint
(:mod:`flashspec.drafters.low_rank`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..checks import brief, is_int
from .feature import FeatureHead
from .low_rank import low_rank_factors, merge_low_rank
from .shallow import ShallowHead

__all__ = ["FORMAT", "KINDS", "file_sha256", "load_feature_head", "load_head", "read_meta", "read_tensors",
           "save_drafter", "shared_checksum", "target_record", "write_meta"]

KINDS = ("feature", "shallow")
FORMAT = 1


def shared_checksum(target: Any, shared_layers: int = 0) -> str:
    """sha256 of the target tensors a drafter shares: embedding, final norm, output head, and the
    first ``shared_layers`` decoder layers, each rounded to bfloat16 (so that a checkpoint trained
    on a GPU in bfloat16 loads onto the same target in float32 on a CPU)."""
    digest = hashlib.sha256()
    tensors = [target.model.embed_tokens.weight, target.model.norm.weight, target.lm_head.weight]
    for layer in target.model.layers[:shared_layers]:
        tensors.extend(p for _, p in sorted(layer.named_parameters()))
    for tensor in tensors:  # rounded to bfloat16: the same target loaded in float32 or bfloat16 matches
        data = tensor.detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(str(tuple(data.shape)).encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def target_record(target: Any, shared_layers: int = 0) -> dict[str, Any]:
    """What a checkpoint records of the target it belongs to: its type, sizes, name and the
    :func:`shared_checksum` of the tensors shared."""
    config = target.config
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
            "name_or_path": getattr(config, "_name_or_path", ""),
            "shared_sha256": shared_checksum(target, shared_layers)}


def _kind(head: Any) -> str:
    return "shallow" if isinstance(head, ShallowHead) else "feature"


STORAGE = ("int8", "same")
SCALE = ".int8_scale"


def _quantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every matrix as int8 rows with one scale per row (``name`` and ``name.int8_scale``), SPEC.md
    §11.4: half the bytes of bfloat16; other tensors as they are."""
    out = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.dim() == 2:
            wide = tensor.to(torch.float32)
            scale = wide.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            out[name] = torch.round(wide / scale).clamp(-127, 127).to(torch.int8)
            out[name + SCALE] = scale.to(torch.float32)
        else:
            out[name] = tensor
    return out


def _dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE):
            continue
        scale = tensors.get(name + SCALE)
        out[name] = tensor if scale is None else tensor.to(torch.float32) * scale
    return out


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_drafter(head: Any, target: Any, out_dir: str | Path, log: dict | None = None, *,
                 storage: str = "int8", base: str | Path | None = None) -> Path:
    """Write ``drafter.safetensors`` (the trainable part only) and ``drafter.json``, each under a
    temporary name first and then renamed over the file it replaces (weights, then record): a
    write that fails or is killed leaves the files that were there.

    ``storage="int8"`` keeps matrices as int8 rows with a scale each (SPEC.md §11.4), ``"same"``
    in the head's dtype. ``base``: the folder of the drafter this head's low-rank deltas were
    trained over (:func:`add_low_rank`); only the deltas are written, and the checkpoint names its
    base by a path relative to ``out_dir`` and the base weights' sha256."""
    from safetensors.torch import save_file

    if storage not in STORAGE:
        raise ValueError(f"storage must be one of {', '.join(STORAGE)}; got {storage!r}.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if base is not None:
        tensors = low_rank_factors(head)
        if not tensors:
            raise ValueError("This head has no low-rank deltas to save over a base drafter.")
        storage = "same"
    else:
        tensors = {k: v for k, v in head.state_dict().items() if "parametrizations" not in k}
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    shared = getattr(head, "shared_layers", 0)
    record: dict[str, Any] = {"format": FORMAT, "kind": _kind(head), "layers": len(head.layers),
                              "target": target_record(target, shared), "storage": storage,
                              "dtype": str(next(head.parameters()).dtype).removeprefix("torch."),
                              "bytes": 0}  # the file's, once written
    if isinstance(head, ShallowHead):
        record.update(shared_layers=head.shared_layers, head_width=head.fc1.out_features)
    else:
        record.update(head.design)
    if base is not None:
        base = Path(base)
        record["base"] = {"path": os.path.relpath(base.resolve(), out.resolve()),
                          "sha256": file_sha256(base / "drafter.safetensors")}
        record["rank"] = int(next(iter(tensors.values())).shape[0])
    record["training"] = log or {}
    weights = _partial(out / "drafter.safetensors")
    try:
        save_file(_quantized(tensors) if storage == "int8" else tensors, str(weights))
        _flush(weights)
        record["bytes"] = weights.stat().st_size
        os.replace(weights, out / "drafter.safetensors")
    except BaseException:
        weights.unlink(missing_ok=True)
        raise
    write_meta(out, record)
    return out


def _partial(path: Path) -> Path:
    """A temporary name beside ``path``, this process's own."""
    return path.with_name(f".{path.name}.{os.getpid()}.partial")


def _flush(path: Path) -> None:
    """``path``'s bytes on the disk before it is renamed into place."""
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def write_meta(folder: str | Path, record: dict[str, Any]) -> None:
    """Write ``folder/drafter.json`` atomically: a temporary file renamed over it."""
    path = Path(folder) / "drafter.json"
    partial = _partial(path)
    try:
        partial.write_text(json.dumps(record, indent=1) + "\n")
        _flush(partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def read_meta(folder: Path) -> dict[str, Any]:
    meta_path = folder / "drafter.json"
    if not meta_path.is_file():
        raise ValueError(f"{str(folder)!r} is not a drafter checkpoint (no drafter.json there).")
    try:
        return json.loads(meta_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(meta_path)!r} is corrupt: {error}") from None


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return _dequantized(load_file(str(folder / "drafter.safetensors")))
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file
        raise ValueError(f"Could not read the drafter weights in {str(folder)!r} (corrupt or truncated?): "
                         f"{type(error).__name__}: {brief(error, 200)}") from None


def load_head(path: str | Path, target: Any, kind: str | None = None) -> Any:
    """The drafter head saved in folder ``path`` for ``target``, on its device and dtype. A
    checkpoint of another kind, or made for another target (architecture, sizes or shared
    weights), is a ValueError. A delta checkpoint loads its base first and adds its deltas."""
    folder = Path(path)
    meta = read_meta(folder)
    if meta.get("kind") == "eagle3":
        raise ValueError(f"{str(folder)!r} holds an EAGLE-3 head (train-drafter --layout eagle3): load it as "
                         "'eagle3:DIR'.")
    if meta.get("format") != FORMAT or meta.get("kind") not in KINDS or kind not in (None, meta.get("kind")):
        raise ValueError(f"{str(folder)!r} holds a {meta.get('kind')!r} drafter of format {meta.get('format')!r}; "
                         f"expected {kind or ' or '.join(KINDS)} of format {FORMAT}.")
    if "base" in meta:
        base_folder = (folder / meta["base"]["path"]).resolve()
        if not (base_folder / "drafter.safetensors").is_file():
            raise ValueError(f"The drafter in {str(folder)!r} is a delta over {str(base_folder)!r}, which is missing.")
        if file_sha256(base_folder / "drafter.safetensors") != meta["base"]["sha256"]:
            raise ValueError(f"The drafter in {str(folder)!r} was trained over another version of its base "
                             f"{str(base_folder)!r} (checksum differs).")
        head = load_head(base_folder, target, meta["kind"])
        merge_low_rank(head, read_tensors(folder))
        return head
    shared = int(meta.get("shared_layers", 0))
    mine, theirs = target_record(target, shared), meta.get("target", {})
    for key in ("model_type", "hidden_size", "vocab_size", "shared_sha256"):
        if mine[key] != theirs.get(key):
            what = "its shared weights differ" if key == "shared_sha256" else f"{key} {theirs.get(key)!r} ≠ {mine[key]!r}"
            raise ValueError(f"The drafter in {str(folder)!r} was trained for another target "
                             f"({theirs.get('name_or_path') or 'unnamed'}): {what}.")
    taps = meta.get("taps")  # fused features (SPEC.md §11); absent or None: the last layer's
    layers = target.config.num_hidden_layers
    if taps is not None and not (isinstance(taps, list) and taps and all(isinstance(t, int) and 0 <= t < layers
                                                                          for t in taps)):
        raise ValueError(f"The drafter in {str(folder)!r} reads the target's decoder layers {taps!r} (taps, "
                         f"0-based); this target has {layers} decoder layers: it was made for another target.")
    tensors = read_tensors(folder)
    if meta["kind"] == "shallow":
        head: Any = ShallowHead(target.config, shared, int(meta["layers"]), int(meta["head_width"]))
    else:
        vocab = tensors.get("vocab")
        rank = meta.get("fuse_rank")  # a factored fuse (SPEC.md §11.8); absent or None: full rank
        if rank is not None and (taps is None or not is_int(rank) or not 1 <= rank <= target.config.hidden_size):
            raise ValueError(f"The drafter in {str(folder)!r} records fuse_rank {rank!r} with taps {taps!r}: a fuse "
                             f"rank is an integer from 1 to the hidden size {target.config.hidden_size} of a drafter "
                             "with taps (an edited or foreign drafter.json).")
        head = FeatureHead(target.config, int(meta["layers"]), meta.get("width"), meta.get("heads"), vocab,
                           None if taps is None else tuple(taps), rank)
    try:
        head.load_state_dict(tensors)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file
        raise ValueError(f"Could not read the drafter weights in {str(folder)!r} (corrupt or truncated?): "
                         f"{type(error).__name__}: {brief(error, 200)}") from None
    parameter = next(target.parameters())
    return head.to(device=parameter.device, dtype=parameter.dtype).eval()


def load_feature_head(path: str | Path, target: Any) -> FeatureHead:
    """:func:`load_head` of kind ``"feature"``."""
    return load_head(path, target, "feature")
