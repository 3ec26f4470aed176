"""Bit-exact 16-bit decoding (SPEC.md §14, ``SpeculativeEngine(..., bit_exact=True)``): a decode
forward's logits and cache entries at a position do not depend on how many positions the forward
feeds or on the batch's other sequences, so bf16 speculative greedy output equals target-only
greedy output token for token, for every drafter kind; and clear errors where the mode cannot
hold. On a CPU the Triton kernels run through Triton's interpreter (tests/conftest.py); the same
checks run natively on a GPU in tests/test_gpu.py."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import transformers

from flashspec import FeatureHead, SpeculativeEngine
from flashspec.models.static import StaticLM
from flashspec.drafters.checkpoint import save_drafter
from tiny_models import noisy_copy, tiny_model

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16 = torch.bfloat16


def _qwen3(seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny Qwen3 (per-head query and key RMSNorms), float32."""
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for layer in model.model.layers:  # norms that are not all ones, so that folding them in shows
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data = 1 + 0.3 * torch.randn(norm.weight.shape)
    model.generation_config.eos_token_id = None
    return model


def _bf16(arch: str, seed: int = 0) -> transformers.PreTrainedModel:
    return (_qwen3(seed) if arch == "qwen3" else tiny_model(arch, seed)).to(DEVICE, BF16)


def _exact_lm(model, batch: int) -> StaticLM:
    lm = StaticLM(model)
    lm.bit_exact = True
    lm.reset(batch, 64)
    return lm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_and_cache_do_not_depend_on_the_forward_width_or_the_batch(arch):
    """After one prefill (20 tokens: the cuBLAS/SDPA path), five 1-token forwards and one 5-token
    forward give bit-identical logits and write bit-identical keys and values; each sequence of
    a ragged batch of two decodes to the same bits alone (from the same cache contents)."""
    model = _bf16(arch)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (2, 20), generator=gen).to(DEVICE)
    feed = torch.randint(0, 128, (2, 5), generator=gen).to(DEVICE)
    start = torch.tensor([20, 13], device=DEVICE)  # ragged: the second row's prompt is 13 tokens

    wide = _exact_lm(model, 2)
    wide.forward(prompt, torch.zeros(2, dtype=torch.long, device=DEVICE), eager=True)
    narrow = _exact_lm(model, 2)
    for mine, theirs in zip(narrow.keys + narrow.values, wide.keys + wide.values):
        mine.copy_(theirs)  # the same prefill
    alone = [_exact_lm(model, 1) for _ in range(2)]
    for b, lm in enumerate(alone):
        for mine, theirs in zip(lm.keys + lm.values, wide.keys + wide.values):
            mine.copy_(theirs[b : b + 1])

    logits = wide.forward(feed, start)  # the verify forward: [2, 5, V]
    steps = torch.cat([narrow.forward(feed[:, j : j + 1], start + j) for j in range(5)], dim=1)
    assert torch.equal(steps, logits)
    for mine, theirs in zip(narrow.keys + narrow.values, wide.keys + wide.values):
        assert torch.equal(mine, theirs)
    for b, lm in enumerate(alone):
        assert torch.equal(lm.forward(feed[b : b + 1], start[b : b + 1])[0], logits[b])
    reference = model(torch.cat([prompt[:1], feed[:1]], dim=1)).logits[0, 20:]  # the model itself, close
    torch.testing.assert_close(logits[0].float(), reference.float(), atol=0.15, rtol=0.05)


def _feature_drafter(target) -> str:
    folder = tempfile.mkdtemp(prefix="flashspec-bitexact-feature-")
    torch.manual_seed(3)
    save_drafter(FeatureHead(target.config, 1), target, folder)
    return f"feature:{folder}"


PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 1, 3, 5, 9, 2, 7, 11, 4, 6, 8, 10, 12], [7, 8, 9]]


@pytest.mark.parametrize("drafter,gamma,batch,arch", [
    ("itself", 4, 2, "qwen2"),  # drafter == target: long accepted runs
    ("noisy", 1, 1, "qwen2"),   # p != q, gamma = 1, batch 1
    ("ngram", 3, 2, "qwen2"),
    ("feature", 2, 2, "qwen2"),
    ("itself", 3, 2, "qwen3"),  # per-head norms in the rotation's kernel
])
def test_greedy_speculative_equals_target_only_in_bf16(drafter, gamma, batch, arch):
    """The promise of the mode: in bf16, greedy speculative output equals target-only output token
    for token (ragged batch of a 20- and a 3-token prompt, and batch 1), for a model drafter (the
    target itself, a noisy copy), n-gram and a feature drafter made from the target."""
    target = _bf16(arch)
    drafters = {"itself": lambda: [target], "noisy": lambda: [noisy_copy(tiny_model("qwen2"), 0.05, 1).to(DEVICE, BF16)],
                "ngram": lambda: ["ngram"], "feature": lambda: [_feature_drafter(target)]}[drafter]()
    prompts = PROMPTS[:batch]
    alone = SpeculativeEngine(target, [], bit_exact=True).generate(prompts, max_new_tokens=16, eos_token_id=[])
    engine = SpeculativeEngine(target, drafters, selector="fixed", bit_exact=True)
    assert engine.bit_exact
    out = engine.generate(prompts, max_new_tokens=16, num_draft_tokens=gamma, eos_token_id=[])
    assert out.sequences == alone.sequences
    if drafter == "itself":  # drafts were accepted: 16 tokens in far fewer than 16 verify forwards
        assert out.stats.accepted > 0 and out.stats.steps <= 8


def test_errors_say_why_the_mode_cannot_hold(monkeypatch):
    """ValueError with the reason: not a bool; an architecture without StaticLM; float32; norms the
    kernels do not fold in (the layers' or Qwen3's per-head ones); a tensor-parallel rank; no Triton."""
    target = _bf16("qwen2")
    with pytest.raises(ValueError, match="True or False"):
        SpeculativeEngine(target, [], bit_exact="yes")
    with pytest.raises(ValueError, match="architecture"):
        SpeculativeEngine(tiny_model("gpt2").to(DEVICE, BF16), [], bit_exact=True)
    with pytest.raises(ValueError, match="bfloat16 and float16"):
        SpeculativeEngine(tiny_model("qwen2").to(DEVICE), [], bit_exact=True)
    qwen3 = _bf16("qwen3")
    qwen3.model.layers[0].self_attn.k_norm = torch.nn.LayerNorm(8).to(DEVICE, BF16)  # not an RMSNorm
    with pytest.raises(ValueError, match="per-head query and key norms"):
        SpeculativeEngine(qwen3, [], bit_exact=True)
    gelu = tiny_model("llama")
    gelu.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="RMSNorms or its MLP activation"):
        SpeculativeEngine(gelu.to(DEVICE, BF16), [], bit_exact=True)
    lm = StaticLM(target)
    monkeypatch.setattr(target, "_flashspec_tp", object(), raising=False)
    with pytest.raises(ValueError, match="tensor-parallel"):
        lm.bit_exact = True
    monkeypatch.delattr(target, "_flashspec_tp")
    monkeypatch.setattr("flashspec.kernels.attention.available", lambda x: False)
    with pytest.raises(ValueError, match="CUDA GPU with Triton"):
        lm.bit_exact = True
    assert not lm.bit_exact and not SpeculativeEngine(target, []).bit_exact


def test_the_command_line_flag(tmp_path, capsys, monkeypatch):
    """``flashspec generate --bit-exact``: a float32 target is a clean error; in bf16 the comparison
    with target-only (run in the same mode) reports identical outputs; a CPU without Triton's
    interpreter is refused before the model loads."""
    from chat_tokenizer import save_tiny_chat_pair
    from flashspec.cli import main

    target, draft = save_tiny_chat_pair(tmp_path)
    common = ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def f(x):",
              "--num-draft-tokens", "2", "--max-new-tokens", "8", "--bit-exact", "--device", str(DEVICE)]
    assert main([*common, "--dtype", "float32"]) == 2
    assert "bit_exact=True is not available here: it is for bfloat16" in capsys.readouterr().err
    assert main([*common, "--dtype", "bfloat16", "--compare", "--repeats", "1"]) == 0
    assert "outputs identical" in capsys.readouterr().out
    if not torch.cuda.is_available():  # without the interpreter: refused before anything loads
        monkeypatch.setattr("flashspec.kernels.shim.interpreted", lambda: False)
        assert main([*common[:2], "/nonexistent/model.gguf", *common[3:], "--dtype", "bfloat16"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
