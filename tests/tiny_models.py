"""Tiny random-weight causal LMs for the tests: built from configs, never downloaded.

``tiny_model(arch)`` gives a 2-layer, float32, eval-mode model of one architecture with a small
hidden size and vocabulary; ``noisy_copy(model, noise, seed)`` gives a perturbed deep copy that
agrees with the original often but not always (a drafter that is both accepted and rejected).
"""

from __future__ import annotations

import copy

import torch
import transformers
from transformers import PreTrainedModel

__all__ = ["ARCHITECTURES", "tiny_model", "noisy_copy"]

HIDDEN = 32
LAYERS = 2
HEADS = 4
INTERMEDIATE = 64
CONTEXT = 256
# Larger than transformers' default 0.02 so the logits are peaked: argmax ties and near-ties
# (where a 1e-6 difference between a (k+1)-token and a 1-token forward could flip the greedy
# choice) become negligible, and greedy outputs are not all one repeated token.
INIT = 0.2


def _llama(vocab: int, layers: int = LAYERS) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        initializer_range=INIT, tie_word_embeddings=False,
    )


def _qwen2(vocab: int, layers: int = LAYERS) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        initializer_range=INIT, use_sliding_window=False, sliding_window=None, tie_word_embeddings=False,
    )


def _mistral(vocab: int, layers: int = LAYERS) -> transformers.PretrainedConfig:
    return transformers.MistralConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HIDDEN // HEADS,
        max_position_embeddings=CONTEXT, initializer_range=INIT, sliding_window=None,
        tie_word_embeddings=False,
    )


def _gpt2(vocab: int) -> transformers.PretrainedConfig:
    return transformers.GPT2Config(
        vocab_size=vocab, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTERMEDIATE,
        n_positions=CONTEXT, initializer_range=INIT, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )


def _gpt_neox(vocab: int) -> transformers.PretrainedConfig:
    return transformers.GPTNeoXConfig(
        vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE, max_position_embeddings=CONTEXT, initializer_range=INIT,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )


def _phi3(vocab: int) -> transformers.PretrainedConfig:
    return transformers.Phi3Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        original_max_position_embeddings=CONTEXT, initializer_range=INIT, sliding_window=None,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )


def _gemma(vocab: int) -> transformers.PretrainedConfig:
    return transformers.GemmaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=1, head_dim=HIDDEN // HEADS,
        max_position_embeddings=CONTEXT, initializer_range=INIT,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )


def _opt(vocab: int) -> transformers.PretrainedConfig:
    return transformers.OPTConfig(
        vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        ffn_dim=INTERMEDIATE, word_embed_proj_dim=HIDDEN, max_position_embeddings=CONTEXT,
        init_std=INIT, dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


_CONFIGS = {
    "llama": _llama,
    "qwen2": _qwen2,
    "mistral": _mistral,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "phi3": _phi3,
    "gemma": _gemma,
    "opt": _opt,
}
ARCHITECTURES = tuple(_CONFIGS)


def tiny_model(arch: str, seed: int = 0, vocab_size: int = 128, layers: int | None = None) -> PreTrainedModel:
    """A 2-layer random-weight causal LM of architecture ``arch`` (one of :data:`ARCHITECTURES`),
    float32, eval mode, with no EOS in its generation config. Deterministic in ``seed``.
    ``layers``: another depth (llama, qwen2 and mistral only: deeper targets for fused features)."""
    if arch not in _CONFIGS:
        raise ValueError(f"Unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}.")
    config = _CONFIGS[arch](vocab_size) if layers is None else _CONFIGS[arch](vocab_size, layers)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(torch.float32).eval()
    generation = model.generation_config
    generation.eos_token_id = None
    generation.bos_token_id = None
    generation.pad_token_id = 0
    generation.do_sample = False
    return model


def noisy_copy(model: PreTrainedModel, noise: float, seed: int) -> PreTrainedModel:
    """A deep copy of ``model`` whose every floating-point parameter gets gaussian noise of
    standard deviation ``noise * param.std()`` (deterministic in ``seed``)."""
    clone = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            if not param.is_floating_point() or param.numel() < 2:
                continue
            scale = noise * float(param.std())
            if scale == 0.0:  # e.g. a norm weight initialised to all ones: use its magnitude
                scale = noise * float(param.abs().mean())
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)
    return clone.eval()


# ------------------------------------------------------------------ a tiny corpus for benchmark tests

CORPUS_WORDS = ["def", "return", "self", "class", "the", "of", "and", "alpha", "beta", "gamma", "A:", "B:"]


class CharTokenizer:
    """One token per ASCII character: ids < 128, the tiny models' vocabulary."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 128 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def write_tiny_corpus(folder, lines: int = 3000, seed: int = 0):
    """The corpus folder's three file names (``flashspec.data.corpus.DOMAINS``), each ``lines`` short
    lines of random words, xz-compressed; returns ``folder``."""
    import lzma
    import random

    from flashspec.data.corpus import DOMAINS

    rng = random.Random(seed)
    for name in DOMAINS.values():
        text = [" ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(3, 10))) for _ in range(lines)]
        (folder / name).write_bytes(lzma.compress("\n".join(text).encode()))
    return folder


def history_of(rows: list[list[int]], capacity: int | None = None):
    """A drafter's ``History``: zero-padded ``tokens [B, capacity]`` and ``length [B]`` from
    lists of committed tokens."""
    from flashspec.drafters.base import History

    capacity = capacity or max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), capacity, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    return History(tokens, torch.tensor([len(r) for r in rows], dtype=torch.long))

