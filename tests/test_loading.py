"""Loading models (flashspec.models.loading): a GGUF file loads as a plain dense model."""

from __future__ import annotations

import pytest
import torch
import transformers

from flashspec.models import loading


def test_a_gguf_file_loads_dense_weights(tmp_path, monkeypatch):
    """FlashSpec's caches fuse, and its kernels read, plain linear weights, and it chooses the dtype
    it computes in by timing: where transformers would keep a GGUF file's quantized weights packed
    (and warn that only float32 is fast), FlashSpec asks it to unpack them."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    seen = {}

    def from_pretrained(where, **kwargs):
        seen.update(kwargs, where=where)
        return torch.nn.Linear(1, 1)

    monkeypatch.setattr(loading, "_require_gguf", lambda: None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    loading.load_model(str(path), "cpu", torch.bfloat16)
    assert seen["gguf_file"] == "model.gguf" and seen["where"] == str(tmp_path) and seen["dtype"] == torch.bfloat16
    if hasattr(transformers, "GgufConfig"):
        assert seen["quantization_config"].dequantize is True
    else:  # older transformers always unpack
        assert "quantization_config" not in seen


def test_other_models_get_no_gguf_options(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda where, **kwargs: seen.update(kwargs) or torch.nn.Linear(1, 1))
    monkeypatch.setattr(loading, "_check_not_empty", lambda spec: None)
    (tmp_path / "config.json").write_text("{}")
    loading.load_model(str(tmp_path), "cpu", torch.float32)
    assert set(seen) == {"dtype"}


def test_a_long_loading_error_is_cut_between_words(tmp_path, monkeypatch):
    """A quoted error keeps whole words: it is cut between two and the cut is marked."""
    words = " ".join(f"word{i}" for i in range(200))

    def from_pretrained(where, **kwargs):
        raise ValueError(f"Unrecognized configuration class for this kind of AutoModel: {words}")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(loading, "_check_not_empty", lambda spec: None)
    with pytest.raises(ValueError, match="not a causal language model") as caught:
        loading.load_model(str(tmp_path), "cpu", torch.float32)
    quoted = str(caught.value).split("causal LM): ", 1)[1]
    assert quoted.endswith(" …") and len(quoted) <= 300
    assert all(w.startswith("word") and w[4:].isdigit() for w in quoted[:-2].split()[11:])
