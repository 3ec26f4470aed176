"""Training drafters made from the target (SPEC.md §11): ``flashspec train-drafter``.

Teacher forcing on the target's own features and next-token laws. The target runs frozen; only
the drafter's own part (a :class:`~flashspec.drafters.feature.FeatureHead`) learns. The loss is
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

__all__ = ["TrainOptions", "read_text", "token_chunks", "train_feature_head", "save_drafter", "load_feature_head"]

HELDOUT = 0.05  # never read
ESTIMATE = 0.05  # just before it: the acceptance estimate's text
FORMAT = 1


@dataclass(frozen=True)
class TrainOptions:
    """How a drafter trains (``flashspec train-drafter``'s flags)."""

    layers: int = 1  # decoder layers of the drafter's own part
    steps: int = 1000
    batch: int = 8  # sequences per step
    seq_len: int = 256  # tokens per sequence
    lr_layers: float = 5e-5  # the decoder layers' learning rate (the write-up's starting point)
    lr_head: float = 1e-4  # fc's learning rate
    hard_labels: bool = False  # cross-entropy against the next token instead of the target's law
    seed: int = 0
    estimate_every: int = 50  # steps between two acceptance estimates on the estimate text

    def __post_init__(self) -> None:
        for name in ("layers", "steps", "batch", "seq_len", "estimate_every"):
            value = getattr(self, name)
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


def _features_and_logits(target: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last-layer features (before the final norm) and logits of ``ids [b, T]``."""
    captured: list[torch.Tensor] = []
    handle = target.model.norm.register_forward_hook(lambda module, args, output: captured.append(args[0]))
    try:
        with torch.no_grad():
            logits = target(ids).logits
    finally:
        handle.remove()
    return captured[-1], logits


def _draft_logits(head: FeatureHead, draft: Any, target: Any, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The drafter's logits at every position of ``ids`` (teacher-forced on the true features)."""
    previous = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)  # f_{t-1}
    x = head.inputs(previous.to(head.fc.weight.dtype), target.model.embed_tokens(ids).to(head.fc.weight.dtype))
    hidden = draft.model(inputs_embeds=x).last_hidden_state
    return target.lm_head(hidden)


def _acceptance(head: FeatureHead, draft: Any, target: Any, chunks: torch.Tensor, batch: int) -> float:
    """α₁ on ``chunks``: how often the drafter's argmax is the target's (SPEC.md §11)."""
    agree = total = 0
    with torch.no_grad():
        for i in range(0, len(chunks), batch):
            ids = chunks[i : i + batch].to(target.device)
            features, logits = _features_and_logits(target, ids)
            mine = _draft_logits(head, draft, target, ids, features)
            agree += int((mine.argmax(-1) == logits.argmax(-1)).sum())
            total += mine.shape[0] * mine.shape[1]
    return agree / max(total, 1)


def train_feature_head(target: Any, chunks: torch.Tensor, options: TrainOptions,
                       estimate: torch.Tensor | None = None, progress: bool = True) -> tuple[FeatureHead, dict]:
    """Train a :class:`FeatureHead` for ``target`` (frozen) on ``chunks [N, seq_len]``; return it
    with a log (losses, acceptance estimates, seconds, tokens seen)."""
    torch.manual_seed(options.seed)
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    head = FeatureHead(target.config, options.layers).to(device=device, dtype=dtype)
    draft = head.draft_model(target)
    training = target.training
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)  # restored below
    groups = [{"params": head.fc.parameters(), "lr": options.lr_head},
              {"params": head.layers.parameters(), "lr": options.lr_layers}]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    generator = torch.Generator().manual_seed(options.seed)
    log: dict[str, Any] = {"options": asdict(options), "loss": [], "estimates": [], "tokens": 0}
    started = time.perf_counter()
    requires = {n: p.requires_grad for n, p in target.named_parameters()}
    try:
        bar = tqdm(range(options.steps), disable=not progress, desc="training drafter", unit="step")
        for step in bar:
            rows = torch.randint(0, len(chunks), (options.batch,), generator=generator)
            ids = chunks[rows].to(device)
            features, logits = _features_and_logits(target, ids)
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


# ------------------------------------------------------------------ checkpoints
def shared_checksum(target: Any) -> str:
    """sha256 of the target tensors a drafter shares (embedding, final norm, output head)."""
    digest = hashlib.sha256()
    for tensor in (target.model.embed_tokens.weight, target.model.norm.weight, target.lm_head.weight):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(str((tuple(data.shape), str(data.dtype))).encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.dtype != torch.uint8 else data.numpy().tobytes())
    return digest.hexdigest()


def _target_record(target: Any) -> dict[str, Any]:
    config = target.config
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
            "name_or_path": getattr(config, "_name_or_path", ""), "shared_sha256": shared_checksum(target)}


def save_drafter(head: FeatureHead, target: Any, out_dir: str | Path, log: dict | None = None) -> Path:
    """Write ``drafter.safetensors`` (the trainable part only) and ``drafter.json``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "drafter.safetensors"))
    record = {"format": FORMAT, "kind": "feature", "layers": len(head.layers), "target": _target_record(target),
              "dtype": str(head.fc.weight.dtype).removeprefix("torch."), "training": log or {}}
    (out / "drafter.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def load_feature_head(path: str | Path, target: Any) -> FeatureHead:
    """The :class:`FeatureHead` saved in folder ``path`` for ``target``, on its device and dtype.
    A checkpoint made for another target (architecture, sizes or shared weights) is a ValueError."""
    from safetensors.torch import load_file

    folder = Path(path)
    meta_path = folder / "drafter.json"
    if not meta_path.is_file():
        raise ValueError(f"{str(folder)!r} is not a drafter checkpoint (no drafter.json there).")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(meta_path)!r} is corrupt: {error}") from None
    if meta.get("format") != FORMAT or meta.get("kind") != "feature":
        raise ValueError(f"{str(folder)!r} holds a {meta.get('kind')!r} drafter of format {meta.get('format')!r}; "
                         f"this is a feature drafter loader of format {FORMAT}.")
    mine, theirs = _target_record(target), meta.get("target", {})
    for key in ("model_type", "hidden_size", "vocab_size", "shared_sha256"):
        if mine[key] != theirs.get(key):
            what = "its shared weights differ" if key == "shared_sha256" else f"{key} {theirs.get(key)!r} ≠ {mine[key]!r}"
            raise ValueError(f"The drafter in {str(folder)!r} was trained for another target "
                             f"({theirs.get('name_or_path') or 'unnamed'}): {what}.")
    head = FeatureHead(target.config, int(meta["layers"]))
    try:
        state = load_file(str(folder / "drafter.safetensors"))
        head.load_state_dict(state)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file
        raise ValueError(f"Could not read the drafter weights in {str(folder)!r} (corrupt or truncated?): "
                         f"{type(error).__name__}: {str(error)[:200]}") from None
    parameter = next(target.parameters())
    return head.to(device=parameter.device, dtype=parameter.dtype).eval()
