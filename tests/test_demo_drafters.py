"""The demo target's committed drafters (flashspec/checkpoints, SPEC.md §11): whole, small, and
loadable as the design they record — checked without the 1.5B target, which CI does not have."""

import hashlib
import json

import pytest
import torch
from transformers import Qwen2Config

from flashspec.demo import DEMO_DOMAINS, DEMO_DRAFTERS, demo_drafter, demo_pair
from flashspec.drafters.feature import FeatureHead
from flashspec.drafters.checkpoint import read_tensors as _read_tensors
from flashspec.drafters.low_rank import merge_low_rank

# Qwen2.5-Coder-1.5B-Instruct's shape (its config.json), the target the drafters were trained for.
TARGET = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768)


def _meta(domain):
    return json.loads((DEMO_DRAFTERS / domain / "drafter.json").read_text())


@pytest.mark.parametrize("domain", DEMO_DOMAINS)
def test_each_committed_drafter_is_whole_small_and_names_its_target(domain):
    meta, weights = _meta(domain), DEMO_DRAFTERS / domain / "drafter.safetensors"
    assert meta["kind"] == "feature" and demo_drafter(domain) == f"feature:{DEMO_DRAFTERS / domain}"
    size = weights.stat().st_size
    assert meta.get("bytes", size) == size <= 16 * 10**6  # one file back from the device; records before "bytes" lack it
    target = meta["target"]
    assert (target["model_type"], target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]) == (
        "qwen2", TARGET.hidden_size, TARGET.num_hidden_layers, TARGET.vocab_size)
    if domain != "general":  # a low-rank delta over the general drafter, named by path and checksum
        base = (DEMO_DRAFTERS / domain / meta["base"]["path"]).resolve()
        assert base == (DEMO_DRAFTERS / "general").resolve()
        assert hashlib.sha256((base / "drafter.safetensors").read_bytes()).hexdigest() == meta["base"]["sha256"]


@pytest.mark.parametrize("domain", DEMO_DOMAINS)
def test_each_committed_drafter_loads_as_the_design_it_records(domain):
    general = _meta("general")
    tensors = _read_tensors(DEMO_DRAFTERS / "general")
    head = FeatureHead(TARGET, general["layers"], general["width"], general["heads"], tensors["vocab"],
                       general.get("taps"))
    head.load_state_dict(tensors)  # strict: every tensor of the design, no other
    assert head.taps is None and head.fuse is None  # made before taps: the last-layer drafter it always was
    assert head.vocab.numel() == general["vocab"] == 32768
    before = head.fc.weight.detach().clone()
    if domain != "general":
        merge_low_rank(head, _read_tensors(DEMO_DRAFTERS / domain))
        delta = head.fc.weight - before
        assert 0 < delta.abs().max() < before.abs().max()  # a small change, not a replacement
    assert all(torch.isfinite(p).all() for p in head.parameters())


def test_bad_demo_choices_are_clear_errors():
    with pytest.raises(ValueError, match="general, code, prose, chat"):
        demo_drafter("poetry")
    with pytest.raises(ValueError, match="feature, model"):
        demo_pair("tiny")
