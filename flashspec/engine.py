"""The speculative decoding loop: select → propose → score → verify → commit → update."""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .cache import CachedLM, right_align
from .drafters import Drafter, History, ModelDrafter, NgramDrafter
from .models import context_window, load_model, load_tokenizer, check_no_sliding_window
from .sampling import SamplingParams, sample
from .select import Selector, make_selector
from .verify import verify

__all__ = ["SpeculativeEngine", "GenerationOutput", "GenerationStats"]


@dataclass
class DrafterStats:
    steps: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass
class GenerationStats:
    """What one ``generate`` call did. Times are wall-clock seconds on the host."""

    new_tokens: int = 0
    steps: int = 0
    row_steps: int = 0  # sum over steps of the rows still generating
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    forward_seconds: float = 0.0  # time inside model forwards (target and drafters), decode steps
    decode_seconds: float = 0.0  # time of the decode steps, prefill excluded
    decode_tokens: int = 0  # tokens committed by decode steps (the prefill's first token excluded)
    per_drafter: dict[str, DrafterStats] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens a row gains per decode step (accepted drafts + the target's token)."""
        return self.decode_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def overhead_fraction(self) -> float:
        """Share of decode-step time spent outside model forwards (engine overhead). Measured
        with host clocks: meaningful on the CPU; on CUDA forwards return at launch."""
        return 1.0 - self.forward_seconds / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_tokens_per_step": self.mean_tokens_per_step,
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "overhead_fraction": self.overhead_fraction,
            "per_drafter": {k: vars(v) for k, v in self.per_drafter.items()},
        }


@dataclass
class GenerationOutput:
    sequences: list[list[int]]  # new tokens per row, ending with EOS when it was produced
    stats: GenerationStats
    text: list[str] | None = None


class SpeculativeEngine:
    """Exact speculative decoding of ``target`` with one or more drafters (SPEC.md).

    Args:
        target: a loaded transformers causal LM, or a local folder, hub id or ``.gguf`` file.
        drafters: a drafter or a list of them; each is a loaded model, a path / hub id /
            ``.gguf`` file, ``"ngram"`` or a :class:`~flashspec.drafters.Drafter`. Empty means
            plain target-only decoding through the same loop.
        selector: how a drafter is chosen each step (``"fixed"``: the first).
        tokenizer: a tokenizer or a path; needed for string prompts. Loaded from ``target``
            when ``target`` is a path and this is None.
        device, dtype: where and in which precision to load models given as paths
            (default: CUDA if available else CPU; bfloat16 on CUDA, float32 on CPU).
    """

    def __init__(
        self,
        target: PreTrainedModel | str,
        drafters: Any = (),
        *,
        selector: str | Selector = "fixed",
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if isinstance(target, (str, bytes)) or hasattr(target, "__fspath__"):
            if tokenizer is None:
                tokenizer = load_tokenizer(str(target))
            target = load_model(str(target), self.device, dtype)
        if not isinstance(target, PreTrainedModel):
            raise ValueError("target must be a transformers causal LM or a path / hub id / .gguf file.")
        self.target = target.eval()
        self.vocab_size: int = target.config.vocab_size
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        if isinstance(drafters, (str, PreTrainedModel)) or isinstance(drafters, Drafter):
            drafters = [drafters]
        self.drafters: list[Drafter] = [self._as_drafter(d, dtype) for d in drafters]
        self.selector = make_selector(selector)
        self._target_lm = CachedLM(self.target)

    def _as_drafter(self, spec: Any, dtype: torch.dtype) -> Drafter:
        if isinstance(spec, str) and spec == "ngram":
            return NgramDrafter()
        if isinstance(spec, str):
            spec = load_model(spec, self.device, dtype)
        if isinstance(spec, PreTrainedModel):
            return ModelDrafter(spec, self.vocab_size)
        if isinstance(spec, Drafter):
            return spec
        raise ValueError(f"Cannot use {spec!r} as a drafter: give a model, a path, 'ngram' or a Drafter.")

    # ------------------------------------------------------------------ inputs
    def _rows(self, input_ids: Any, attention_mask: Any) -> list[list[int]]:
        """The prompt of each row as a list of ids (padding removed)."""
        if isinstance(input_ids, str) or (
            isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(s, str) for s in input_ids)
        ):
            if self.tokenizer is None:
                raise ValueError("String prompts need a tokenizer: pass tokenizer= to SpeculativeEngine.")
            texts = [input_ids] if isinstance(input_ids, str) else list(input_ids)
            rows = [self.tokenizer(t)["input_ids"] for t in texts]
        elif isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be a [batch, length] tensor; got shape {tuple(input_ids.shape)}.")
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            attention_mask = torch.as_tensor(attention_mask)
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                    f"{tuple(input_ids.shape)}; they must match."
                )
            rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids.cpu(), attention_mask.cpu())]
        elif isinstance(input_ids, (list, tuple)):
            rows = [list(r) for r in input_ids]
        else:
            raise ValueError("input_ids must be a tensor, a list of token-id lists, or strings.")
        if not rows:
            raise ValueError("The batch is empty: give at least one prompt.")
        for i, row in enumerate(rows):
            if len(row) == 0:
                raise ValueError(f"Prompt {i} is empty; every row needs at least one token.")
            for t in row:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(
                        f"Prompt {i} contains token id {t!r}, outside the vocabulary [0, {self.vocab_size})."
                    )
        return rows

    def _eos_ids(self, eos_token_id: int | Sequence[int] | None) -> list[int]:
        if eos_token_id is None:
            eos_token_id = getattr(self.target.generation_config, "eos_token_id", None)
        if eos_token_id is None:
            return []
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        for t in ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"eos_token_id {t!r} is outside the vocabulary [0, {self.vocab_size}).")
        return ids

    # ------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(
        self,
        input_ids: Any,
        *,
        attention_mask: Any = None,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        num_draft_tokens: int = 4,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        progress: bool = False,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` per row; the output law is exactly the target's."""
        params = SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0; got {max_new_tokens!r}.")
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, numbers.Integral) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1; got {num_draft_tokens!r}.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer or None; got {seed!r}.")
        max_new_tokens, num_draft_tokens = int(max_new_tokens), int(num_draft_tokens)
        rows = self._rows(input_ids, attention_mask)
        eos = self._eos_ids(eos_token_id)
        longest = max(len(r) for r in rows)
        limit = context_window(self.target.config)
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(
                f"The prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context window of {limit} tokens."
            )
        for model in [self.target] + [d.model for d in self.drafters if isinstance(d, ModelDrafter)]:
            check_no_sliding_window(model.config, longest + max_new_tokens * (num_draft_tokens + 1))

        stats = GenerationStats(per_drafter={d.name: DrafterStats() for d in self.drafters})
        if max_new_tokens == 0:
            return self._output([[] for _ in rows], stats)
        run = _Run(self, rows, params, eos, max_new_tokens, num_draft_tokens, seed, limit, stats)
        start = time.perf_counter()
        run.prefill()
        stats.prefill_seconds = time.perf_counter() - start
        with tqdm(total=run.budget, disable=not progress, desc="generating", unit="tok") as bar:
            done = int(run.generated.sum())
            bar.update(done)
            while run.active.any():
                run.step()
                now = int(run.generated.sum())
                bar.update(now - done)
                done = now
        stats.seconds = time.perf_counter() - start
        stats.decode_seconds = stats.seconds - stats.prefill_seconds
        return self._output(run.sequences(), stats)

    def _output(self, sequences: list[list[int]], stats: GenerationStats) -> GenerationOutput:
        stats.new_tokens = sum(len(s) for s in sequences)
        text = None
        if self.tokenizer is not None:
            text = [self.tokenizer.decode(s, skip_special_tokens=True) for s in sequences]
        return GenerationOutput(sequences, stats, text)


class _Run:
    """The state of one ``generate`` call: committed tokens, caches, counters."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        rows: list[list[int]],
        params: SamplingParams,
        eos: list[int],
        max_new_tokens: int,
        gamma: int,
        seed: int | None,
        limit: int | None,
        stats: GenerationStats,
    ) -> None:
        device = engine.target.device
        self.engine, self.params, self.gamma, self.limit, self.stats = engine, params, gamma, limit, stats
        self.max_new_tokens = max_new_tokens
        self.batch = len(rows)
        self.budget = self.batch * max_new_tokens
        self.prompt_length = torch.tensor([len(r) for r in rows], device=device)
        capacity = max(len(r) for r in rows) + max_new_tokens + gamma + 2
        self.tokens = torch.zeros(self.batch, capacity, dtype=torch.long, device=device)
        for b, r in enumerate(rows):
            self.tokens[b, : len(r)] = torch.tensor(r, device=device)
        self.length = self.prompt_length.clone()
        self.generated = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.active = torch.ones(self.batch, dtype=torch.bool, device=device)
        self.eos = torch.tensor(eos, dtype=torch.long, device=device)
        self.rng = torch.Generator(device=device)
        self.rng.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        self.target = engine._target_lm
        self.target.reset(self.batch)
        for drafter in engine.drafters:
            drafter.begin(self.batch)

    def uniforms(self, width: int) -> torch.Tensor:
        return torch.rand(self.batch, width, dtype=torch.float64, generator=self.rng, device=self.tokens.device)

    def prefill(self) -> None:
        """Feed every prompt once and draw the first new token from the target alone."""
        chunk, real = right_align(self.tokens, torch.zeros_like(self.length), self.length)
        logits = self.target.append(chunk, real, logits_to_keep=1)[:, -1]
        no_drafts = torch.zeros(self.batch, 0, dtype=torch.long, device=self.tokens.device)
        result = verify(logits[:, None], no_drafts, None, self.params, self.uniforms(1))
        self.commit(result.tokens, torch.zeros_like(self.length))

    def step(self) -> None:
        """One speculative step: select → propose → score → verify → commit → update."""
        engine, stats = self.engine, self.stats
        forward_before = self._forward_seconds()
        k = self._draft_length()
        arm = engine.selector.select() if engine.drafters and k > 0 else None
        drafter = engine.drafters[arm] if arm is not None else None
        history = History(self.tokens, self.length, self.active)
        if drafter is not None:
            draft = drafter.propose(history, k, self.params, self.uniforms(k))
        else:
            draft = None
        draft_tokens = draft.tokens if draft is not None else self.tokens.new_zeros(self.batch, 0)
        k = draft_tokens.shape[1]
        pending = self.tokens.gather(1, (self.length - 1)[:, None])
        fed = torch.cat([pending, draft_tokens], dim=1)
        real = self.active[:, None].expand_as(fed)
        logits = self.target.append(fed, real, logits_to_keep=k + 1)
        result = verify(logits, draft_tokens, draft.probs if draft else None, self.params, self.uniforms(k + 1))
        n = torch.where(self.active, result.num_accepted, 0)
        active_rows = int(self.active.sum())
        self.target.keep(torch.where(self.active, self.length + n, self.target.num_real))
        stats.decode_tokens += self.commit(result.tokens, n)
        if drafter is not None:
            drafter.accept(n)
            accepted = int(n.sum())
            engine.selector.update(arm, accepted, k * active_rows)
            per = stats.per_drafter[drafter.name]
            per.steps += 1
            per.proposed += k * active_rows
            per.accepted += accepted
            stats.proposed += k * active_rows
            stats.accepted += accepted
        stats.steps += 1
        stats.row_steps += active_rows
        stats.forward_seconds += self._forward_seconds() - forward_before

    def _draft_length(self) -> int:
        """γ, shortened so no row drafts past its length budget or the context window."""
        active = self.active
        room = int((self.max_new_tokens - self.generated)[active].max()) - 1
        k = min(self.gamma, room)
        if self.limit is not None:
            k = min(k, int((self.limit - self.length)[active].min()))
        return max(k, 0)

    def _forward_seconds(self) -> float:
        total = self.target.forward_seconds
        for d in self.engine.drafters:
            lm = getattr(d, "_lm", None)
            total += lm.forward_seconds if lm is not None else 0.0
        return total

    def commit(self, new_tokens: torch.Tensor, num_accepted: torch.Tensor) -> int:
        """Append each active row's ``num_accepted + 1`` new tokens, cut at EOS and length."""
        columns = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        take = torch.minimum(num_accepted + 1, self.max_new_tokens - self.generated)
        is_eos = torch.isin(new_tokens, self.eos) & (columns < take[:, None])
        first_eos = torch.where(is_eos, columns, new_tokens.shape[1]).amin(dim=1)
        take = torch.minimum(take, first_eos + 1)
        take = torch.where(self.active, take, 0)
        index = self.length[:, None] + columns
        write = columns < take[:, None]
        current = self.tokens.gather(1, index)
        self.tokens.scatter_(1, index, torch.where(write, new_tokens, current))
        self.length += take
        self.generated += take
        finished = (first_eos < take) | (self.generated >= self.max_new_tokens)
        self.active &= ~finished
        return int(take.sum())

    def sequences(self) -> list[list[int]]:
        out = []
        for b in range(self.batch):
            start, end = int(self.prompt_length[b]), int(self.length[b])
            out.append(self.tokens[b, start:end].tolist())
        return out
