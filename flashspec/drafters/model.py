"""A drafter that is a (smaller) causal LM sharing the target's vocabulary."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..cache import CachedLM, right_align
from ..sampling import SamplingParams, probabilities, sample
from .base import Draft, History


class ModelDrafter:
    """Drafts autoregressively with its own KV cache (SPEC.md §4).

    The cache always holds a prefix of each row's committed tokens: ``propose`` first feeds the
    committed tokens it has not seen (one forward, however many), and ``accept`` rolls back the
    drafts the target rejected.
    """

    def __init__(self, model: PreTrainedModel, target_vocab_size: int, name: str | None = None) -> None:
        vocab = model.config.vocab_size
        if vocab != target_vocab_size:
            raise ValueError(
                f"The drafter's vocabulary has {vocab} tokens but the target's has "
                f"{target_vocab_size}; a drafter must share the target's tokenizer and vocabulary."
            )
        self.model = model.eval()
        self.name = name or getattr(model.config, "_name_or_path", "") or model.config.model_type
        self._lm = CachedLM(self.model)
        self._base = torch.zeros(0, dtype=torch.long)
        self._k = 0

    def begin(self, batch_size: int) -> None:
        self._lm.reset(batch_size)

    def propose(
        self, history: History, num_tokens: int, params: SamplingParams, uniforms: torch.Tensor
    ) -> Draft:
        device = self.model.device
        tokens = history.tokens.to(device)
        length = history.length.to(device)
        chunk, real = right_align(tokens, self._lm.num_real, length)
        logits = self._lm.append(chunk, real, logits_to_keep=1)[:, -1]
        # Finished rows feed their drafts as holes: their positions may lie past the context window.
        active = history.active if history.active is not None else torch.ones_like(length, dtype=torch.bool)
        live = active.to(device)[:, None].long()
        drafted, laws = [], []
        for i in range(num_tokens):
            if params.do_sample:
                q = probabilities(logits, params)
                token = sample(q, uniforms[:, i].to(device))
                laws.append(q)
            else:
                token = logits.float().argmax(dim=-1)
            drafted.append(token)
            if i + 1 < num_tokens:
                logits = self._lm.append(token[:, None], live, 1)[:, -1]
        self._base, self._k = length.clone(), num_tokens  # history.length changes in place
        out_device = history.tokens.device
        probs = torch.stack(laws, dim=1).to(out_device) if laws else None
        return Draft(torch.stack(drafted, dim=1).to(out_device), probs)

    def accept(self, num_accepted: torch.Tensor) -> None:
        # The last draft was never fed, so at most k - 1 drafts are in the cache.
        kept = torch.clamp(num_accepted.to(self._base.device), max=max(self._k - 1, 0))
        self._lm.keep(self._base + kept)
