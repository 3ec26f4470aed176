"""Training drafters made from the target (SPEC.md §11): ``flashspec train-drafter``.

Teacher forcing on the target's own features and next-token laws. The target runs frozen; only
the drafter's own part learns: a :class:`~flashspec.drafters.feature.FeatureHead` (kind
``feature``) or a :class:`~flashspec.drafters.feature.ShallowHead` (kind ``shallow``). The loss is
distillation, the cross-entropy of the drafter's law against the target's (soft labels), or
against the next token itself with ``hard_labels``. A checkpoint holds only the trainable part
(``drafter.safetensors``) and ``drafter.json``: the drafter's kind and size, the target it belongs
to and a checksum of the target tensors it shares, so that loading it onto another target is a
clear error.

Data: each file's text (``.txt`` or ``.xz``) is cut like the corpus (SPEC.md §10): the last 5 %
(from a line start) is never read. Training takes the first 90 %; the 5 % between is where the
progress bar's acceptance estimate comes from.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .drafters.feature import FeatureHead
from .drafters.shallow import ShallowHead

__all__ = ["KINDS", "TrainOptions", "read_text", "token_chunks", "train_head", "train_feature_head", "save_drafter",
           "load_head", "load_feature_head"]

KINDS = ("feature", "shallow")

HELDOUT = 0.05  # never read
ESTIMATE = 0.05  # just before it: the acceptance estimate's text
FORMAT = 1


@dataclass(frozen=True)
class TrainOptions:
    """How a drafter trains (``flashspec train-drafter``'s flags)."""

    layers: int = 1  # decoder layers of the drafter's own part (feature) / adapter layers (shallow)
    shared_layers: int | None = None  # shallow: the target's layers it shares (default: a quarter)
    head_width: int | None = None  # shallow: the residual MLP's width (default: the hidden size)
    steps: int = 1000
    batch: int = 8  # sequences per step
    seq_len: int = 256  # tokens per sequence
    lr_layers: float = 5e-5  # the decoder layers' learning rate (the write-up's starting point)
    lr_head: float = 1e-4  # fc's learning rate
    hard_labels: bool = False  # cross-entropy against the next token instead of the target's law
    seed: int = 0
    estimate_every: int = 50  # steps between two acceptance estimates on the estimate text

    def __post_init__(self) -> None:
        for name in ("layers", "steps", "batch", "seq_len", "estimate_every", "shared_layers", "head_width"):
            value = getattr(self, name)
            if value is None and name in ("shared_layers", "head_width"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")
        for name in ("lr_layers", "lr_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < 1):
                raise ValueError(f"{name} must be a number in (0, 1); got {value!r}.")
        if not isinstance(self.hard_labels, bool):
            raise ValueError(f"hard_labels must be True or False; got {self.hard_labels!r}.")


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


def token_chunks(texts: list[str], tokenizer: Any, seq_len: int) -> torch.Tensor:
    """``[N, seq_len]`` token ids: the texts tokenized, joined and cut into whole chunks."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
    count = len(ids) // seq_len
    if count == 0:
        raise ValueError(f"The training data holds {len(ids)} tokens, fewer than one sequence of {seq_len}.")
    return torch.tensor(ids[: count * seq_len]).view(count, seq_len)


def _features_and_logits(target: Any, ids: torch.Tensor, after: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features after its first ``after`` layers (None: all of them, before the final
    norm) and its logits for ``ids [b, T]``."""
    captured: list[torch.Tensor] = []
    module = target.model.norm if after is None else target.model.layers[after - 1]
    hook = module.register_forward_pre_hook if after is None else module.register_forward_hook

    def keep(module: Any, args: Any, output: Any = None) -> None:
        value = args[0] if after is None else (output[0] if isinstance(output, tuple) else output)
        captured.append(value)

    handle = hook(keep)
    try:
        with torch.no_grad():
            logits = target(ids).logits
    finally:
        handle.remove()
    return captured[-1], logits


def _draft_logits(head: Any, draft: Any, target: Any, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The drafter's logits at every position of ``ids`` (teacher-forced on the true features)."""
    dtype = next(head.parameters()).dtype
    if isinstance(head, ShallowHead):
        x = features.to(dtype)  # the target's state after its shared layers
    else:
        previous = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)  # f_{t-1}
        x = head.inputs(previous.to(dtype), target.model.embed_tokens(ids).to(dtype))
    return draft.lm_head(draft.model(inputs_embeds=x).last_hidden_state)


def _feature_layer(head: Any) -> int | None:
    return head.shared_layers if isinstance(head, ShallowHead) else None


def _acceptance(head: Any, draft: Any, target: Any, chunks: torch.Tensor, batch: int) -> float:
    """α₁ on ``chunks``: how often the drafter's argmax is the target's (SPEC.md §11)."""
    agree = total = 0
    with torch.no_grad():
        for i in range(0, len(chunks), batch):
            ids = chunks[i : i + batch].to(target.device)
            features, logits = _features_and_logits(target, ids, _feature_layer(head))
            mine = _draft_logits(head, draft, target, ids, features)
            agree += int((mine.argmax(-1) == logits.argmax(-1)).sum())
            total += mine.shape[0] * mine.shape[1]
    return agree / max(total, 1)


def new_head(kind: str, target: Any, options: TrainOptions) -> Any:
    """An untrained head of ``kind`` for ``target``, on its device and dtype."""
    if kind == "feature":
        head = FeatureHead(target.config, options.layers)
    elif kind == "shallow":
        shared = options.shared_layers or max(1, target.config.num_hidden_layers // 4)
        head = ShallowHead(target.config, shared, options.layers, options.head_width)
    else:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}.")
    parameter = next(target.parameters())
    return head.to(device=parameter.device, dtype=parameter.dtype)


def train_head(kind: str, target: Any, chunks: torch.Tensor, options: TrainOptions,
               estimate: torch.Tensor | None = None, progress: bool = True) -> tuple[Any, dict]:
    """Train a drafter head of ``kind`` for ``target`` (frozen) on ``chunks [N, seq_len]``; return it
    with a log (losses, acceptance estimates, seconds, tokens seen)."""
    torch.manual_seed(options.seed)
    device = next(target.parameters()).device
    head = new_head(kind, target, options)
    draft = head.draft_model(target)
    layer = _feature_layer(head)
    training = target.training
    target.eval()
    requires = {n: p.requires_grad for n, p in target.named_parameters()}
    for p in target.parameters():
        p.requires_grad_(False)  # restored below
    if isinstance(head, ShallowHead):
        groups = [{"params": list(head.fc1.parameters()) + list(head.fc2.parameters()), "lr": options.lr_head},
                  {"params": head.layers.parameters(), "lr": options.lr_layers}]
    else:
        groups = [{"params": head.fc.parameters(), "lr": options.lr_head},
                  {"params": head.layers.parameters(), "lr": options.lr_layers}]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    generator = torch.Generator().manual_seed(options.seed)
    log: dict[str, Any] = {"kind": kind, "options": asdict(options), "loss": [], "estimates": [], "tokens": 0}
    started = time.perf_counter()
    try:
        bar = tqdm(range(options.steps), disable=not progress, desc=f"training {kind} drafter", unit="step")
        for step in bar:
            rows = torch.randint(0, len(chunks), (options.batch,), generator=generator)
            ids = chunks[rows].to(device)
            features, logits = _features_and_logits(target, ids, layer)
            mine = _draft_logits(head, draft, target, ids, features)[:, :-1].float()
            if options.hard_labels:
                loss = torch.nn.functional.cross_entropy(mine.flatten(0, 1), ids[:, 1:].flatten())
            else:
                law = torch.softmax(logits[:, :-1].float(), dim=-1)
                loss = -(law * torch.log_softmax(mine, dim=-1)).sum(-1).mean()
            if not math.isfinite(loss.item()):
                raise ValueError(f"The training loss is not finite at step {step}: lower the learning rates.")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            log["loss"].append(loss.item())
            log["tokens"] += ids.numel()
            if estimate is not None and ((step + 1) % options.estimate_every == 0 or step + 1 == options.steps):
                alpha = _acceptance(head, draft, target, estimate, options.batch)
                log["estimates"].append({"step": step + 1, "alpha1": alpha})
                bar.set_postfix(loss=f"{loss.item():.3f}", alpha1=f"{alpha:.3f}")
            else:
                bar.set_postfix(loss=f"{loss.item():.3f}")
    finally:
        for n, p in target.named_parameters():
            p.requires_grad_(requires[n])
        target.train(training)
    log["seconds"] = time.perf_counter() - started
    return head.eval(), log


def train_feature_head(target: Any, chunks: torch.Tensor, options: TrainOptions,
                       estimate: torch.Tensor | None = None, progress: bool = True) -> tuple[FeatureHead, dict]:
    """:func:`train_head` of kind ``"feature"``."""
    return train_head("feature", target, chunks, options, estimate, progress)


# ------------------------------------------------------------------ checkpoints
def shared_checksum(target: Any, shared_layers: int = 0) -> str:
    """sha256 of the target tensors a drafter shares: embedding, final norm, output head, and the
    first ``shared_layers`` decoder layers."""
    digest = hashlib.sha256()
    tensors = [target.model.embed_tokens.weight, target.model.norm.weight, target.lm_head.weight]
    for layer in target.model.layers[:shared_layers]:
        tensors.extend(p for _, p in sorted(layer.named_parameters()))
    for tensor in tensors:
        data = tensor.detach().to("cpu").contiguous()
        digest.update(str((tuple(data.shape), str(data.dtype))).encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _target_record(target: Any, shared_layers: int = 0) -> dict[str, Any]:
    config = target.config
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
            "name_or_path": getattr(config, "_name_or_path", ""),
            "shared_sha256": shared_checksum(target, shared_layers)}


def _kind(head: Any) -> str:
    return "shallow" if isinstance(head, ShallowHead) else "feature"


def save_drafter(head: Any, target: Any, out_dir: str | Path, log: dict | None = None) -> Path:
    """Write ``drafter.safetensors`` (the trainable part only) and ``drafter.json``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "drafter.safetensors"))
    shared = getattr(head, "shared_layers", 0)
    record = {"format": FORMAT, "kind": _kind(head), "layers": len(head.layers), "target": _target_record(target, shared),
              "dtype": str(next(head.parameters()).dtype).removeprefix("torch."), "training": log or {}}
    if isinstance(head, ShallowHead):
        record.update(shared_layers=head.shared_layers, head_width=head.fc1.out_features)
    (out / "drafter.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def load_head(path: str | Path, target: Any, kind: str | None = None) -> Any:
    """The drafter head saved in folder ``path`` for ``target``, on its device and dtype. A
    checkpoint of another kind, or made for another target (architecture, sizes or shared
    weights), is a ValueError."""
    from safetensors.torch import load_file

    folder = Path(path)
    meta_path = folder / "drafter.json"
    if not meta_path.is_file():
        raise ValueError(f"{str(folder)!r} is not a drafter checkpoint (no drafter.json there).")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(meta_path)!r} is corrupt: {error}") from None
    if meta.get("format") != FORMAT or meta.get("kind") not in KINDS or kind not in (None, meta.get("kind")):
        raise ValueError(f"{str(folder)!r} holds a {meta.get('kind')!r} drafter of format {meta.get('format')!r}; "
                         f"expected {kind or ' or '.join(KINDS)} of format {FORMAT}.")
    shared = int(meta.get("shared_layers", 0))
    mine, theirs = _target_record(target, shared), meta.get("target", {})
    for key in ("model_type", "hidden_size", "vocab_size", "shared_sha256"):
        if mine[key] != theirs.get(key):
            what = "its shared weights differ" if key == "shared_sha256" else f"{key} {theirs.get(key)!r} ≠ {mine[key]!r}"
            raise ValueError(f"The drafter in {str(folder)!r} was trained for another target "
                             f"({theirs.get('name_or_path') or 'unnamed'}): {what}.")
    if meta["kind"] == "shallow":
        head: Any = ShallowHead(target.config, shared, int(meta["layers"]), int(meta["head_width"]))
    else:
        head = FeatureHead(target.config, int(meta["layers"]))
    try:
        head.load_state_dict(load_file(str(folder / "drafter.safetensors")))
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file
        raise ValueError(f"Could not read the drafter weights in {str(folder)!r} (corrupt or truncated?): "
                         f"{type(error).__name__}: {str(error)[:200]}") from None
    parameter = next(target.parameters())
    return head.to(device=parameter.device, dtype=parameter.dtype).eval()


def load_feature_head(path: str | Path, target: Any) -> FeatureHead:
    """:func:`load_head` of kind ``"feature"``."""
    return load_head(path, target, "feature")
