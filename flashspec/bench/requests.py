"""``flashspec bench requests``: the default configuration used as a user would use it.

One process builds a fresh engine the way README says (``SpeculativeEngine(target, drafters,
compile=...)``, its warm-up included in the start-up time), then sends chat-formatted requests of
varied domains and lengths one by one (or in groups of ``--batch``), twice: the first pass is what
a user meets, the second the same engine warm. Then, on the same warm engine, every arm alone —
the target alone and each (drafter, γ) as a fixed arm, with no guard — runs the same requests. Per
request: tokens/s of the first pass over the second (a first request must be as fast as the
hundredth: SPEC.md §7, "Warm shapes"), the default configuration over the target alone and over
the best fixed arm for that request, the steps each arm ran and the cold steps (SPEC.md §8).
Requests come from ``--workload`` (:mod:`flashspec.data.workloads`): the corpus's held-out part
(the default), MT-bench, HumanEval, code edits, extraction or the mixed stream; the report gives
figures per category too. MT-bench's turn 2 carries the target's own first answer, generated
greedy by the target alone before the timed passes (not timed). With ``--tree`` the same requests
then run as draft trees, fixed and chosen per step from full information
(:mod:`flashspec.bench.requests_tree`), and the report compares stream totals against the best
single fixed configuration.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from ..data import workloads
from ..data.workloads import HUMANEVAL_STYLES
from .requests_tree import (
    SETTLE_SHARE,
    SETTLE_WINDOW,
    TREE_AUTO,
    check_trees,
    group_labels,
    measure,
    run_trees,
    summary,
    tree_gammas,
    tree_lines,
)
from .results import write_results
from .workload_args import add_workload_arguments, parse_expand

__all__ = ["add_parser", "command", "first_answers", "run", "table", "workload", "workload_requests"]

DOMAINS = ("code", "prose", "chat")
NEW_TOKENS = (160, 256, 384)  # cycled: requests of varied lengths
SNIPPETS = (96, 192, 288)  # corpus tokens in a request's snippet, cycled out of step with NEW_TOKENS
PAYS = 1.15  # "some arm beats the target alone by 15 %": where the default must reach 0.9x the best arm


def workload(corpus: str | Path, tokenizer: Any, count: int, seed: int = 0, new_tokens: tuple[int, ...] = NEW_TOKENS,
             snippets: tuple[int, ...] = SNIPPETS) -> list[dict[str, Any]]:
    """``count`` requests: domains, snippet lengths and new-token budgets cycled, each request a
    held-out snippet in a user instruction through the tokenizer's chat template."""
    return workload_requests("corpus", tokenizer, count=count, corpus=corpus, seed=seed, new_tokens=new_tokens,
                             snippets=snippets)


def first_answers(engine: Any, requests: list[Any], budgets: dict[str, int], batch: int = 1) -> list[str]:
    """The text ``engine`` answers to each request greedy, within the request's budget
    (``budgets[name]``), ``batch`` prompts of one budget per call."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("MT-bench's second turn needs a tokenizer to read the first answer: give --tokenizer.")
    texts: dict[str, str] = {}
    for budget in sorted({budgets[r.name] for r in requests}):
        same = [r for r in requests if budgets[r.name] == budget]
        for i in range(0, len(same), batch):
            group = same[i : i + batch]
            out = engine.generate([r.ids for r in group], max_new_tokens=budget, do_sample=False)
            for r, seq in zip(group, out.sequences):
                texts[r.name] = tokenizer.decode(seq, skip_special_tokens=True).strip()
    return [texts[r.name] for r in requests]


def workload_requests(name: str, tokenizer: Any, *, count: int | None = None, corpus: str | Path | None = None,
                      seed: int = 0, new_tokens: tuple[int, ...] = NEW_TOKENS, snippets: tuple[int, ...] = SNIPPETS,
                      answerer: Any = None, batch: int = 1, **files: Any) -> list[dict[str, Any]]:
    """The requests of workload ``name`` (:func:`flashspec.data.workloads.load`; ``files``:
    ``mtbench_file``, ``humaneval_file``, ``humaneval_style``) with new-token budgets cycled per
    item. MT-bench turn 2 (same budget as its turn 1) is built from ``answerer``'s greedy first
    answer (:func:`first_answers`); without an ``answerer`` only turn 1 runs."""
    items = workloads.load(name, tokenizer, count=count, corpus=corpus, seed=seed, snippets=snippets, **files)
    budgets = {r.name: new_tokens[(i + i // 3) % len(new_tokens)] for i, r in enumerate(items)}
    if answerer is not None:
        items = workloads.add_second_turns(tokenizer, items,
                                           lambda firsts: first_answers(answerer, firsts, budgets, batch))
    first = {r.name: r.name.removesuffix("turn2") + "turn1" if r.turn == 2 else r.name for r in items}
    return [{"workload": r.workload, "category": r.category, "domain": r.category, "name": r.name, "turn": r.turn,
             "request": r, "ids": r.ids, "max_new_tokens": budgets[first[r.name]]} for r in items]


def _call(engine: Any, group: list[dict[str, Any]], temperature: float, seed: int) -> dict[str, Any]:
    """One ``generate`` of ``group``'s prompts, timed as the caller sees it (prefill included)."""
    out, call = measure(engine, engine.generate, group, temperature, seed)
    # What the guard carries to the next request (SPEC.md §8, "What carries over"), in target steps:
    # why a drafting arm was or was not admitted.
    names = [engine.drafters[d].name for d in range(len(engine.drafters))]
    return {**call, "guard_refused": out.stats.guard_refused,
            "guard_step_costs": {engine.arm_label(a, 4): round(r, 3) for a, r in engine.arm_costs.items()},
            "guard_catch_up_costs": {f"{names[d]}/{b}": round(r, 3) for (d, b), r in engine.catch_up_costs.items()}}


def run(target: Any, drafters: list[Any], requests: list[dict[str, Any]], *, batch: int = 1, temperature: float = 0.0,
        compile: bool = False, device: Any = None, dtype: Any = None, tokenizer: Any = None, seed: int = 0,
        progress: bool = True, workload: str | None = None, tree: bool = False,
        expand: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """The measurements of the module docstring, as a JSON-ready dict. ``workload``: the words
    the report's first line gives for the requests (their workload and size). ``tree``: then the
    draft-tree systems of :mod:`flashspec.bench.requests_tree`; ``expand``: drafter name →
    ``(topk, nodes)``, that drafter's part of every tree a top-k expansion (SPEC.md §7)."""
    from tqdm.auto import tqdm

    from ..engine import SpeculativeEngine
    from ..tuning.calibrate import device_name

    if expand and not tree:
        raise ValueError("Top-k expansion (--expand) shapes the draft trees: add --tree.")
    started = time.perf_counter()
    engine = SpeculativeEngine(target, drafters, compile=compile, device=device, dtype=dtype, tokenizer=tokenizer)
    startup = time.perf_counter() - started
    expanded = check_trees(engine, expand) if tree else {}  # before anything runs: the engine can decode trees
    groups = [requests[i : i + batch] for i in range(0, len(requests), batch)]
    systems: dict[str, list[dict[str, Any]]] = {}
    for name in ("first", "warm"):
        systems[name] = [_call(engine, g, temperature, seed) for g in tqdm(groups, desc=f"default, {name}",
                                                                            disable=not progress)]
    selection, slack = engine.selection, engine.slack
    engine.slack = None  # every arm alone, as it runs: no guard
    try:
        for arm in range(len(engine.arms)):
            engine.selection = engine.new_selection("fixed", arm=arm)
            label = engine.arm_label(arm, 4)
            systems[label] = [_call(engine, g, temperature, seed) for g in tqdm(groups, desc=label,
                                                                                 disable=not progress)]
    finally:
        engine.selection, engine.slack = selection, slack
    if tree:
        systems.update(run_trees(engine, groups, temperature, seed, expanded, progress))
    param = next(engine.target.parameters())
    results = {"device": device_name(param.device), "dtype": str(param.dtype).removeprefix("torch."),
               "workload": workload, "compile": compile, "batch": batch, "temperature": temperature,
               "startup_seconds": startup,
               "warmup_seconds": engine.warmup_seconds, "fixed_shapes": engine.fixed_shapes,
               "groups": [{"domains": [r["domain"] for r in g], "workloads": [r.get("workload", "corpus") for r in g],
                           "names": [r.get("name") for r in g], "prompt_tokens": [len(r["ids"]) for r in g],
                           "max_new_tokens": max(r["max_new_tokens"] for r in g)} for g in groups],
               "tree": {"gammas": tree_gammas(engine), "expand": {n: [e.topk, e.nodes] for n, e in expanded.items()},
                        "settle_window": SETTLE_WINDOW, "settle_share": SETTLE_SHARE} if tree else None,
               "systems": systems}
    results["summary"] = summary(results)
    return results


def table(results: dict[str, Any]) -> str:
    """The markdown report: the workload, one row per request (group), the goals' summary, the
    stream totals (with ``--tree``, the draft trees' summary and rows: :func:`tree_lines`), then
    figures per category (MT-bench category, ``humaneval``, corpus domain)."""
    systems = results["systems"]
    arms = [name for name in systems if name not in ("first", "warm", TREE_AUTO) and not name.startswith("tree@")]
    base = "target@0" if "target@0" in systems else None
    fixed = [a for a in arms if a != base]
    labels = group_labels(results["groups"])
    lines = [f"Workload {results['workload']}."] if results.get("workload") else []
    lines += [f"Default configuration as a user meets it: {results['device']}, {results['dtype']}, "
              f"compile={results['compile']}, batch {results['batch']}, T = {results['temperature']}; start-up "
              f"{results['startup_seconds']:.1f} s (warm-up {results['warmup_seconds']:.1f} s).", "",
              "| # | category | prompt | new | first tok/s | warm tok/s | first / warm | cold steps | × target alone "
              "| best fixed arm | × target | default / best | default's steps by arm |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios, over_base, over_best = [], [], []
    for i, group in enumerate(results["groups"]):
        first, warm = systems["first"][i], systems["warm"][i]
        ratio = first["tokens_per_second"] / warm["tokens_per_second"]
        ratios.append(ratio)
        target = systems[base][i]["tokens_per_second"] if base else None
        vs_base = warm["tokens_per_second"] / target if target else None
        if vs_base is not None:
            over_base.append(vs_base)
        best = max(fixed, key=lambda a: systems[a][i]["tokens_per_second"]) if fixed else None
        best_x = systems[best][i]["tokens_per_second"] / target if best and target else None
        vs_best = warm["tokens_per_second"] / systems[best][i]["tokens_per_second"] if best else None
        if vs_best is not None and best_x is not None and best_x >= PAYS:
            over_best.append(vs_best)
        total = sum(warm["steps"].values()) or 1
        shares = ", ".join(f"{a} {n / total:.0%}" for a, n in sorted(warm["steps"].items(), key=lambda x: -x[1]))
        fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {i} | {labels[i]} | {max(group['prompt_tokens'])} | {group['max_new_tokens']} "
                     f"| {first['tokens_per_second']:.1f} | {warm['tokens_per_second']:.1f} | {ratio:.2f} "
                     f"| {first['cold_steps']} | {fmt(vs_base)} | {best or '—'} | {fmt(best_x)} | {fmt(vs_best)} "
                     f"| {shares} |")
    lines += ["", f"* First pass over warm: lowest {min(ratios):.2f}, median {statistics.median(ratios):.2f} "
                  "(goal: none below 0.90)."]
    if over_base:
        lines.append(f"* Default over the target alone (warm): lowest {min(over_base):.2f}, median "
                     f"{statistics.median(over_base):.2f} (goal: none below 0.97).")
    lines.append(f"* Default over the best fixed arm where that arm beats the target alone by {PAYS - 1:.0%}: "
                 + (f"lowest {min(over_best):.2f}, median {statistics.median(over_best):.2f} over {len(over_best)} "
                    "requests (goal: at least 0.90)." if over_best else "no such request."))
    return "\n".join(lines + tree_lines(results) + _by_category(results, labels, base)) + "\n"


def _by_category(results: dict[str, Any], labels: list[str], base: str | None) -> list[str]:
    """Per category, one line: requests, median warm tokens/s, median speedup over the target
    alone and the default's tokens per step (decode tokens over row steps, warm pass)."""
    systems = results["systems"]
    if len(set(labels)) < 2 or "row_steps" not in systems["warm"][0]:
        return []
    lines = ["", "By category (the default configuration, warm):"]
    for label in dict.fromkeys(labels):
        index = [i for i, x in enumerate(labels) if x == label]
        warm = [systems["warm"][i] for i in index]
        words = [f"median {statistics.median(c['tokens_per_second'] for c in warm):.1f} tok/s"]
        if base:
            over = [c["tokens_per_second"] / systems[base][i]["tokens_per_second"] for c, i in zip(warm, index)]
            words.append(f"median {statistics.median(over):.2f}× the target alone")
        steps = sum(c["row_steps"] for c in warm)
        if steps:
            words.append(f"{sum(c['decode_tokens'] for c in warm) / steps:.2f} tokens per step")
        requests = sum(len(results["groups"][i]["domains"]) for i in index)
        lines.append(f"* {label} ({requests} requests): " + ", ".join(words) + ".")
    return lines


def add_parser(sub: Any) -> None:
    """Add ``flashspec bench requests`` to the ``bench`` sub-parsers."""
    from ..models.loading import DTYPES

    p = sub.add_parser("requests", help="the default configuration as a user meets it: a fresh engine, requests "
                                        "one by one, twice, beside the target alone and every fixed arm")
    p.add_argument("--target", required=True, help="folder, hub id or .gguf file")
    p.add_argument("--draft", action="append", default=[], help="a drafter (repeatable)")
    p.add_argument("--tokenizer", default=None, help="default: the target's")
    add_workload_arguments(p, counts="--requests counts MT-bench questions (two requests each), HumanEval problems "
                                     "and code-edit or extraction requests then.")
    p.add_argument("--corpus", default="../shared/corpus", help="the three-domain corpus (held-out part)")
    p.add_argument("--humaneval-style", default="chat", choices=HUMANEVAL_STYLES,
                   help="chat: the prompt in a 'Complete the following Python function' chat request (default); "
                        "completion: the raw prompt")
    p.add_argument("--requests", type=int, default=None,
                   help="items of the workload: corpus requests (default 24; domains and lengths cycled), MT-bench "
                        "questions (default all 80, two requests each), HumanEval problems (default all 164), "
                        "code-edit and extraction requests (default 24 each), mixed (default 32, a quarter from "
                        "each of MT-bench, HumanEval, code-edit and extraction)")
    p.add_argument("--new-tokens", default=",".join(map(str, NEW_TOKENS)), help="new-token budgets, cycled")
    p.add_argument("--snippet-tokens", default=",".join(map(str, SNIPPETS)),
                   help="corpus tokens in each corpus, code-edit or extraction request's snippet, cycled "
                        "(prompts of varied lengths)")
    p.add_argument("--batch", type=int, default=1, help="requests per generate call")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    p.add_argument("--compile", action="store_true", help="SpeculativeEngine(compile=True), as README's GPU default")
    p.add_argument("--tree", action="store_true",
                   help="then draft trees on the same warm engine: one fixed tree@γ per drafter's largest γ (every "
                        "drafter's chain in one tree) and 'tree auto' (generate_tree(gammas='auto'), one budget "
                        "learning across the stream; SPEC.md §7)")
    p.add_argument("--expand", action="append", default=None, metavar="NAME=TOPK,NODES",
                   help="with --tree: drafter NAME's part of each tree is an EAGLE-2 top-k expansion (TOPK children "
                        "per node, NODES kept) instead of its chain (feature and EAGLE-3 drafters; repeatable)")
    p.add_argument("--out", default="bench-results/requests", help="folder for requests.json and requests.md")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """``flashspec bench requests``: check the options, load the target, run, write and print."""
    import math

    from ..checks import check_int
    from ..engine import SpeculativeEngine
    from ..models.loading import DTYPES

    if args.requests is not None:
        check_int("--requests", args.requests, 1)
    check_int("--batch", args.batch, 1)
    sizes = {}
    for flag, text in (("--new-tokens", args.new_tokens), ("--snippet-tokens", args.snippet_tokens)):
        try:
            sizes[flag] = tuple(check_int(flag, int(v), 1) for v in text.split(","))
        except ValueError:
            raise ValueError(f"{flag} must be comma-separated whole numbers >= 1; got {text!r}.") from None
    expand = parse_expand(args.expand)
    if expand and not args.tree:
        raise ValueError("Top-k expansion (--expand) shapes the draft trees: add --tree.")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0; got {args.temperature}.")
    if args.workload in workloads.CORPUS_WORKLOADS and not Path(args.corpus).is_dir():
        raise ValueError(f"--corpus {args.corpus!r} is not a folder (the three-domain corpus).")
    if args.workload in ("mt-bench", "mixed"):  # a missing or corrupt file fails before the model loads
        workloads.read_mtbench(workloads.mtbench_file(args.mtbench_file))
    if args.workload in ("humaneval", "mixed"):
        workloads.read_humaneval(workloads.humaneval_file(args.humaneval_file))
    loader = SpeculativeEngine(args.target, [], tokenizer=args.tokenizer, device=args.device,
                               dtype=DTYPES[args.dtype] if args.dtype else None, warmup=False)
    if loader.tokenizer is None:
        raise ValueError("Chat requests need a tokenizer: give --tokenizer.")
    requests = workload_requests(args.workload, loader.tokenizer, count=args.requests, corpus=args.corpus,
                                 seed=args.seed, new_tokens=sizes["--new-tokens"], snippets=sizes["--snippet-tokens"],
                                 answerer=loader, batch=args.batch, mtbench_file=args.mtbench_file,
                                 humaneval_file=args.humaneval_file, humaneval_style=args.humaneval_style)
    results = run(loader.target, args.draft, requests, batch=args.batch, temperature=args.temperature,
                  compile=args.compile, tokenizer=loader.tokenizer, seed=args.seed, progress=not args.no_progress,
                  workload=workloads.describe(args.workload, [r["request"] for r in requests]), tree=args.tree,
                  expand=expand)
    report = table(results)
    write_results(Path(args.out) / "requests.json", results, report)
    print(report)
