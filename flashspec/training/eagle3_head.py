"""Training a draft head in EAGLE-3's layout (SPEC.md §11.9, "Training a head in EAGLE-3's
layout"): ``flashspec train-drafter --layout eagle3``.

The model trained is an :class:`~flashspec.drafters.eagle3.Eagle3Head`, the class ``"eagle3:DIR"``
loads, run through :meth:`~flashspec.drafters.eagle3.Eagle3Head.attend` (the drafter's own
projections, rotary positions, residual and MLP) in the feature drafter's loop
(:func:`flashspec.training.train.train_head` with kind ``"eagle3"``). This module holds what
differs: the new head (its layer sized from the target, its ``lm_head`` and ``norm`` started from
the target's), its unrolled passes, which parameters learn at which rate, the options it refuses,
and its checkpoint: an EAGLE-layout folder (:func:`~flashspec.drafters.eagle3_formats.write_eagle3`)
that vLLM and SGLang read as it is, beside FlashSpec's ``drafter.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..drafters.checkpoint import FORMAT, read_meta, target_record
from ..drafters.eagle3 import Eagle3Head
from ..drafters.eagle3_formats import KIND, head_checkpoint, layer_config, layer_fields, load_eagle3_head, write_eagle3
from ..drafters.feature import check_taps, default_taps
from .unroll import chain_mask

__all__ = ["KIND", "TAPS", "check_eagle3_options", "check_trained_eagle3", "counted", "eagle3_groups",
           "eagle3_passes", "eagle3_taps", "load_trained_eagle3", "new_eagle3_head", "save_eagle3_head"]

TAPS = 3  # vLLM's and speculators' fc reads exactly three tapped layers (3 × hidden)


def eagle3_taps(layers: int, taps: Any = None) -> tuple[int, ...]:
    """The three taps (0-based decoder-layer outputs) of an EAGLE-3 head over a target of ``layers``
    decoder layers: ``taps`` checked, or EAGLE-3's default :func:`default_taps`. Other than three
    distinct layers is a ValueError (the readers' ``fc`` is 3·hidden wide)."""
    chosen = default_taps(layers) if taps is None else check_taps(taps, layers)
    if len(chosen) != TAPS:
        if taps is None:
            raise ValueError(f"EAGLE-3's default taps for a target of {layers} decoder layers are {list(chosen)}, "
                             "fewer than three layers: give --taps I,J,K (three distinct 0-based layer outputs).")
        raise ValueError(f"An EAGLE-3 head reads three target layers (vLLM's and speculators' fc is 3 × hidden "
                         f"wide); taps {list(chosen)} are {len(chosen)}.")
    return chosen


def check_eagle3_options(options: Any) -> None:
    """A ValueError for a :class:`~flashspec.training.train.TrainOptions` an EAGLE-3 head cannot take."""
    if options.layers != 1:
        raise ValueError(f"An EAGLE-3 head has one decoder layer (the readers load no other); got layers="
                         f"{options.layers}: leave --layers out.")
    if options.rank is not None:
        raise ValueError("An EAGLE-3 head trains whole: no EAGLE-3 reader merges low-rank deltas (leave --rank out).")
    if options.feature_weight:
        raise ValueError("feature_weight is for drafters on the target's last layer: an EAGLE-3 head trains on "
                         "tokens only (its fed-back feature has no true value); leave --feature-weight out.")
    if options.shared_layers is not None or options.head_width is not None:
        raise ValueError("shared_layers and head_width are options of the shallow drafter, not of an EAGLE-3 head.")
    if options.taps is not None and len(options.taps) != TAPS:
        raise ValueError(f"An EAGLE-3 head reads three target layers (vLLM's and speculators' fc is 3 × hidden "
                         f"wide); taps {list(options.taps)} are {len(options.taps)}.")


def new_eagle3_head(target: Any, options: Any, vocab: torch.Tensor | None = None) -> Eagle3Head:
    """An untrained EAGLE-3 head for ``target``, on its device and dtype: one Llama layer of the
    target's sizes (``options.width``, ``options.heads`` as for the feature drafter), ``fc`` over
    ``options.taps`` (default: EAGLE-3's), and ``lm_head`` over ``vocab`` (target ids, sorted; None:
    the whole vocabulary) started from the target's head rows, ``norm`` from the target's final norm."""
    check_eagle3_options(options)
    config = target.config
    taps = eagle3_taps(config.num_hidden_layers, options.taps)
    fields = layer_fields(config)
    if options.width is not None:
        fields["intermediate_size"] = options.width
    if options.heads is not None:
        kv = fields["num_key_value_heads"]
        if options.heads % kv and kv % options.heads:
            raise ValueError(f"heads must divide or be a multiple of the target's {kv} key-value heads; "
                             f"got {options.heads}.")
        fields.update(num_attention_heads=options.heads, num_key_value_heads=min(kv, options.heads))
    size = config.vocab_size
    if vocab is not None:
        vocab = torch.as_tensor(vocab, dtype=torch.long).flatten()
        if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= size or \
                not bool((vocab[1:] > vocab[:-1]).all()):
            raise ValueError(f"vocab must hold sorted distinct token ids in [0, {size}); got {vocab.numel()} ids.")
    head = Eagle3Head(layer_config(fields, size), taps, size, size if vocab is None else vocab.numel(), vocab)
    with torch.no_grad():
        rows = target.lm_head.weight if vocab is None else target.lm_head.weight[vocab.to(target.lm_head.weight.device)]
        head.lm_head.weight.copy_(rows)
        head.norm.weight.copy_(target.model.norm.weight)
    parameter = next(target.parameters())
    return head.placed(parameter.device, parameter.dtype)


def eagle3_passes(head: Eagle3Head, target: Any, ids: torch.Tensor, features: torch.Tensor,
                  count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The head's draft-vocabulary logits and fed-back features over ``count`` unrolled passes
    (SPEC.md §11.6, §11.9): pass 1 feeds the pairs ``(fc(taps)_{t−1}, e_t)``, pass ``j`` the pairs
    ``(ĝ^{(j−1)}_{t−1}, e_t)`` of the previous pass's outputs, each attending as a ``j``-th draft
    does (:func:`chain_mask`), and no query at a position ``≥ 1`` sees pass 1's pair ``(0, e_0)``,
    which the drafter hides (:func:`~flashspec.drafters.eagle3.eagle3_attention`). Earlier passes'
    keys and values are kept, so each pass computes its own queries only. The embedding is the
    target's (or the head's own), frozen."""
    dtype = next(head.parameters()).dtype
    length = ids.shape[1]
    embed = head.embed_tokens if head.embed_tokens is not None else target.model.embed_tokens
    with torch.no_grad():
        embeddings = embed(ids).to(dtype)
    previous = head.fused(features.to(dtype))
    positions = torch.arange(length, device=ids.device)[None]
    masks = chain_mask(count, length, ids.device)
    logits, predicted, before = [], [], None
    for j in range(1, count + 1):
        shifted = torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1)  # ĝ_{t−1}; 0 at t = 0
        visible = masks[(j - 1) * length : j * length, : j * length].clone()
        visible[1:, 0] = False  # pass 1's position 0: the pair (0, e_0), hidden from every later position
        out, keys, values = head.attend(embeddings, shifted, positions, visible, before)
        before = (keys, values)
        normed = head.norm(out)
        logits.append(head.lm_head.subset(normed))
        previous = normed if head.norm_output else out
        predicted.append(previous)
    return logits, predicted


def counted(head: Any, weights: torch.Tensor) -> torch.Tensor:
    """The loss weights ``[b, T]`` for ``head``: an EAGLE-3 head's without position 0 (the pair
    ``(0, e_0)``, which it never drafts from); another head's as they are."""
    if not isinstance(head, Eagle3Head):
        return weights
    weights = weights.clone()
    weights[:, 0] = 0
    return weights


def eagle3_groups(head: Eagle3Head, options: Any) -> list[dict[str, Any]]:
    """The optimizer's groups: ``fc`` (and its input norms), ``norm`` and ``lm_head`` at
    ``lr_head``; the decoder layer at ``lr_layers``. A checkpoint's own embedding stays frozen."""
    outer = [p for m in (head.input_norm, head.fc_norm, head.fc, head.norm, head.lm_head) if m is not None
             for p in m.parameters()]
    return [{"params": outer, "lr": options.lr_head},
            {"params": list(head.layers.parameters()), "lr": options.lr_layers}]


def save_eagle3_head(head: Eagle3Head, target: Any, out: str | Path, log: dict | None = None) -> Path:
    """Write ``head`` to folder ``out`` in the EAGLE layout (``config.json``, ``model.safetensors``:
    what vLLM and SGLang load) and FlashSpec's ``drafter.json``: kind ``eagle3``, taps and sizes, the
    target it belongs to (its record, class and the checksum of its shared tensors) and ``log``."""
    trained_on = {**target_record(target), "architectures": [type(target).__name__]}
    ckpt = head_checkpoint(head, {"name_or_path": trained_on["name_or_path"] or None,
                                  "architectures": trained_on["architectures"]})
    folder = write_eagle3(ckpt, out, "eagle3")
    config = head.config
    record: dict[str, Any] = {
        "format": FORMAT, "kind": KIND, "layout": "eagle3", "layers": 1, "target": trained_on,
        "taps": list(head.taps), "width": config.intermediate_size, "heads": config.num_attention_heads,
        "draft_vocab": None if head.lm_head.vocab is None else ckpt.draft_vocab, "storage": "same",
        "dtype": str(head.fc.weight.dtype).removeprefix("torch."), "weights": "model.safetensors",
        "bytes": (folder / "model.safetensors").stat().st_size, "training": log or {}}
    (folder / "drafter.json").write_text(json.dumps(record, indent=1) + "\n")
    return folder


def check_trained_eagle3(folder: str | Path) -> None:
    """A ValueError unless ``folder`` holds a head that ``train-drafter --layout eagle3`` wrote."""
    folder = Path(folder)
    kind = read_meta(folder).get("kind") if (folder / "drafter.json").is_file() else None
    if kind != KIND:
        raise ValueError(f"{str(folder)!r} is not a head that train-drafter --layout eagle3 wrote (its kind: "
                         f"{kind!r}); with --layout eagle3, --base and --resume continue such a head.")


def load_trained_eagle3(folder: str | Path, target: Any) -> Eagle3Head:
    """The head in ``folder`` that ``train-drafter --layout eagle3`` wrote, to train further
    (``--base``, ``--resume``); a folder of another kind is a ValueError."""
    check_trained_eagle3(folder)
    return load_eagle3_head(folder, target)
