"""Self-distilled training text: the target's own answers to prompts cut from the corpus's training part.

A drafter trained on what the target itself writes (``flashspec train-drafter --data`` on the
file :func:`write_distilled` makes) learns the target's style, chat formatting included. Prompts
come only from the training part (``part="train"`` of :mod:`flashspec.bench.corpus`: the 5 %
just before the held-out 5 %), never from the held-out text the benchmarks measure on; the
target answers them through :class:`~flashspec.engine.SpeculativeEngine` target-only, stopping
at EOS. ``flashspec distill`` is the command line (:func:`add_parser`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

__all__ = ["STYLES", "add_parser", "distill", "write_distilled"]

STYLES = ("chat", "text")
PROMPT_TOKENS = {"chat": 192, "text": 128}  # default corpus tokens per prompt: chat snippet, text prompt


def _check(count: Any, max_new_tokens: Any, batch: Any, temperature: Any, style: Any) -> None:
    for name, value in (("count", count), ("max_new_tokens", max_new_tokens), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy); got {temperature!r}.")
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
    from .bench.corpus import chat_requests, heldout_prompts
    from .engine import SpeculativeEngine

    _check(count, max_new_tokens, batch, temperature, style)
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


# ----------------------------------------------------------------------------- command line
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``flashspec distill`` to the ``flashspec`` parser's sub-parsers."""
    from .models import DTYPES

    p = subparsers.add_parser("distill", help="self-distilled training text: the target's answers to "
                                              "prompts from the corpus's training part")
    p.add_argument("--target", required=True, help="folder, hub id or .gguf file")
    p.add_argument("--tokenizer", default=None, help="default: the target's")
    p.add_argument("--corpus", default="../shared/corpus", help="folder with the three-domain corpus")
    p.add_argument("--domain", default="all", choices=["code", "prose", "chat", "all"],
                   help="all: --count documents from each domain")
    p.add_argument("--count", type=int, default=256, help="documents (per domain with --domain all)")
    p.add_argument("--style", default="chat", choices=list(STYLES),
                   help="chat: chat-formatted requests (needs a chat template); text: continuation prompts")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="corpus tokens per prompt: the chat snippet (default 192) or the text prompt (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="prompts decoded together")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", required=True, help="the .txt file to write (documents separated by blank lines)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=_run)
    return p


def _run(args: argparse.Namespace) -> None:
    """``flashspec distill``: check the options, load the target, distill, write ``--out``."""
    from .bench.corpus import DOMAINS
    from .engine import SpeculativeEngine
    from .models import DTYPES

    _check(args.count, args.max_new_tokens, args.batch, args.temperature, args.style)
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be >= 1; got {args.prompt_tokens}.")
    if Path(args.out).suffix != ".txt":
        raise ValueError(f"--out must be a .txt file; got {args.out!r}.")
    domains = list(DOMAINS) if args.domain == "all" else [args.domain]
    engine = SpeculativeEngine(args.target, [], tokenizer=args.tokenizer, device=args.device,
                               dtype=DTYPES[args.dtype] if args.dtype else None)
    if engine.tokenizer is None:
        raise ValueError("Distilling reads text: give --tokenizer (none could be loaded with the target).")
    docs: list[str] = []
    for domain in domains:
        docs += distill(engine.target, engine.tokenizer, args.corpus, domain, args.count, style=args.style,
                        max_new_tokens=args.max_new_tokens, batch=args.batch, temperature=args.temperature,
                        seed=args.seed, progress=not args.no_progress, prompt_tokens=args.prompt_tokens)
    path = write_distilled(docs, args.out)
    print(f"wrote {len(docs)} documents ({sum(map(len, docs)):,} characters) to {path}")
