"""Self-distilled training text: the target's own answers to prompts cut from the corpus's training part.

A drafter trained on what the target itself writes (``flashspec train-drafter --data`` on the
file :func:`write_distilled` makes) learns the target's style, chat formatting included. Prompts
come only from the training part (``part="train"`` of :mod:`flashspec.data.corpus`: the 5 %
just before the held-out 5 %), never from the held-out text the benchmarks measure on; the
target answers them through :class:`~flashspec.engine.SpeculativeEngine` target-only, stopping
at EOS. ``flashspec distill`` is the command line (:mod:`flashspec.cli.train`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..checks import check_int, check_number

__all__ = ["STYLES", "check_options", "distill", "write_distilled"]

STYLES = ("chat", "text")
PROMPT_TOKENS = {"chat": 192, "text": 128}  # default corpus tokens per prompt: chat snippet, text prompt


def check_options(count: Any, max_new_tokens: Any, batch: Any, temperature: Any, style: Any) -> None:
    for name, value in (("count", count), ("max_new_tokens", max_new_tokens), ("batch", batch)):
        check_int(name, value, 1)
    check_number("temperature", temperature, 0, rule="a number >= 0 (0 means greedy)")
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}; got {style!r}.")


def distill(
    target: Any, tokenizer: Any, corpus_dir: str | Path, domain: str, count: int, *, style: str = "chat",
    max_new_tokens: int = 256, batch: int = 64, temperature: float = 0.0, seed: int = 0, progress: bool = True,
    prompt_tokens: int | None = None,
) -> list[str]:
    """``count`` documents, each a prompt cut from ``domain``'s training text (``style="chat"``:
    a chat request with the template's text; ``"text"``: a continuation prompt) followed by the
    target's answer, decoded target-only in batches of ``batch`` (stopping at EOS; greedy unless
    ``temperature`` > 0). ``prompt_tokens``: corpus tokens per prompt (the chat snippet or the
    text prompt; default :data:`PROMPT_TOKENS`). ``target`` is a loaded model (or anything
    ``SpeculativeEngine`` takes)."""
    from ..data.corpus import chat_requests, heldout_prompts
    from ..engine import SpeculativeEngine

    check_options(count, max_new_tokens, batch, temperature, style)
    prompt_tokens = PROMPT_TOKENS[style] if prompt_tokens is None else prompt_tokens
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be an integer >= 1; got {prompt_tokens!r}.")
    if tokenizer is None:
        raise ValueError("Distilling reads and writes text: give a tokenizer.")
    if style == "chat":
        prompts = chat_requests(Path(corpus_dir), domain, count, tokenizer, seed, part="train",
                                snippet_tokens=prompt_tokens)
    else:
        prompts = heldout_prompts(Path(corpus_dir), domain, count, prompt_tokens, tokenizer, seed, part="train")
    engine = SpeculativeEngine(target, [], tokenizer=tokenizer)
    docs: list[str] = []
    bar = tqdm(total=count, desc=f"distill {domain} ({style})", unit="doc", disable=not progress)
    for index in range(0, count, batch):
        group = prompts[index : index + batch]
        out = engine.generate(group, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                              temperature=temperature or 1.0, seed=seed + index)
        for prompt, answer in zip(group, out.sequences):
            # the prompt with its special tokens (the chat template's text); the answer without EOS
            docs.append(tokenizer.decode(prompt, skip_special_tokens=False)
                        + tokenizer.decode(answer, skip_special_tokens=True))
        bar.update(len(group))
    bar.close()
    return docs


def write_distilled(docs: list[str], path: str | Path) -> Path:
    """Write ``docs`` to the text file ``path``, separated by blank lines (folders made as needed)."""
    path = Path(path)
    if path.suffix != ".txt":
        raise ValueError(f"Distilled text goes to a .txt file; got {str(path)!r}.")
    if isinstance(docs, str) or not all(isinstance(d, str) for d in docs):
        raise ValueError("docs must be a list of strings.")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path
