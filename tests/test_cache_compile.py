"""StaticLM under torch.compile on the CPU (inductor): the same logits and cache as eager, and
the KV-cache write stays in place (no per-layer copy of the whole cache, SPEC §3)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from torch._inductor.utils import run_and_get_code

from flashspec.models.static import StaticLM


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def test_compiled_forward_matches_eager_and_fills_the_same_cache():
    model = tiny_llama()
    eager, compiled = StaticLM(model), StaticLM(model, compile=True)
    prompt = torch.randint(0, 64, (2, 20))
    for lm in (eager, compiled):
        lm.reset(2, 300)
        lm.forward(prompt, torch.zeros(2, dtype=torch.long))  # 20 tokens: eager in both
    start = torch.tensor([20, 17])  # row 1 overwrites its last 3 positions (a rollback)
    for width in (1, 3, 1):
        tokens = torch.randint(0, 64, (2, width))
        a, b = eager.forward(tokens, start), compiled.forward(tokens, start)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        start = start + width
    for i in range(2):
        for cache_a, cache_b in ((eager.keys[i], compiled.keys[i]), (eager.values[i], compiled.values[i])):
            torch.testing.assert_close(cache_b[:, :, :24], cache_a[:, :, :24], atol=1e-5, rtol=1e-5)


def test_compiled_forward_writes_the_cache_in_place():
    """Written as a plain ``scatter_`` on the cache (a graph input), the compiled forward would
    allocate a copy of each layer's whole cache, scatter into it and copy it back: work that
    grows with the capacity. ``flashspec::write_kv`` declares the mutation, so it does not."""
    lm = StaticLM(tiny_llama(), compile=True)
    lm.reset(1, 512)
    lm.forward(torch.randint(0, 64, (1, 20)), torch.zeros(1, dtype=torch.long))
    _, code = run_and_get_code(lm.forward, torch.tensor([[5]]), torch.tensor([20]))
    source = "\n".join(code)
    batch, kv_heads, capacity, dim = lm.keys[0].shape
    assert "flashspec.write_kv" in source
    shape = f"({batch}, {kv_heads}, {capacity}, {dim})"
    allocations = [line for line in source.splitlines() if "empty_strided" in line and shape in line]
    assert allocations == []


def test_prefills_never_compile_so_a_new_short_prompt_length_compiles_nothing():
    """Prefills run eagerly even with compile=True (SPEC.md §3): after a first request, requests
    whose prompts have new lengths of at most 16 tokens (the compiled widths) compile nothing —
    the target's prefill nor a model drafter's."""
    from torch._dynamo.utils import counters

    from flashspec import SpeculativeEngine

    target, drafter = tiny_llama(), tiny_llama()
    engine = SpeculativeEngine(target, [drafter], compile=True, device="cpu")
    run = dict(max_new_tokens=6, num_draft_tokens=2, eos_token_id=[])
    engine.generate([[1, 2, 3]], **run)
    graphs = counters["stats"]["unique_graphs"]
    for n in (5, 9, 16):
        out = engine.generate([list(range(1, n + 1))], **run)
        assert len(out.sequences[0]) == 6
    assert counters["stats"]["unique_graphs"] == graphs
