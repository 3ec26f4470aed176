"""Loading models and tokenizers, and what their configs say about context and attention.

A model is given as a loaded transformers model, a local folder, a hub id or a ``.gguf`` file.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..checks import brief

__all__ = ["DTYPES", "load_model", "load_tokenizer", "context_window", "check_no_sliding_window", "check_causal_lm",
           "eval_mode", "hub_reachable"]

# The precisions a command line may name.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _looks_like_a_path(spec: str) -> bool:
    """A spec no hub id can be (``org/name``): absolute, relative to ``.``/``~``, or deeper."""
    return spec.startswith(("/", "./", "../", "~", "\\")) or spec.count("/") > 1 or "\\" in spec


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers (offline mode counts as unreachable)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_cached(spec: str) -> bool:
    """Whether ``spec`` (a hub id) has a config in the local hub cache (usable offline)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except Exception:  # noqa: BLE001 - a malformed id, an old huggingface_hub: not cached
        return False


def _split_gguf(spec: str) -> tuple[str, dict[str, Any]]:
    """``/dir/file.gguf`` → (``/dir``, ``{"gguf_file": "file.gguf"}``); other specs unchanged."""
    if not spec.strip():
        raise ValueError("The model path or hub id is empty.")
    if not Path(spec).expanduser().exists():
        if _looks_like_a_path(spec):
            raise ValueError(f"Could not load a model from {spec!r}: no such folder or file (it does not exist).")
        if not _hub_cached(spec) and not hub_reachable():  # fail now rather than after the hub's retries
            raise ValueError(f"{spec!r} is neither a local folder or file nor, with the Hugging Face hub "
                             "unreachable (or HF_HUB_OFFLINE=1), a model that can be fetched.")
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
    local = Path(spec).expanduser().exists()
    _check_not_empty(spec)
    if "gguf_file" in extra:
        extra.update(_dense_gguf())
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **extra)
    except OSError as error:
        if local and _weight_files(spec):
            raise ValueError(_corrupt(spec, error)) from None
        raise ValueError(f"Could not load a model from {spec!r}: {error}") from None
    except Exception as error:  # noqa: BLE001 - a local file that does not parse is corrupt or truncated
        if "configuration class" in str(error):  # transformers: no causal-LM class for this config
            raise ValueError(f"{spec!r} is not a causal language model (FlashSpec needs a decoder-only "
                             f"causal LM): {brief(error)}") from None
        if not local:
            raise
        raise ValueError(_corrupt(spec, error)) from None
    return model.to(device).eval()


def _dense_gguf() -> dict[str, Any]:
    """Loading options that unpack a GGUF file's quantized weights into plain dense ones, where
    transformers would otherwise keep them packed (its newer versions): FlashSpec's caches fuse
    and its kernels read the weights of plain linear maps, and it chooses the dtype it computes
    in by timing (SPEC.md §13). Older versions always unpack: no option is needed there."""
    import transformers

    config = getattr(transformers, "GgufConfig", None)
    if config is None or "dequantize" not in inspect.signature(config).parameters:
        return {}
    return {"quantization_config": config(dequantize=True)}


def _check_not_empty(spec: str) -> None:
    """A local folder with no model in it (empty, or no config and weights): say so, rather than
    let the loader call a file there corrupt."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        return
    names = sorted(p.name for p in path.iterdir())
    if not names:
        raise ValueError(f"Could not load a model from {spec!r}: the folder is empty.")
    weights = [n for n in names if n.endswith((".safetensors", ".bin", ".gguf", ".pt", ".pth"))]
    if "config.json" not in names or not weights:
        missing = " and ".join(w for w, ok in (("config.json", "config.json" in names),
                                              ("weights (.safetensors or .bin files)", weights)) if not ok)
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ValueError(f"Could not load a model from {spec!r}: the folder holds no model (no {missing}; "
                         f"it has {shown}).")


def _weight_files(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    return sorted(p for p in path.glob("*") if p.suffix in (".safetensors", ".bin", ".gguf", ".json"))


def _corrupt(spec: str, error: BaseException) -> str:
    files = ", ".join(str(p) for p in _weight_files(spec)) or spec
    return (f"Could not load a model from {spec!r}: a file there looks corrupt or truncated ({files}); "
            f"download or save it again. ({type(error).__name__}: {brief(error)})")


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


def check_causal_lm(model: Any, role: str, known_causal: bool = False) -> None:
    """Refuse models that cannot continue a prompt token by token (encoders such as BERT, also
    when transformers wraps one as ``BertLMHeadModel``; encoder-decoders such as T5): FlashSpec
    needs a decoder-only causal LM. Unless the architecture is ``known_causal``, one tiny forward
    checks it: appending a token must not change the logits of the positions before it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"The {role} ({type(model).__name__}) is an encoder-decoder model; FlashSpec needs a "
                         "decoder-only causal language model (a *ForCausalLM class).")
    name = type(model).__name__
    known = name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() or name.endswith(("ForCausalLM", "LMHeadModel"))
    if not known and not getattr(config, "is_decoder", False):
        raise ValueError(f"The {role} is a {name}, not a causal language model; load it with "
                         "AutoModelForCausalLM (FlashSpec needs a decoder-only causal LM).")
    if not known_causal and not _attends_causally(model):
        raise ValueError(f"The {role} ({name}) is not a causal language model: appending a token changes the "
                         "logits of earlier positions (an encoder such as BERT loaded as a language model?).")


def _attends_causally(model: Any) -> bool:
    ids = torch.arange(3, device=model.device)[None] % model.config.vocab_size
    with torch.no_grad(), eval_mode(model):
        short = model(ids[:, :2]).logits.float()
        full = model(ids).logits.float()[:, :2]
    dtype = next(model.parameters()).dtype
    tolerance = 32 * torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps
    return bool((short - full).abs().max() <= tolerance * (1 + short.abs().max()))  # rounding only


@contextmanager
def eval_mode(*models: Any) -> Iterator[None]:
    """Run with every module of every model in eval mode (no dropout), then put back the mode
    each module had: the engine does not leave a caller's model switched (SPEC.md §5). Models
    already wholly in eval mode (the usual case) are not touched: switching one sets an attribute
    on each of its modules, which cost milliseconds per call on an H200 (CHANGELOG.md)."""
    switched: list[tuple[Any, list[Any]]] = []
    try:
        for m in models:
            training = [module for module in m.modules() if module.training]
            if training:
                switched.append((m, training))
                m.eval()
        yield
    finally:
        for m, training in switched:
            if training[0] is m:  # through the model's own train() (transformers' hooks run there)
                m.train(True)
                ids = {id(module) for module in training}
                for module in m.modules():
                    module.training = id(module) in ids
            else:
                for module in training:
                    module.training = True
