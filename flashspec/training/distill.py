"""Self-distilled training data: the target's own answers, to real conversations and to corpus prompts.

A drafter trained on what the target itself writes learns the target's style, chat formatting
included. Two sources of prompts (:data:`SOURCES`), mixable by counts:

* ``sharegpt``: real users' conversations (:mod:`flashspec.data.sharegpt`), every user turn
  answered by the target on top of its own earlier answers (:mod:`~flashspec.training.conversations`),
  as EAGLE-3 and SpecForge make their training data;
* ``corpus``: prompts cut from the first 90 % of the corpus (``part="fit"`` of
  :mod:`flashspec.data.corpus`), never from the 5 % after it nor the held-out 5 % the
  benchmarks measure on.

The target answers through :class:`~flashspec.engine.SpeculativeEngine` target-only, stopping at
EOS. :func:`distill_folder` writes token shards with loss masks and a manifest, and continues an
interrupted run (:mod:`~flashspec.training.shards`); :func:`distill` and :func:`write_distilled`
write corpus answers as plain text. ``flashspec distill`` is the command line
(:mod:`flashspec.cli.train`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..checks import check_int, check_number
from ..data.sharegpt import part_of, read_sharegpt, sha256_of_file
from ..data.workloads import contains_passage, evaluation_passages
from ..data.sharegpt import sharegpt_file as locate_sharegpt
from .conversations import Item, Tally, answer_items, derived_seed
from .shards import finished, open_manifest, save_manifest, shard_name, write_shard

__all__ = ["SOURCES", "STYLES", "DistillOptions", "check_options", "distill", "distill_folder", "write_distilled"]

STYLES = ("chat", "text")
SOURCES = ("sharegpt", "corpus", "mixed")
DOMAIN_CHOICES = ("code", "prose", "chat", "all")
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
        prompts = chat_requests(Path(corpus_dir), domain, count, tokenizer, seed, part="fit",
                                snippet_tokens=prompt_tokens)
    else:
        prompts = heldout_prompts(Path(corpus_dir), domain, count, prompt_tokens, tokenizer, seed, part="fit")
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


@dataclass(frozen=True)
class DistillOptions:
    """What shapes distilled data (a folder's identity: another value cannot continue in it)."""

    source: str  # sharegpt, corpus or mixed (both)
    conversations: int = 1000  # ShareGPT conversations (those starting with a user turn, in file order)
    max_turns: int = 4  # user turns answered per conversation
    max_context: int = 2048  # a turn whose context (prompt tokens) is longer ends its conversation
    count: int = 256  # corpus prompts per domain
    domain: str = "all"  # corpus domain, or all of them
    style: str = "chat"  # corpus prompts: chat requests or text continuations
    prompt_tokens: int | None = None  # corpus tokens per prompt (default PROMPT_TOKENS[style])
    max_new_tokens: int = 256  # per answer
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    shard_size: int = 256  # items (conversations or prompts) per shard

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}; got {self.source!r}.")
        if self.domain not in DOMAIN_CHOICES:
            raise ValueError(f"domain must be one of {', '.join(DOMAIN_CHOICES)}; got {self.domain!r}.")
        check_options(self.count, self.max_new_tokens, 1, self.temperature, self.style)
        for name in ("conversations", "max_turns", "max_context", "shard_size"):
            check_int(name, getattr(self, name), 1)
        if self.prompt_tokens is not None:
            check_int("prompt_tokens", self.prompt_tokens, 1)
        check_int("seed", self.seed, 0)

    def relevant(self) -> dict[str, Any]:
        """The options that shape this source's data: a folder's identity (an option of the other
        source alone may change between runs)."""
        unused = {"sharegpt": ("count", "domain", "style", "prompt_tokens"), "corpus": ("conversations", "max_turns"),
                  "mixed": ()}[self.source]
        return {name: value for name, value in asdict(self).items() if name not in unused}


def distill_folder(
    target: Any, tokenizer: Any, out: str | Path, options: DistillOptions, *, sharegpt_file: str | Path | None = None,
    corpus_dir: str | Path | None = None, batch: int = 64, progress: bool = True,
    arguments: dict[str, Any] | None = None, max_seconds: float | None = None,
) -> dict[str, Any]:
    """Distill ``options``' items into the folder ``out`` (token shards and ``manifest.json``,
    :mod:`~flashspec.training.shards`), ``batch`` rows per generate call; shards an earlier run
    of the same identity finished are kept. Returns the manifest. ``arguments``: the command's
    options, recorded in the manifest. ``max_seconds``: start no new shard after this long (the
    manifest's ``complete`` is then False; a later run continues). ``target``: a loaded model
    (or anything ``SpeculativeEngine`` takes)."""
    from ..decode.request import context_window
    from ..engine import SpeculativeEngine

    check_int("batch", batch, 1)
    if max_seconds is not None:
        check_number("max_seconds", max_seconds, above=0, rule="a number of seconds > 0")
    if tokenizer is None:
        raise ValueError("Distilling reads and writes text: give a tokenizer.")
    started = time.perf_counter()
    if isinstance(target, (str, Path)):
        target = SpeculativeEngine(target, [], tokenizer=tokenizer, warmup=False).target
    window = context_window(target.config)
    if window is not None and options.max_context + options.max_new_tokens > window:
        raise ValueError(f"max_context ({options.max_context}) plus max_new_tokens ({options.max_new_tokens}) "
                         f"exceeds the target's context window of {window} tokens.")
    # Buffers sized once for the longest turn (where shapes are fixed: a CUDA GPU), no warm-up
    # at batch 1: the first call of each row count captures its graphs, once.
    engine = SpeculativeEngine(target, [], tokenizer=tokenizer, warmup=False,
                               max_length=options.max_context + options.max_new_tokens)
    overlap = {"dropped": 0}
    sources, files = _sources(options, engine.tokenizer, sharegpt_file, corpus_dir, overlap)
    identity = {"options": options.relevant(), "target_sha256": weights_sha256(engine.target),
                "tokenizer": _tokenizer_identity(engine.tokenizer), "files": files}
    manifest = open_manifest(out, identity)
    manifest["target"] = {"name_or_path": getattr(engine.target.config, "_name_or_path", ""),
                          "model_type": engine.target.config.model_type}
    manifest["tokenizer"] = getattr(engine.tokenizer, "name_or_path", type(engine.tokenizer).__name__)
    manifest["arguments"] = arguments if arguments is not None else manifest.get("arguments")
    save_manifest(out, manifest)
    total = sum(count for _, _, count in sources)
    bar = tqdm(total=total, desc=f"distill {options.source}", unit="item", disable=not progress)
    shown = Tally()

    def show(answers: int, tokens: int, done: int) -> None:
        shown.answers += answers
        shown.answer_tokens += tokens
        bar.update(done)
        bar.set_postfix(answers=f"{shown.answers:,}", answer_tokens=f"{shown.answer_tokens:,}")

    complete = True
    try:  # the sources' shards in turn, so that a run stopped early holds some of each
        for source, number, group in _in_turn(sources, options.shard_size):
            late = max_seconds is not None and time.perf_counter() - started > max_seconds
            if late and finished(out, manifest, shard_name(source, number)) is None:
                complete = False  # the time is up: this shard and the rest are left to a later run
                break
            _make_shard(engine, out, manifest, options, source, number, group, batch, show)
    finally:
        bar.close()
    manifest["complete"] = complete
    save_manifest(out, manifest)
    if "evaluation_sets_left_out" in files:
        # each run reads the file from its start: the furthest run has seen every dropped one
        manifest["evaluation_overlap_dropped"] = max(manifest.get("evaluation_overlap_dropped", 0), overlap["dropped"])
        save_manifest(out, manifest)
    return manifest


def _make_shard(engine: Any, out: str | Path, manifest: dict[str, Any], options: DistillOptions, source: str,
                number: int, group: list[Item], batch: int, show: Callable[[int, int, int], None]) -> None:
    """Make shard ``number`` of ``source`` from ``group`` and enter it in the manifest, unless an
    earlier run finished it; ``show(answers, answer tokens, items done)`` moves the progress bar."""
    name, first = shard_name(source, number), number * options.shard_size
    kept = finished(out, manifest, name)
    if kept is not None:
        show(kept["answers"], kept["answer_tokens"], kept["items"])
        return
    started = time.perf_counter()
    samples, tally = answer_items(
        engine, group, max_turns=options.max_turns, max_context=options.max_context,
        max_new_tokens=options.max_new_tokens, batch=batch, temperature=options.temperature,
        seed=derived_seed(options.seed, name), on_answers=show)
    seconds = time.perf_counter() - started
    estimate = [part_of(group[s.item].key) == "estimate" for s in samples]
    for sample in samples:
        sample.item += first  # the item's index within its source
    entry = write_shard(out, name, samples, estimate)
    entry.update(source=source, first=first, items=len(group), answers=tally.answers, answers_cut=tally.cut,
                 conversations=tally.conversations, skipped=tally.skipped, seconds=round(seconds, 3))
    manifest["shards"] = sorted([e for e in manifest["shards"] if e["name"] != name] + [entry], key=lambda e: e["name"])
    save_manifest(out, manifest)


def weights_sha256(model: Any) -> str:
    """sha256 of every parameter of ``model`` (names, shapes, values rounded to bfloat16, as
    :func:`flashspec.drafters.checkpoint.shared_checksum` rounds them): the same target in float32
    or bfloat16 matches, another one does not."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.named_parameters()):
        data = tensor.detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(f"{name}{tuple(data.shape)}".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer by content (its size, vocabulary and chat template), not by where it lies."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    template = getattr(tokenizer, "chat_template", None)
    return {"size": len(tokenizer) if hasattr(tokenizer, "__len__") else None,
            "vocab_sha256": None if vocab is None else hashlib.sha256(repr(sorted(vocab.items())).encode()).hexdigest(),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None}


def _sources(options: DistillOptions, tokenizer: Any, sharegpt_file: str | Path | None,
             corpus_dir: str | Path | None, overlap: dict[str, int] | None = None,
             ) -> tuple[list[tuple[str, Iterator[Item] | list[Item], int]], dict]:
    """``(source, items, count)`` per source of ``options``, and the checksums of the files read
    (with the evaluation sets whose passages are left out; ``overlap["dropped"]`` counts the
    conversations that held one)."""
    sources: list[tuple[str, Any, int]] = []
    files: dict[str, Any] = {}
    if options.source in ("sharegpt", "mixed"):
        path = locate_sharegpt(sharegpt_file)
        passages, checked = evaluation_passages()
        chosen = list(_conversations(path, options.conversations, passages, overlap))
        # the conversations used, not the file: a copy cut after them continues the same folder
        files["sharegpt_conversations_sha256"] = _items_sha256(chosen)
        files["evaluation_sets_left_out"] = checked
        sources.append(("sharegpt", chosen, options.conversations))
    if options.source in ("corpus", "mixed"):
        from ..data.corpus import DOMAINS

        if corpus_dir is None:
            raise ValueError("Corpus prompts need the corpus folder: give corpus_dir (--corpus).")
        domains = list(DOMAINS) if options.domain == "all" else [options.domain]
        for domain in domains:
            if not (Path(corpus_dir) / DOMAINS[domain]).is_file():
                raise ValueError(f"Corpus file {Path(corpus_dir) / DOMAINS[domain]} not found; pass --corpus "
                                 "pointing at shared/corpus.")
        files["corpus_sha256"] = {d: sha256_of_file(Path(corpus_dir) / DOMAINS[d]) for d in domains}
        items = [Item(f"{domain}-{i}", prompt=tuple(prompt)) for domain in domains
                 for i, prompt in enumerate(_corpus_prompts(options, tokenizer, corpus_dir, domain))]
        sources.append(("corpus", items, len(items)))
    return sources, files


def _conversations(path: Path, count: int, passages: list[str] = (), overlap: dict | None = None) -> Iterator[Item]:
    """The first ``count`` ShareGPT conversations that start with a user turn, as items of their
    user turns (the recorded answers are never used). A conversation whose user turns contain a
    passage of an evaluation set (:func:`~flashspec.data.workloads.evaluation_passages`) is left
    out and counted in ``overlap["dropped"]``: MT-bench and HumanEval are never trained on."""
    def clean(messages: list[dict[str, str]]) -> bool:
        if passages and any(contains_passage(m["content"], passages) for m in messages if m["role"] == "user"):
            if overlap is not None:
                overlap["dropped"] += 1
            return False
        return True

    chosen = ((key, messages) for key, messages in read_sharegpt(path)
              if messages[0]["role"] == "user" and clean(messages))
    for key, messages in itertools.islice(chosen, count):
        yield Item(key, turns=tuple(m["content"] for m in messages if m["role"] == "user"))


def _items_sha256(items: list[Item]) -> str:
    """sha256 of the items' keys and user turns, in order: what a source's shards are made from."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(json.dumps([item.key, list(item.turns or ())], ensure_ascii=False).encode())
    return digest.hexdigest()


def _corpus_prompts(options: DistillOptions, tokenizer: Any, corpus_dir: str | Path, domain: str) -> list[list[int]]:
    from ..data.corpus import chat_requests, heldout_prompts

    tokens = PROMPT_TOKENS[options.style] if options.prompt_tokens is None else options.prompt_tokens
    if options.style == "chat":
        return chat_requests(Path(corpus_dir), domain, options.count, tokenizer, options.seed, part="fit",
                             snippet_tokens=tokens)
    return heldout_prompts(Path(corpus_dir), domain, options.count, tokens, tokenizer, options.seed, part="fit")


def _in_turn(sources: list[tuple[str, Any, int]], size: int) -> Iterator[tuple[str, int, list[Item]]]:
    """``(source, shard number, items)``: shard 0 of each source, then shard 1 of each, …"""
    def shards(source: str, items: Any) -> Iterator[tuple[str, int, list[Item]]]:
        for number, group in enumerate(_chunks(items, size)):
            yield source, number, group

    streams = [shards(source, items) for source, items, _ in sources]
    for turn in itertools.zip_longest(*streams):
        yield from (shard for shard in turn if shard is not None)


def _chunks(items: Any, size: int) -> Iterator[list[Item]]:
    iterator = iter(items)
    while group := list(itertools.islice(iterator, size)):
        yield group
