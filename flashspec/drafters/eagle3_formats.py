"""EAGLE-3 checkpoints in the two layouts the field ships (SPEC.md §11.9): read, check, write.

* **EAGLE layout** (SafeAILab/EAGLE, SpecForge, the hub's ``EAGLE3-*`` heads; served by vLLM and
  SGLang): a Llama ``config.json`` with ``draft_vocab_size`` (architecture
  ``LlamaForCausalLMEagle3``), weights ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``,
  ``t2d`` and sometimes ``embed_tokens``.
* **speculators layout** (vllm-project/speculators, ``Eagle3Speculator``): ``config.json`` with
  ``speculators_model_type: "eagle3"``, ``speculators_config``, ``transformer_layer_config`` and
  the norm options; the same weights with ``layers.0.*`` for ``midlayer.*``.

:func:`read_eagle3` turns either into one :class:`Eagle3Checkpoint` (``speculators``' tensor
names, the layer's config, the taps in vLLM's numbering), refusing other drafter kinds by name;
:func:`load_eagle3_head` checks it against a target and builds the :class:`Eagle3Head`;
:func:`write_eagle3` writes it in either layout, refusing what the layout cannot express;
:func:`head_checkpoint` is the checkpoint of a head in memory (one ``train-drafter --layout
eagle3`` trained); :func:`target_embedding` reads a target's token embedding from its weights,
which the speculators layout carries. A folder that FlashSpec trained also holds its
``drafter.json`` (kind ``eagle3``): the target it was trained on, checked when it loads, and its
training record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checks import brief
from .checkpoint import read_meta, shared_checksum
from .eagle3 import Eagle3Head

__all__ = ["KIND", "LAYOUTS", "Eagle3Checkpoint", "default_aux_ids", "head_checkpoint", "layer_fields",
           "load_eagle3_head", "read_eagle3", "target_embedding", "write_eagle3"]

KIND = "eagle3"  # the kind in the drafter.json of a head that flashspec train-drafter --layout eagle3 wrote

LAYOUTS = ("eagle3", "speculators")
# The layer fields both layouts carry (a Llama config's), copied as they are.
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias", "max_position_embeddings",
                "rope_theta", "rope_scaling", "rope_parameters", "pad_token_id", "torch_dtype", "dtype")
OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config fields this writes


def default_aux_ids(layers: int) -> tuple[int, ...]:
    """EAGLE-3's default taps in vLLM's numbering (id ``n``: the hidden state entering layer
    ``n``, i.e. the output of the first ``n`` layers): ``2, L//2, L − 3``."""
    return (2, layers // 2, layers - 3)


@dataclass
class Eagle3Checkpoint:
    """One EAGLE-3 head, whatever its layout: ``tensors`` under ``speculators``' names
    (``layers.0.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, ``embed_tokens``, ``input_norm``,
    ``fc_norm.i``), ``layer`` the decoder layer's config fields, ``aux_ids`` the taps in vLLM's
    numbering (None: the default for the target's depth)."""

    layout: str
    layer: dict[str, Any]
    layer_type: str  # "llama" or "qwen3" (q/k norms)
    vocab_size: int
    draft_vocab: int
    aux_ids: tuple[int, ...] | None
    options: dict[str, bool]
    tensors: dict[str, torch.Tensor]
    verifier: dict[str, Any] = field(default_factory=dict)
    target_hidden: int | None = None  # the target's hidden size where the config names it
    record: dict[str, Any] | None = None  # FlashSpec's drafter.json, for a head train-drafter wrote

    @property
    def hidden(self) -> int:
        return int(self.layer["hidden_size"])


def _refuse(folder: Path, what: str) -> ValueError:
    return ValueError(f"{str(folder)!r} looks like {what}, which FlashSpec does not load; it loads EAGLE-3 heads "
                      "(EAGLE/SpecForge layout or speculators' Eagle3Speculator) as 'eagle3:DIR'.")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The weights in ``folder``: ``model.safetensors`` (or its shards) or ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    try:
        if (folder / "model.safetensors").is_file():
            return load_file(str(folder / "model.safetensors"))
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                tensors.update(load_file(str(folder / shard)))
            return tensors
        if (folder / "pytorch_model.bin").is_file():
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file
        raise ValueError(f"Could not read the weights in {str(folder)!r} (corrupt or truncated?): "
                         f"{type(error).__name__}: {brief(error, 200)}") from None
    raise ValueError(f"{str(folder)!r} holds no weights (model.safetensors, its index, or pytorch_model.bin).")


def _classify(folder: Path, config: dict[str, Any]) -> str:
    """``"speculators"`` or ``"eagle3"`` for an EAGLE-3 head's config; ValueError naming any other kind."""
    kind = config.get("speculators_model_type") or (config.get("speculators_config") or {}).get("algorithm")
    if kind is not None:
        if kind != "eagle3":
            names = {"eagle": "an EAGLE-1/2 (HASS) head", "dflash": "a DFlash drafter", "peagle": "a P-EAGLE drafter",
                     "mtp": "a multi-token-prediction (MTP) head", "fastmtp": "a multi-token-prediction (MTP) head"}
            raise _refuse(folder, f"a speculators {names.get(kind, repr(kind) + ' drafter')}")
        return "speculators"
    text = " ".join(config.get("architectures") or []).lower()
    model_type = str(config.get("model_type", ""))
    if "dflash" in text or "dflash_config" in config:
        raise _refuse(folder, "a DFlash drafter")
    if "mtp" in text or "nextn" in text or model_type.endswith("_mtp") or "num_nextn_predict_layers" in config:
        raise _refuse(folder, "a multi-token-prediction (MTP) head")
    return "eagle3"


def _layer_config(config: dict[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in LAYER_FIELDS if config.get(k) is not None}


def read_eagle3(path: str | Path) -> Eagle3Checkpoint:
    """The EAGLE-3 head in folder ``path`` (either layout). Other drafter kinds (FlashSpec's own,
    EAGLE-1/2, P-EAGLE, DFlash, MTP heads, several-layer heads) are a ValueError saying what they
    look like."""
    folder = Path(path)
    record = read_meta(folder) if (folder / "drafter.json").is_file() else None
    if record is not None and record.get("kind") != KIND:
        raise ValueError(f"{str(folder)!r} is a FlashSpec drafter checkpoint: load it as 'feature:DIR' or "
                         "'shallow:DIR'.")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(folder)!r} is not an EAGLE-3 checkpoint (no config.json there).")
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(folder / 'config.json')!r} is corrupt: {error}") from None
    layout = _classify(folder, config)
    tensors = _read_tensors(folder)
    if any(k.endswith("mask_hidden") for k in tensors):
        raise _refuse(folder, "a P-EAGLE (parallel drafting) head")
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    if layout == "speculators":
        layer = dict(config.get("transformer_layer_config") or {})
        options = {k: bool(config.get(k, False)) for k in OPTIONS}
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        verifier = dict((config.get("speculators_config") or {}).get("verifier") or {})
    else:
        layer = config
        options = {k: bool(config.get(k, False)) for k in OPTIONS}
        aux = config.get("eagle_aux_hidden_state_layer_ids")  # vLLM's numbering
        sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")  # SGLang's: outputs
        if sglang is not None:
            as_vllm = [int(i) + 1 for i in sglang]
            if aux is not None and [int(i) for i in aux] != as_vllm:
                raise ValueError(f"{str(folder)!r} names two different taps: eagle_aux_hidden_state_layer_ids {aux} "
                                 f"(vLLM: layer inputs) and eagle_config's {sglang} (SGLang: layer outputs).")
            aux = as_vllm
        target = (record or {}).get("target", {})  # the target a FlashSpec-trained head was trained on
        verifier = {k: v for k, v in (("name_or_path", target.get("name_or_path")),
                                      ("architectures", target.get("architectures"))) if v}
    hidden = layer.get("hidden_size")
    needed = ("layers.0.self_attn.q_proj.weight", "fc.weight", "lm_head.weight")
    if not isinstance(hidden, int) or any(k not in tensors for k in needed):
        if "fc.weight" in tensors and hidden and tensors["fc.weight"].shape[1] == 2 * hidden:
            raise _refuse(folder, "an EAGLE-1/2 head (fc over [embedding; feature], no 3-layer fusion)")
        raise _refuse(folder, f"an unknown drafter (weights {sorted(tensors)[:6]}…)")
    if tensors["layers.0.self_attn.q_proj.weight"].shape[1] != 2 * hidden:
        raise _refuse(folder, "an EAGLE-1/2 head (its layer's attention reads hidden, not the 2·hidden pair)")
    if any(k.startswith("layers.1.") for k in tensors) or int(layer.get("num_hidden_layers", 1)) != 1:
        raise _refuse(folder, "an EAGLE-3 head of several decoder layers")
    layer_type = str(layer.get("model_type", "llama"))
    if layer_type not in ("llama", "qwen3"):
        raise _refuse(folder, f"an EAGLE-3 head whose layer is a {layer_type!r} layer (llama and qwen3 are supported)")
    draft_vocab = int(config.get("draft_vocab_size") or tensors["lm_head.weight"].shape[0])
    vocab_size = int(tensors["t2d"].numel()) if "t2d" in tensors else int(layer.get("vocab_size", draft_vocab))
    return Eagle3Checkpoint(layout, _layer_config(layer), layer_type, vocab_size, draft_vocab,
                            None if aux is None else tuple(int(i) for i in aux), options, tensors, verifier,
                            config.get("target_hidden_size"), record)


def _draft_ids(ckpt: Eagle3Checkpoint, folder: str) -> torch.Tensor | None:
    """The target id of each draft id, ``d + d2t[d]`` (None: the target's vocabulary, in order)."""
    d2t = ckpt.tensors.get("d2t")
    if d2t is None:
        if ckpt.draft_vocab != ckpt.vocab_size:
            raise ValueError(f"The EAGLE-3 head in {folder!r} drafts over {ckpt.draft_vocab} tokens but has no "
                             "d2t map.")
        return None
    ids = torch.arange(d2t.numel()) + d2t.to(torch.long)
    if d2t.numel() != ckpt.draft_vocab or int(ids.min()) < 0 or int(ids.max()) >= ckpt.vocab_size \
            or ids.unique().numel() != ids.numel():
        raise ValueError(f"The EAGLE-3 head in {folder!r} has a d2t map that is not {ckpt.draft_vocab} distinct target "
                         f"ids below {ckpt.vocab_size} (d2t is an offset: target id = draft id + d2t[draft id]).")
    t2d = ckpt.tensors.get("t2d")
    if t2d is not None and (int(t2d.to(torch.bool).sum()) != ids.numel() or not bool(t2d.to(torch.bool)[ids].all())):
        raise ValueError(f"The EAGLE-3 head in {folder!r} has t2d and d2t maps that disagree.")
    if ckpt.draft_vocab == ckpt.vocab_size and bool((ids == torch.arange(ids.numel())).all()):
        return None
    return ids


def layer_config(fields: dict[str, Any], vocab_size: int) -> Any:
    """The draft layer's config ``fields`` (a checkpoint's) as a transformers ``LlamaConfig``
    (rotary settings included)."""
    from transformers import LlamaConfig

    layer = dict(fields)
    heads = int(layer["num_attention_heads"])
    rope = layer.pop("rope_parameters", None)
    scaling, theta = layer.pop("rope_scaling", None), layer.pop("rope_theta", None)
    if rope is None:
        rope = dict(scaling or {})
        rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type") or "default"
        rope["rope_theta"] = theta if theta is not None else 10000.0
    layer.pop("torch_dtype", None), layer.pop("dtype", None)
    return LlamaConfig(**{**layer, "num_hidden_layers": 1, "vocab_size": vocab_size,
                          "head_dim": layer.get("head_dim") or int(layer["hidden_size"]) // heads,
                          "num_key_value_heads": layer.get("num_key_value_heads") or heads,
                          "rope_parameters": rope})


def layer_fields(config: Any) -> dict[str, Any]:
    """The draft layer's config fields as both layouts write them, from a transformers ``config``
    (the target's, or a head's ``LlamaConfig``): its sizes, no biases, and the rotary settings both
    as transformers 5 names them (``rope_parameters``) and as transformers 4 does (``rope_theta``,
    ``rope_scaling`` when not the default), so that readers on either build the same rotary embedding."""
    heads = config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope.setdefault("rope_type", "default")
    fields = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
              "num_attention_heads": heads,
              "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
              "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
              "rms_norm_eps": config.rms_norm_eps, "hidden_act": config.hidden_act, "attention_bias": False,
              "mlp_bias": False, "max_position_embeddings": config.max_position_embeddings, "rope_theta": theta,
              "rope_parameters": {**rope, "rope_theta": theta}}
    if rope["rope_type"] != "default":
        fields["rope_scaling"] = rope
    return fields


def head_checkpoint(head: Eagle3Head, verifier: dict[str, Any] | None = None) -> Eagle3Checkpoint:
    """The checkpoint of ``head`` for :func:`write_eagle3`: its parameters under ``speculators``'
    names (the buffers are derived), ``d2t`` offsets and the ``t2d`` mask for a draft vocabulary
    (none for the target's vocabulary in order), its options, the taps in vLLM's numbering, and
    ``verifier`` (``name_or_path``, ``architectures``) for the speculators layout."""
    tensors = {k: v.detach() for k, v in head.state_dict().items()}
    vocab, size, draft = head.lm_head.vocab, head.lm_head.vocab_size, int(head.lm_head.weight.shape[0])
    if vocab is not None:
        vocab = vocab.cpu()
        tensors["d2t"] = vocab - torch.arange(draft)
        tensors["t2d"] = torch.zeros(size, dtype=torch.bool).index_fill(0, vocab, True)
    layer = {**layer_fields(head.config), "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch.")}
    options = {"norm_before_residual": head.norm_before_residual, "norm_before_fc": head.input_norm is not None,
               "fc_norm": head.fc_norm is not None, "norm_output": head.norm_output}
    layer_type = "llama" if head.layers[0].self_attn.q_norm is None else "qwen3"
    return Eagle3Checkpoint("eagle3", layer, layer_type, size, draft, tuple(t + 1 for t in head.taps), options,
                            tensors, dict(verifier or {}))


def load_eagle3_head(path: str | Path, target: Any) -> Eagle3Head:
    """The EAGLE-3 head in folder ``path`` for ``target``, on its device and dtype. A head made
    for another target (hidden size, vocabulary, taps beyond its depth, the verifier's
    architecture) is a ValueError before any forward."""
    folder = str(path)
    ckpt = read_eagle3(path)
    config = target.config
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    other = f"The EAGLE-3 head in {folder!r} was made for another target"
    if ckpt.hidden != hidden:
        raise ValueError(f"{other}: hidden size {ckpt.hidden} ≠ the target's {hidden}.")
    if (ckpt.target_hidden or hidden) != hidden:
        raise ValueError(f"{other}: target_hidden_size {ckpt.target_hidden} ≠ the target's hidden size {hidden}.")
    if ckpt.vocab_size != vocab:
        raise ValueError(f"{other}: vocabulary of {ckpt.vocab_size} tokens ≠ the target's {vocab}.")
    arch = ckpt.verifier.get("architectures")
    if arch and type(target).__name__ not in arch:
        raise ValueError(f"{other}: verifier architecture {list(arch)} ≠ the target's {type(target).__name__}.")
    trained_on = (ckpt.record or {}).get("target", {})
    if "shared_sha256" in trained_on and trained_on["shared_sha256"] != shared_checksum(target):
        raise ValueError(f"{other} ({trained_on.get('name_or_path') or 'unnamed'}): its shared weights differ "
                         "(the target's embedding, final norm or head).")
    aux = ckpt.aux_ids if ckpt.aux_ids is not None else default_aux_ids(layers)
    if any(not 1 <= n <= layers for n in aux) or len(set(aux)) != len(aux):
        raise ValueError(f"{other}: it reads the hidden states entering layers {list(aux)} (vLLM's numbering), "
                         f"outside 1 … {layers} for this target of {layers} decoder layers.")
    fc = ckpt.tensors["fc.weight"]
    if tuple(fc.shape) != (hidden, len(aux) * hidden):
        raise ValueError(f"{other}: its fc maps {fc.shape[1]} → {fc.shape[0]}, not {len(aux)} taps × {hidden} "
                         f"→ {hidden}.")
    embed = ckpt.tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (vocab, hidden):
        raise ValueError(f"{other}: its embedding is {tuple(embed.shape)}, not ({vocab}, {hidden}).")
    shared = target.get_input_embeddings().weight
    if embed is not None and torch.equal(embed.to(torch.bfloat16), shared.detach().to("cpu", torch.bfloat16)):
        embed = None  # the target's own (rounded alike): share it rather than copy it
    head = Eagle3Head(layer_config(ckpt.layer, ckpt.vocab_size), tuple(n - 1 for n in aux), vocab, ckpt.draft_vocab,
                      _draft_ids(ckpt, folder),
                      fc_bias="fc.bias" in ckpt.tensors, qk_norm=ckpt.layer_type == "qwen3",
                      embed=None if embed is None else embed.float(), **ckpt.options)
    weights = {k: v for k, v in ckpt.tensors.items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    if head.embed_tokens is not None:
        weights["embed_tokens.weight"] = head.embed_tokens.weight
    try:
        _load_strict(head, weights)
    except Exception as error:  # noqa: BLE001 - missing or misshapen tensors
        raise ValueError(f"Could not read the EAGLE-3 weights in {folder!r}: {type(error).__name__}: "
                         f"{brief(error, 300)}") from None
    parameter = next(target.parameters())
    return head.placed(parameter.device, parameter.dtype).eval()


def _load_strict(head: Eagle3Head, weights: dict[str, torch.Tensor]) -> None:
    """Every parameter of ``head`` from ``weights`` and no tensor left over (buffers derived, not loaded)."""
    params = dict(head.named_parameters())
    missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or extra:
        raise KeyError(f"missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            if tuple(param.shape) != tuple(weights[name].shape):
                raise KeyError(f"{name} is {tuple(weights[name].shape)}, expected {tuple(param.shape)}")
            param.copy_(weights[name].to(param.dtype))


def target_embedding(name_or_path: str) -> torch.Tensor:
    """The token embedding (``…embed_tokens.weight``) of the model ``name_or_path``, a folder or a
    hub id, read from its safetensors: the index, then only the file that holds it. A model whose
    weights hold none is a ValueError."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    from ..models.loading import hub_reachable

    local = Path(name_or_path).expanduser()
    where = str(local) if local.is_dir() else name_or_path
    offline = not local.is_dir() and not hub_reachable()  # the local hub cache only, rather than the hub's retries
    place = ("there" if local.is_dir() else "in the local hub cache (the hub is unreachable)" if offline
             else "on the hub")

    def fetch(name: str) -> str | None:
        try:
            return cached_file(where, name, local_files_only=offline, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
        except Exception as error:  # noqa: BLE001 - neither a folder nor a hub id, a gated or unknown repo
            raise ValueError(f"Could not read the token embedding of {name_or_path!r} (a folder or hub id): "
                             f"{brief(error, 200)}") from None

    try:
        index = fetch("model.safetensors.index.json")
        if index is not None:
            weight_map = dict(json.loads(Path(index).read_text())["weight_map"])
        else:
            single = fetch("model.safetensors")
            if single is None:
                raise ValueError(f"Could not read the token embedding of {name_or_path!r}: no model.safetensors "
                                 f"(nor its index) {place}.")
            with safe_open(single, framework="pt") as file:
                weight_map = dict.fromkeys(file.keys(), "model.safetensors")
        keys = [k for k in weight_map if k.endswith("embed_tokens.weight")]
        if not keys:
            raise ValueError(f"{name_or_path!r}'s weights hold no embed_tokens.weight (its token embedding).")
        key = min(keys, key=len)  # model.embed_tokens.weight before a tower's
        shard = fetch(weight_map[key])
        if shard is None:
            raise ValueError(f"Could not read the token embedding of {name_or_path!r}: no {weight_map[key]} {place}.")
        with safe_open(shard, framework="pt", device="cpu") as file:
            return file.get_tensor(key)
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - a corrupt index or weights file
        raise ValueError(f"Could not read the token embedding of {name_or_path!r}: {type(error).__name__}: "
                         f"{brief(error, 200)}") from None


def write_eagle3(ckpt: Eagle3Checkpoint, out: str | Path, layout: str) -> Path:
    """Write ``ckpt`` in ``layout`` (``"eagle3"``: EAGLE/SpecForge, ``"speculators"``) to folder
    ``out``: the same tensors under the layout's names, so it drafts exactly as before. What the
    layout's readers (the reference code, vLLM, SGLang, speculators) cannot express is a ValueError:
    an ``fc`` bias (both), in the EAGLE layout a Qwen3 layer, ``norm_before_fc``, ``fc_norm`` and
    ``norm_output``, and in the speculators layout a head without ``embed_tokens.weight``:
    speculators' ``Eagle3DraftModel.from_pretrained`` takes the embedding from the checkpoint, and
    where it has none leaves it as transformers materialises a missing weight, uninitialised memory
    (its check for the verifier's embedding looks for NaN, which that memory seldom holds); give it
    the target's, :func:`target_embedding`."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}.")
    if "fc.bias" in ckpt.tensors:
        raise ValueError("This head's fc has a bias, which neither layout's readers load (their fc has none).")
    if layout == "speculators" and "embed_tokens.weight" not in ckpt.tensors:
        raise ValueError("A speculators checkpoint carries the token embedding (speculators' Eagle3DraftModel reads "
                         "it from the checkpoint): add the target's as embed_tokens.weight (target_embedding).")
    if layout == "eagle3":
        extra = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if ckpt.options.get(k)]
        if ckpt.layer_type != "llama" or extra:
            raise ValueError(f"The EAGLE layout cannot express {extra or 'a qwen3 layer'}: export it --to speculators.")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    layer = {**ckpt.layer, "model_type": ckpt.layer_type, "num_hidden_layers": 1, "vocab_size": ckpt.vocab_size,
             "tie_word_embeddings": False}
    if layout == "eagle3":
        config: dict[str, Any] = {"architectures": ["LlamaForCausalLMEagle3"], **layer,
                                  "draft_vocab_size": ckpt.draft_vocab}
        if ckpt.options.get("norm_before_residual"):
            config["norm_before_residual"] = True
        if ckpt.target_hidden is not None:
            config["target_hidden_size"] = ckpt.target_hidden
        if ckpt.aux_ids is not None:  # both servers' keys, each in its own numbering
            config["eagle_aux_hidden_state_layer_ids"] = list(ckpt.aux_ids)
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [n - 1 for n in ckpt.aux_ids],
                                      "use_aux_hidden_state": True}
        names = {k: ("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k) for k in ckpt.tensors}
    else:
        verifier = {"name_or_path": ckpt.verifier.get("name_or_path"),
                    "architectures": list(ckpt.verifier.get("architectures") or [])}
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
                  "draft_vocab_size": ckpt.draft_vocab, "target_hidden_size": ckpt.target_hidden,
                  "eagle_aux_hidden_state_layer_ids": None if ckpt.aux_ids is None else list(ckpt.aux_ids),
                  **{k: bool(ckpt.options.get(k)) for k in OPTIONS},
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                         "verifier": verifier}}
        names = {k: k for k in ckpt.tensors}
    tensors = {names[k]: v.detach().contiguous().cpu() for k, v in ckpt.tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
