"""``flashspec bench acceptance``: how many drafts each drafter gets accepted, by γ, domain and prompt style.

For every drafter, every γ, every corpus domain (:data:`~flashspec.data.corpus.DOMAINS`) and
every prompt style — ``text``: continuations of held-out corpus text
(:func:`~flashspec.data.corpus.heldout_prompts`); ``chat``: chat-formatted requests around
held-out snippets (:func:`~flashspec.data.corpus.chat_requests`) — the prompts are decoded with
one fixed arm (selector ``"fixed"``, ``gammas=[γ]``), EOS disabled (every row generates exactly
``max_new_tokens``), and the run records drafts accepted per step, tokens per step, the
acceptance rate α, decode tokens/s and the drafter's share of decode time. One engine per
(drafter, γ) is reused across domains and styles; model drafters are loaded once and shared.

``workload`` other than ``corpus`` (:mod:`flashspec.data.workloads`) takes the prompts from
MT-bench (chat only; both turns, turn 2 built on the target's own greedy first answer, generated
before any timing), HumanEval (``text``: the raw prompts; ``chat``: chat requests), code edits or
extraction (chat only, around held-out corpus snippets) or the mixed stream of those four, and
reports by category (MT-bench category, ``humaneval``, ``code-edit``, ``text-extraction``)
instead of domain.
"""

from __future__ import annotations

import functools
import gc
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..data.corpus import (
    DOMAINS,
    HELDOUT_FRACTION,
    chat_requests,
    heldout_prompts,
    store_drafters,
)
from ..drafters import ModelDrafter, TreeExpansion
from ..drafters.expansion import candidates
from ..engine import SpeculativeEngine
from .acceptance_report import arm_label, plot, summarize, write
from .e2e import _is_model, _is_self_drafter, _machine, drafter_name
from .results import write_results
from .workload_args import CHAT_ONLY

TREE = "tree"  # the drafter name of the arms that run every drafter's chain in one draft tree

__all__ = ["STYLES", "check_options", "load_and_run", "make_requests", "plot", "run", "summarize", "workload_requests",
           "write"]

STYLES = ("text", "chat")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")


def check_options(
    *, drafters: list[str], gammas: list[int], styles: list[str], prompts_per_domain: int, batch: int,
    max_new_tokens: int, prompt_tokens: int = 128, snippet_tokens: int = 192, temperature: float = 0.0,
    rules: list[str] = ("token",), block_size: int | None = None, tree: bool = False,
    expand: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Raise a ValueError for anything that would fail later (before minutes of model loading)."""
    from ..decode.chunks import check_block_size
    from ..verify import ACCEPTANCES

    check_block_size(block_size)
    if expand:
        expansions(expand, drafters, gammas, tree)

    if not rules or any(rule not in ACCEPTANCES for rule in rules) or len(set(rules)) != len(rules):
        raise ValueError(f"acceptance rules must be distinct names from {', '.join(ACCEPTANCES)}; got {list(rules)!r}.")
    if not drafters:
        raise ValueError("Give at least one drafter (--draft).")
    if len(set(drafters)) != len(drafters):
        raise ValueError(f"Drafter names must be distinct; got {drafters!r}.")
    if not gammas or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in gammas):
        raise ValueError(f"gammas must be a non-empty list of integers >= 1; got {gammas!r}.")
    if len(set(gammas)) != len(gammas):
        raise ValueError(f"gammas must be distinct; got {gammas!r}.")
    if not styles:
        raise ValueError(f"No prompt styles chosen; pick from: {', '.join(STYLES)}.")
    for style in styles:
        if style not in STYLES:
            raise ValueError(f"Unknown prompt style {style!r}; choose from: {', '.join(STYLES)}.")
    if len(set(styles)) != len(styles):
        raise ValueError(f"Prompt styles must be distinct; got {styles!r}.")
    for name, value in (("prompts per domain", prompts_per_domain), ("batch", batch),
                        ("max new tokens", max_new_tokens), ("prompt tokens", prompt_tokens),
                        ("snippet tokens", snippet_tokens)):
        _positive_int(name, value)
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy); got {temperature!r}.")


def expansions(expand: dict[str, tuple[int, int]], drafters: list[str], gammas: list[int],
               tree: bool) -> dict[str, TreeExpansion]:
    """``expand`` (drafter name → ``(topk, nodes)``) as the tree arms' ``generate_tree(expand=...)``,
    checked against the drafters measured and every γ (a tree of depth γ holds at most
    ``topk + (γ − 1)·topk²`` nodes)."""
    if not tree:
        raise ValueError("Top-k expansion (--expand) shapes the draft-tree arms: add --tree.")
    out = {}
    for name, pair in expand.items():
        if name not in drafters:
            raise ValueError(f"--expand names {name!r}, which is not a drafter measured here "
                             f"({', '.join(drafters)}).")
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"--expand {name!r} takes (topk, nodes); got {pair!r}.")
        out[name] = TreeExpansion(*pair)
        if out[name].nodes > candidates(min(gammas), out[name].topk):
            raise ValueError(f"--expand {name}={out[name].topk},{out[name].nodes}: a tree of depth {min(gammas)} "
                             f"(the smallest γ) with topk={out[name].topk} holds at most "
                             f"{candidates(min(gammas), out[name].topk)} nodes.")
    return out


def make_requests(
    corpus: Path, tokenizer: Any, *, styles: list[str], prompts_per_domain: int, prompt_tokens: int = 128,
    snippet_tokens: int = 192, seed: int = 0,
) -> dict[str, dict[str, list[list[int]]]]:
    """Held-out prompts per style and domain: ``text`` — ``prompt_tokens``-token continuation
    prompts; ``chat`` — chat requests around ``snippet_tokens``-token snippets."""
    requests: dict[str, dict[str, list[list[int]]]] = {}
    for style in styles:
        if style == "text":
            requests[style] = {d: heldout_prompts(Path(corpus), d, prompts_per_domain, prompt_tokens, tokenizer, seed)
                               for d in DOMAINS}
        elif style == "chat":
            requests[style] = {d: chat_requests(Path(corpus), d, prompts_per_domain, tokenizer, seed,
                                                snippet_tokens=snippet_tokens) for d in DOMAINS}
        else:
            raise ValueError(f"Unknown prompt style {style!r}; choose from: {', '.join(STYLES)}.")
    return requests


def workload_requests(
    workload: str, tokenizer: Any, *, styles: list[str], per_category: int, corpus: Path | None = None,
    prompt_tokens: int = 128, snippet_tokens: int = 192, seed: int = 0, answerer: Any = None,
    max_new_tokens: int = 128, batch: int = 1, mtbench_file: Any = None, humaneval_file: Any = None,
) -> dict[str, dict[str, list[list[int]]]]:
    """Prompts per style and category of ``workload`` (:data:`~flashspec.data.workloads.WORKLOADS`):
    ``per_category`` MT-bench questions per category (both turns; turn 2 needs ``answerer``, an
    engine that answers turn 1 greedy in ``max_new_tokens``), HumanEval problems, corpus prompts
    per domain, code-edit and extraction requests (chat only). ``text``: HumanEval's raw prompts and
    corpus continuations; ``chat``: chat requests. ``mixed``: MT-bench, HumanEval, code-edit and
    extraction (:data:`~flashspec.data.workloads.MIXED_PARTS`); categories read ``workload/category``."""
    from ..data import workloads as wl
    from .requests import first_answers

    if workload == "corpus":
        return make_requests(Path(corpus or "."), tokenizer, styles=styles, prompts_per_domain=per_category,
                             prompt_tokens=prompt_tokens, snippet_tokens=snippet_tokens, seed=seed)
    if workload not in wl.WORKLOADS:
        raise ValueError(f"Unknown workload {workload!r}; choose from: {', '.join(wl.WORKLOADS)}.")
    if workload in CHAT_ONLY and "text" in styles:
        raise ValueError(f"{CHAT_ONLY[workload]} has chat requests only: use --styles chat.")
    parts = set(wl.MIXED_PARTS) if workload == "mixed" else {workload}
    out: dict[str, dict[str, list[list[int]]]] = {}
    for style in styles:
        found: list[tuple[str, str, list[int]]] = []  # (workload, category, ids)
        if "mt-bench" in parts and style == "chat":
            by_category: dict[str, list[wl.Question]] = {}
            for q in wl.read_mtbench(wl.mtbench_file(mtbench_file)):
                by_category.setdefault(q.category, []).append(q)
            short = min(by_category.values(), key=len)
            if len(short) < per_category:
                raise ValueError(f"MT-bench has {len(short)} questions in category {short[0].category!r}; "
                                 f"{per_category} per category asked for.")
            chosen = [q for qs in by_category.values() for q in qs[:per_category]]
            firsts = wl.mtbench_requests(tokenizer, chosen)
            if answerer is None:
                raise ValueError("MT-bench's second turn needs the target's first answers (an answerer engine).")
            budgets = {r.name: max_new_tokens for r in firsts}
            both = wl.add_second_turns(tokenizer, firsts, lambda rs: first_answers(answerer, rs, budgets, batch))
            found += [("mt-bench", r.category, r.ids) for r in both]
        if "humaneval" in parts:
            found += [("humaneval", r.category, r.ids) for r in wl.humaneval_requests(
                tokenizer, style="chat" if style == "chat" else "completion", path=humaneval_file, count=per_category)]
        if "corpus" in parts:
            corpus_prompts = make_requests(Path(corpus or "."), tokenizer, styles=[style],
                                           prompts_per_domain=per_category, prompt_tokens=prompt_tokens,
                                           snippet_tokens=snippet_tokens, seed=seed)[style]
            found += [("corpus", d, ids) for d, ps in corpus_prompts.items() for ids in ps]
        for name, build in (("code-edit", wl.code_edit_requests), ("extraction", wl.extraction_requests)):
            if name in parts and style == "chat":
                found += [(name, r.category, r.ids) for r in build(Path(corpus or "."), tokenizer, per_category, seed,
                                                                   (snippet_tokens,))]
        out[style] = {}
        for source, category, ids in found:
            label = f"{source}/{category}" if workload == "mixed" and category != source else category
            out[style].setdefault(label, []).append(ids)
    return out


def _engine(target: Any, name: str, drafter: Any, gamma: int, tokenizer: Any, compile: bool,
            rule: str = "token", block_size: int | None = None) -> SpeculativeEngine:
    """One fixed arm (drafter, γ) verified by ``rule`` (in chunks of ``block_size``); a loaded model
    is shared, a spec string is built by the engine."""
    if _is_model(drafter):
        drafter = ModelDrafter(drafter, target.config.vocab_size, name=name, compile=compile)
    engine = SpeculativeEngine(target, [drafter], selector="fixed", gammas=[gamma], tokenizer=tokenizer,
                               compile=compile, warmup=False,  # run's own untimed call warms what it uses
                               acceptance=rule, block_size=block_size)
    engine.drafters[0].name = name  # the engine calls self-drafters "early-exit:N": use the report's name
    return engine


def _tree_engine(target: Any, drafters: dict[str, Any], tokenizer: Any, compile: bool) -> SpeculativeEngine:
    """Every drafter in one engine, for draft trees of all their chains (SPEC.md §7)."""
    built = [ModelDrafter(d, target.config.vocab_size, name=n, compile=compile) if _is_model(d) else d
             for n, d in drafters.items()]
    engine = SpeculativeEngine(target, built, selector="fixed", tokenizer=tokenizer, compile=compile, warmup=False)
    for d, name in zip(engine.drafters, drafters):
        d.name = name
    return engine


def _drafter_seconds(engine: SpeculativeEngine) -> float | None:
    """Host seconds inside the drafter's own forwards so far; None where it has none of its own
    (n-gram lookup, early exit: its layers are the target's and count there)."""
    values = [getattr(d, "forward_seconds", None) for d in engine.drafters]  # a tree engine: all of them
    values = [float(v) for v in values if isinstance(v, (int, float))]
    return sum(values) if values else None


def _free_device_memory() -> None:
    """Return a finished arm's memory before the next arm builds its engine: its CUDA graphs' private
    pools are freed only once the graphs are collected, so without this every arm's pools stay (on an
    H100 80GB, six arms at batch 64 ran out of memory with 40 GiB held in graph pools)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(
    target: Any,
    drafters: dict[str, Any],
    requests: dict[str, dict[str, list[list[int]]]],
    *,
    gammas: list[int],
    batch: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    compile: bool = False,
    tokenizer: Any = None,
    warm_up: bool = True,
    progress: bool = True,
    stop_at_eos: bool = False,
    rules: Sequence[str] = ("token",),
    on_row: Callable[[dict[str, Any]], None] | None = None,
    tree: bool = False,
    block_size: int | None = None,
    expand: dict[str, tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Decode every style's and domain's ``requests`` (from :func:`make_requests`) with one fixed
    arm per drafter × γ; one row per (drafter, γ, domain, style). ``stop_at_eos``: each answer
    ends at the target's EOS (the field's convention on MT-bench and HumanEval); otherwise every
    row generates exactly ``max_new_tokens``. ``rules``: the acceptance rules measured, each a
    row of its own (``"token"``, ``"block"``: SPEC.md §2). ``drafters`` maps a name to a
    loaded model, ``"ngram"``, a self-drafter spec (``early-exit:N``, ``feature:DIR``,
    ``shallow:DIR``) or a Drafter object. ``warm_up``: one untimed call per engine and style first
    (allocation, compilation, CUDA graphs). ``on_row``: called with the results so far after each
    row, so that a run cut short keeps what it measured. ``tree``: also one arm per γ that puts every
    drafter's chain of γ tokens into one draft tree per step (``SpeculativeEngine.generate_tree``,
    SPEC.md §7), labelled ``tree@γ`` (token-wise rule only). ``block_size``: every arm's drafts drafted,
    scored and verified in chunks of this many (SPEC.md §2, "Chunked drafting"; not the tree arms).
    ``expand``: drafter name → ``(topk, nodes)``: in the tree arms, that feature or EAGLE-3 head's part
    is an EAGLE-2 top-k expansion of depth γ instead of its chain, the n-gram's several continuations
    (SPEC.md §7, "Top-k expansion", "Several n-gram continuations")."""
    styles = list(requests)
    counts = [len(ps) for by_domain in requests.values() for ps in by_domain.values()]
    check_options(drafters=list(drafters), gammas=list(gammas), styles=styles,
                  prompts_per_domain=min(counts, default=0), batch=batch, max_new_tokens=max_new_tokens,
                  temperature=temperature, rules=list(rules), block_size=block_size, tree=tree, expand=expand)
    expanded = expansions(expand, list(drafters), list(gammas), tree) if expand else None
    results: dict[str, Any] = {
        "machine": _machine(target.device, next(target.parameters()).dtype),
        "settings": {
            "drafters": list(drafters), "gammas": list(gammas), "styles": styles, "batch": batch,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "compile": compile,
            "acceptance": list(rules), "tree": tree, "block_size": block_size,
            "expand": {n: [e.topk, e.nodes] for n, e in expanded.items()} if expanded else None,
            "prompts_per_domain": min(counts), "warm_up": warm_up, "selector": "fixed",
            "heldout": f"last {HELDOUT_FRACTION:.0%} of each corpus file's decompressed bytes",
            "eos": ("stops each answer (at most max_new_tokens)" if stop_at_eos
                    else "disabled: every row generates exactly max_new_tokens"),
            "drafter_forward_share": "host time inside the drafter's own forwards over decode time (meaningful on "
                                     "the CPU; None for n-gram lookup and early exit)",
        },
        "rows": [],
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    groups = {style: {d: [ps[i : i + batch] for i in range(0, len(ps), batch)] for d, ps in by_domain.items()}
              for style, by_domain in requests.items()}
    arms = [(name, drafter, gamma, rule) for name, drafter in drafters.items() for gamma in gammas for rule in rules]
    if tree:
        arms += [(TREE, None, gamma, "token") for gamma in gammas]
    total = len(arms) * sum(len(g) for by_domain in groups.values() for g in by_domain.values())
    bar = tqdm(total=total, desc="acceptance", unit="batch", disable=not progress)
    sample = {"do_sample": temperature > 0, "temperature": temperature or 1.0}
    eos = None if stop_at_eos else []  # None: the target's own EOS ids
    for name, drafter, gamma, rule in arms:
        # one engine per arm, kept across styles and domains
        if name == TREE:
            engine = _tree_engine(target, drafters, tokenizer, compile)
            generate = functools.partial(engine.generate_tree, gammas=[gamma] * len(drafters), expand=expanded)
        else:
            engine = _engine(target, name, drafter, gamma, tokenizer, compile, rule, block_size)
            generate = engine.generate
        for style, by_domain in groups.items():
            if warm_up:
                every = [b for bs in by_domain.values() for b in bs]
                longest = max(every, key=lambda b: (len(b), max(map(len, b))))
                generate(longest, max_new_tokens=max_new_tokens, eos_token_id=[], seed=seed, **sample)
            for domain, batches in by_domain.items():
                bar.set_postfix_str(f"{arm_label(name, gamma, rule)} {style} {domain}", refresh=False)
                totals = dict.fromkeys(("steps", "row_steps", "proposed", "accepted", "decode_tokens",
                                        "new_tokens"), 0)
                seconds, drafter_seconds = 0.0, 0.0
                for index, prompts in enumerate(batches):
                    before = _drafter_seconds(engine)
                    out = generate(prompts, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                          seed=seed + index, **sample)
                    after = _drafter_seconds(engine)
                    s = out.stats
                    for key in totals:
                        totals[key] += getattr(s, key)
                    seconds += s.decode_seconds
                    if before is not None and after is not None:
                        drafter_seconds += after - before
                    bar.update()
                rows = totals["row_steps"]
                results["rows"].append({
                    "drafter": name, "gamma": gamma, "acceptance": rule, "domain": domain, "style": style,
                    "prompts": sum(len(b) for b in batches), "batches": len(batches), **totals,
                    "accepted_per_step": totals["accepted"] / rows if rows else 0.0,
                    "tokens_per_step": totals["decode_tokens"] / rows if rows else 0.0,
                    "acceptance_rate": totals["accepted"] / totals["proposed"] if totals["proposed"] else 0.0,
                    "decode_seconds": seconds,
                    "decode_tokens_per_second": totals["decode_tokens"] / seconds if seconds else None,
                    "drafter_forward_share": (drafter_seconds / seconds
                                              if _drafter_seconds(engine) is not None and seconds else None),
                })
                if on_row is not None:
                    on_row(results)
        del engine, generate  # the bound method holds the engine too
        _free_device_memory()
    bar.close()
    return results


# ----------------------------------------------------------------------------- from the command line
def load_and_run(
    out_dir: Path,
    *,
    target: str,
    drafts: list[str],
    tokenizer: str | None,
    corpus: Path,
    device: str | None,
    dtype: str,
    styles: list[str],
    gammas: list[int],
    prompts_per_domain: int,
    prompt_tokens: int,
    snippet_tokens: int = 192,
    seed: int = 0,
    workload: str = "corpus",
    mtbench_file: Any = None,
    humaneval_file: Any = None,
    **options: Any,
) -> dict[str, Any]:
    """Make the prompts (``workload``: see :func:`workload_requests`), load the target and each
    model drafter once, :func:`run` and :func:`write`. ``ngram`` and the self-drafter specs go to
    the engines as strings; ``store:DOMAIN`` becomes a datastore over that domain's training
    text. ``options`` go to :func:`run`."""
    from ..models.loading import load_model, load_tokenizer

    names = [drafter_name(d) for d in drafts]
    check_options(drafters=names, gammas=gammas, styles=styles, prompts_per_domain=prompts_per_domain,
                  batch=options.get("batch", 1), max_new_tokens=options.get("max_new_tokens", 1),
                  prompt_tokens=prompt_tokens, snippet_tokens=snippet_tokens,
                  temperature=options.get("temperature", 0.0), block_size=options.get("block_size"),
                  tree=options.get("tree", False), expand=options.get("expand"))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = getattr(torch, dtype)
    tok = load_tokenizer(tokenizer or target)
    settings = dict(styles=styles, per_category=prompts_per_domain, corpus=corpus, prompt_tokens=prompt_tokens,
                    snippet_tokens=snippet_tokens, seed=seed, max_new_tokens=options.get("max_new_tokens", 128),
                    batch=options.get("batch", 1), mtbench_file=mtbench_file, humaneval_file=humaneval_file)
    needs_answers = workload in ("mt-bench", "mixed") and "chat" in styles
    if not needs_answers:  # prompts first: a bad file fails before minutes of loading
        requests = workload_requests(workload, tok, **settings)
    else:
        from ..data.workloads import mtbench_file as find_mtbench, read_mtbench

        read_mtbench(find_mtbench(mtbench_file))  # checked (and fetched) before loading
    model = load_model(target, device, torch_dtype)
    if needs_answers:  # MT-bench's turn 2 carries the target's own greedy first answer (untimed)
        requests = workload_requests(workload, tok, answerer=SpeculativeEngine(model, [], tokenizer=tok, warmup=False),
                                     **settings)
    drafters: dict[str, Any] = {}
    for name, built in zip(names, store_drafters(drafts, corpus, tok)):
        is_path = isinstance(built, str) and built != "ngram" and not _is_self_drafter(built)
        drafters[name] = load_model(built, device, torch_dtype) if is_path else built
    described = {"target": target, "prompt_tokens": prompt_tokens, "snippet_tokens": snippet_tokens,
                 "workload": workload}

    def so_far(results: dict[str, Any]) -> None:  # the rows measured, kept if the run is cut short
        partial = {**results, "settings": {**results["settings"], **described}, "complete": False}
        write_results(Path(out_dir) / "acceptance.json", partial, summarize(partial))

    results = run(model, drafters, requests, gammas=gammas, seed=seed, tokenizer=tok, on_row=so_far, **options)
    results["settings"].update(described)
    results["complete"] = True
    write(results, out_dir)
    return results
