"""``flashspec bench tree-anatomy``: what a draft-tree step costs, part by part (SPEC.md §7, "Tree
steps are graphs too", "The anatomy of a tree step").

For each ``γ`` of ``--gammas`` the allocation is fixed, every drafter at ``γ`` (an expanding
drafter's part at ``min(NODES, TOPK + (γ − 1)·TOPK²)`` nodes), so the node budget grows with ``γ``.
On the same engine and prompts, per ``γ``:

1. **Step.** ``generate_tree`` over every prompt group twice: the first pass captures the step's
   CUDA graphs and is probed (:class:`~flashspec.bench.tree_probes.StepProbe`: each proposal and the
   work after the proposals timed with the device synchronised around them); the second is timed
   as it runs. The step is the median ``StepRecord.seconds`` of the second pass's warm steps (from
   the proposals to the step's one read); τ its tokens per row-step; nodes what it proposed per
   row-step (checked against :meth:`TreeBudget.node_count <flashspec.select.tree_budget.TreeBudget.node_count>`).
2. **Graph** ("score-verify-commit"): on CUDA the step's graph (found by the key the steps ran)
   replayed alone; elsewhere, no graphs: the same work run eagerly inside the first pass.
3. **Target forward**: ``tree_forward`` alone over a tree of the step's node count, same rows and
   cache, in a graph of its own on CUDA.
4. **Drafting**: per drafter, the median of its synchronised proposals in the first pass (device
   time included); **drafter forwards**: its model forwards alone at one proposal's widths (none
   for the n-gram drafter; a network that cannot run alone counts its whole proposal).
5. **Selection**: ``generate_tree(gammas="auto")`` with a fresh ``TreeBudget`` of γ_max ``γ`` for every
   drafter, behind the never-slower guard: ``stats.selector_seconds`` per step.

Derived (:func:`derive`): graph − forward = mask building, verification, compaction and counts;
step − graph − drafting = staging, the read and the host's updates; the share of the step outside
model forwards = 1 − (target forward + drafter forwards) / step. The results are written after
every ``γ``, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from .results import pyplot, save_figure, write_results
from .workload_args import add_workload_arguments, comma_gammas, parse_expand

__all__ = ["GOAL", "add_parser", "command", "derive", "expansions_at", "measure", "run", "table"]

GOAL = 0.10  # the share of a tree step outside the model forwards that the machinery may take
NAME = "tree-anatomy"


def derive(step: float, graph: float, forward: float, drafting: float, drafter_forwards: float,
           selection: float | None = None) -> dict[str, float | None]:
    """The derived parts of a step from its measured ones (any one unit): ``machinery`` = graph −
    forward (mask building, verification, compaction, counts), ``host`` = step − graph − drafting
    (staging, the read, host updates), ``drafting_outside_forwards`` = drafting − drafter forwards,
    ``outside_share`` = 1 − (forward + drafter forwards) / step and, with a ``selection`` time per
    step, ``outside_share_with_selection`` over step + selection."""
    inside = forward + drafter_forwards
    return {"machinery": graph - forward, "host": step - graph - drafting,
            "drafting_outside_forwards": drafting - drafter_forwards, "outside_share": 1 - inside / step,
            "outside_share_with_selection": None if selection is None else 1 - inside / (step + selection)}


def expansions_at(expand: dict[str, tuple[int, int]] | None, gamma: int) -> dict[str, Any]:
    """``--expand``'s ``{name: (topk, nodes)}`` as ``generate_tree``'s ``expand`` at depth ``gamma``:
    ``TreeExpansion(topk, min(nodes, topk + (γ − 1)·topk²))``, the nodes a part of that depth keeps
    (SPEC.md §7); a bad ``topk`` or ``nodes`` is a ValueError."""
    from ..drafters.expansion import TreeExpansion, candidates

    out = {}
    for name, (topk, nodes) in (expand or {}).items():
        TreeExpansion(topk, nodes)  # checks both
        out[name] = TreeExpansion(topk, min(nodes, candidates(gamma, topk)))
    return out


def _median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def _selection(engine: Any, groups: list[list[list[int]]], gamma: int, expand: dict[str, Any],
               options: dict[str, Any]) -> dict[str, Any]:
    """The allocator's host time per step with ``gammas="auto"`` at γ_max ``gamma`` (a fresh budget
    and guard memory, put back after), and the allocations it ran."""
    from ..select.tree_budget import TreeBudget

    saved = getattr(engine, "tree_budget", None), getattr(engine, "tree_guard_memory", None)
    engine.tree_budget, engine.tree_guard_memory = TreeBudget([gamma] * len(engine.drafters)), None
    seconds, steps, ran = 0.0, 0, Counter()
    try:
        for group in groups:
            out = engine.generate_tree(group, gammas="auto", expand=expand or None, **options)
            seconds += out.stats.selector_seconds
            steps += out.stats.steps
            ran.update(r.arm or "target@0" for r in out.stats.step_log)
    finally:
        engine.tree_budget, engine.tree_guard_memory = saved
    return {"selection_ms": 1e3 * seconds / steps if steps else None, "selection_steps": steps,
            "selection_allocations": dict(ran.most_common())}


def measure(engine: Any, groups: list[list[list[int]]], gamma: int, expand: dict[str, Any], *, max_new_tokens: int,
            rounds: int, context: int, selection: bool = True, memo: dict | None = None) -> dict[str, Any]:
    """One row of the report: the module docstring's measurements at every drafter's ``γ`` =
    ``gamma`` (``expand``: :func:`expansions_at`'s for ``gamma``), in milliseconds."""
    from ..select.tree_budget import TreeBudget
    from . import tree_probes as probes

    drafters = engine.drafters
    names = [d.name for d in drafters]
    options = dict(max_new_tokens=max_new_tokens, eos_token_id=[], do_sample=False)
    fixed = dict(gammas=[gamma] * len(drafters), expand=expand or None, **options)
    budget = TreeBudget([gamma] * len(drafters))
    budget.expand({names.index(n): (e.topk, e.nodes) for n, e in expand.items()})
    sizes = [budget.nodes_at(i, gamma) for i in range(len(drafters))]

    probe = probes.StepProbe(engine)
    with probe.watching():  # the first pass: captures, and each part timed with synchronisation
        for group in groups:
            probe.keep(engine.generate_tree(group, **fixed).stats.step_log)
    outs = [engine.generate_tree(group, **fixed) for group in groups]  # the timed pass
    log = [r for out in outs for r in out.stats.step_log]
    warm = [r.seconds for r in log if not r.cold]
    stats = [out.stats for out in outs]
    row_steps = sum(s.row_steps for s in stats)

    replay = probes.replay_seconds(engine._graphs, probe.key(), rounds)
    in_loop = _median_ms(probe.after)
    forward = 1e3 * probes.tree_forward_seconds(engine, sizes, context, rounds)
    drafting = {name: _median_ms(probe.proposals[name]) or 0.0 for name in names}
    batch = engine.target_lm.batch
    memo = {} if memo is None else memo
    drafter_forwards, sources = {}, {}
    for drafter in drafters:
        width = expand[drafter.name].topk if drafter.name in expand else 1
        seconds = probes.drafter_forward_seconds(drafter, gamma, width, batch, context, rounds, memo)
        sources[drafter.name] = ("none" if not probes.has_network(drafter) else
                                 "proposal" if seconds is None else "forwards alone")
        drafter_forwards[drafter.name] = drafting[drafter.name] if seconds is None else 1e3 * seconds
    row: dict[str, Any] = {
        "gamma": gamma, "allocation": Counter(r.arm for r in log).most_common(1)[0][0] if log else None,
        "expand": {n: [e.topk, e.nodes] for n, e in expand.items()}, "node_sizes": dict(zip(names, sizes)),
        "nodes": budget.node_count([gamma] * len(drafters)),
        "nodes_run": sum(s.proposed for s in stats) / row_steps if row_steps else None,
        "tokens_per_step": sum(s.decode_tokens for s in stats) / row_steps if row_steps else None,
        "steps": len(log), "cold_steps": len(log) - len(warm),
        "step_ms": _median_ms(warm or [r.seconds for r in log]),
        "loop_ms": 1e3 * sum(s.decode_seconds for s in stats) / max(sum(s.steps for s in stats), 1),
        "graph_ms": 1e3 * replay if replay is not None else in_loop,
        "graph_source": "replay alone" if replay is not None else "in the loop",
        "graph_in_loop_ms": in_loop, "target_forward_ms": forward,
        "drafting_ms": drafting, "drafting_total_ms": sum(drafting.values()),
        "drafter_forwards_ms": drafter_forwards, "drafter_forwards_total_ms": sum(drafter_forwards.values()),
        "drafter_forwards_source": sources,
        "selector_ms_fixed": 1e3 * sum(s.selector_seconds for s in stats) / max(len(log), 1),
    }
    row.update(_selection(engine, groups, gamma, expand, options) if selection else
               {"selection_ms": None, "selection_steps": 0, "selection_allocations": {}})
    row["derived_ms"] = derive(row["step_ms"], row["graph_ms"], forward, row["drafting_total_ms"],
                               row["drafter_forwards_total_ms"], row["selection_ms"])
    return row


def run(engine: Any, prompts: list[list[int]], *, gammas: list[int], expand: dict[str, tuple[int, int]] | None = None,
        batch: int = 1, max_new_tokens: int = 128, rounds: int = 20, selection: bool = True,
        out: str | Path | None = None, workload: str | None = None) -> dict[str, Any]:
    """Every ``γ`` of ``gammas`` measured (:func:`measure`) on ``prompts`` in groups of ``batch``,
    as a JSON-ready dict; with ``out`` (a folder) ``tree-anatomy.json`` and ``.md`` are rewritten
    after every ``γ``, then ``tree-anatomy.png`` drawn where matplotlib is installed."""
    from ..decode.tree_build import check_expand
    from ..decode.tree_loop import check_tree_engine
    from ..tuning.calibrate import device_name

    if len(prompts) % batch:
        raise ValueError(f"{len(prompts)} prompts do not make groups of {batch} (--batch): every group must "
                         "have the same rows, or the buffers and graphs change between groups.")
    plans = {}
    for gamma in gammas:  # every option checked against the engine before anything runs
        allocation = [gamma] * len(engine.drafters)
        check_tree_engine(engine, allocation, 4)
        plans[gamma] = expansions_at(expand, gamma)
        check_expand(engine.drafters, plans[gamma], allocation)
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    context = int(statistics.mean(len(p) for p in prompts)) + max_new_tokens // 2
    param = next(engine.target.parameters())
    results: dict[str, Any] = {
        "device": device_name(param.device), "dtype": str(param.dtype).removeprefix("torch."),
        "graphs": bool(engine._graphs.enabled), "drafters": [d.name for d in engine.drafters],
        "expand": {n: list(p) for n, p in (expand or {}).items()}, "batch": batch, "prompts": len(prompts),
        "workload": workload, "max_new_tokens": max_new_tokens, "context": context, "rounds": rounds,
        "goal_outside_share": GOAL, "rows": []}
    memo: dict = {}
    for gamma in gammas:
        row = measure(engine, groups, gamma, plans[gamma], max_new_tokens=max_new_tokens, rounds=rounds,
                      context=context, selection=selection, memo=memo)
        results["rows"].append(row)
        print(f"γ = {gamma}: {row['nodes']} nodes, step {row['step_ms']:.3f} ms, outside model forwards "
              f"{row['derived_ms']['outside_share']:.1%}", flush=True)
        if out is not None:
            write_results(Path(out) / f"{NAME}.json", results, table(results))
    if out is not None:
        try:
            plot(results, Path(out) / f"{NAME}.png")
        except ValueError as error:  # no matplotlib: the tables are written
            print(f"no plot: {error}")
    return results


def _ms(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _share(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def table(results: dict[str, Any]) -> str:
    """The markdown report: the setting, one row per ``γ``, each drafter's part, then how each
    number was obtained."""
    graphs = results["graphs"]
    expand = ", ".join(f"{n} top{k}, ≤{m} nodes" for n, (k, m) in results["expand"].items()) or "none"
    lines = [f"Draft-tree step anatomy: {results['device']}, {results['dtype']}, batch {results['batch']}, "
             f"{results['prompts']} prompts" + (f" ({results['workload']})" if results.get("workload") else "")
             + f", {results['max_new_tokens']} new tokens each; drafters {', '.join(results['drafters'])}; "
             f"expansions: {expand}; " + ("CUDA graphs." if graphs else
                                          "no CUDA graphs on this device: plain timings (host clock)."), "",
             "| γ | nodes | τ | step ms | graph ms | target forward ms | mask + verify + commit ms | drafting ms "
             "| drafter forwards ms | host ms | selection ms | outside model forwards |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        d = r["derived_ms"]
        lines.append(f"| {r['gamma']} | {r['nodes']} | {_ms(r['tokens_per_step'], 2)} | {_ms(r['step_ms'])} "
                     f"| {_ms(r['graph_ms'])} | {_ms(r['target_forward_ms'])} | {_ms(d['machinery'])} "
                     f"| {_ms(r['drafting_total_ms'])} | {_ms(r['drafter_forwards_total_ms'])} | {_ms(d['host'])} "
                     f"| {_ms(r['selection_ms'])} | {_share(d['outside_share'])} |")
    lines.append("")
    for r in results["rows"]:
        parts = ", ".join(f"{n} {_ms(r['drafting_ms'][n])} ms (nodes {r['node_sizes'][n]}; model forwards "
                          f"{_ms(r['drafter_forwards_ms'][n])} ms: {r['drafter_forwards_source'][n]})"
                          for n in results["drafters"])
        sel = ""
        if r["selection_ms"] is not None:
            ran = ", ".join(f"{label} ×{n}" for label, n in r["selection_allocations"].items())
            sel = (f"; with selection {_share(r['derived_ms']['outside_share_with_selection'])} outside model "
                   f"forwards (the allocator ran {ran})")
        proposed = "" if r["nodes_run"] == r["nodes"] else f", but its steps proposed {r['nodes_run']} per row"
        lines.append(f"* γ = {r['gamma']} ({r['allocation']}{proposed}): {r['steps']} steps timed ({r['cold_steps']} "
                     f"cold, left out), whole loop {_ms(r['loop_ms'])} ms per step; proposals: {parts}{sel}.")
    goal = results.get("goal_outside_share", GOAL)
    met = [r["gamma"] for r in results["rows"] if r["derived_ms"]["outside_share"] <= goal]
    lines += [f"* Goal: at most {goal:.0%} of the step outside model forwards; met at γ = "
              f"{', '.join(map(str, met)) or 'none'}.", "",
              "How each number is obtained:",
              "* step: median seconds of the warm steps of a second `generate_tree` pass over the prompts "
              "(`StepRecord.seconds`: from the proposals to the step's one read); τ: tokens committed per row-step; "
              "nodes: the tree's node count (`TreeBudget.node_count`), equal to what the steps proposed per row.",
              "* graph (score-verify-commit: mask and parents, target forward, verification, compaction, commit, "
              "counts): " + ("the step's CUDA graph replayed alone (CUDA events, median of rounds)." if graphs else
                             "no graphs here: that work run eagerly inside the first pass, the device synchronised "
                             "around it (median of its warm steps)."),
              "* target forward: `tree_forward` alone over a tree of the same node count, rows and cache "
              + ("(a CUDA graph of its own, replayed)." if graphs else "(host clock)."),
              "* drafting: each drafter's proposal in the first pass with the device synchronised before and "
              "after it (device time, not launch time), median over warm steps, summed over drafters; drafter "
              "forwards: each drafter's model forwards alone (" + ("graph replays" if graphs else "host clock")
              + ") at one proposal's widths (model drafter: 2 then 1 token; feature head: its narrowest window, "
              "then 1 token, or topk per level of an expansion); none for the n-gram drafter.",
              "* mask + verify + commit = graph − target forward; host (staging, the read, host updates) = step − "
              "graph − drafting; outside model forwards = 1 − (target forward + drafter forwards) / step.",
              "* selection: `generate_tree(gammas=\"auto\")` with a fresh budget of γ_max = γ for every drafter, "
              "behind the never-slower guard: `stats.selector_seconds` per step (host time; outside the step's "
              "time, which starts after the choice)."]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> Path:
    """Step, graph, target forward and drafting milliseconds against the tree's node count."""
    plt = pyplot()
    rows = sorted(results["rows"], key=lambda r: r["nodes"])
    fig, ax = plt.subplots(figsize=(6, 4))
    nodes = [r["nodes"] for r in rows]
    for key, label in (("step_ms", "step"), ("graph_ms", "score-verify-commit graph"),
                       ("target_forward_ms", "target tree forward"), ("drafting_total_ms", "proposals")):
        ax.plot(nodes, [r[key] for r in rows], marker="o", label=label)
    for r in rows:
        ax.annotate(f"γ={r['gamma']}", (r["nodes"], r["step_ms"]), fontsize=7, textcoords="offset points",
                    xytext=(3, 3))
    ax.set_xlabel("tree nodes")
    ax.set_ylabel("ms")
    ax.set_title(f"Draft-tree step anatomy, {results['device']}, batch {results['batch']}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def add_parser(sub: Any) -> None:
    """Add ``flashspec bench tree-anatomy`` to the ``bench`` sub-parsers."""
    from ..models.loading import DTYPES

    p = sub.add_parser(NAME, help="the cost of a draft-tree step, part by part: proposals, the score-verify-commit "
                                  "graph, the target's tree forward, host work and selection, per γ")
    p.add_argument("--target", required=True, help="folder, hub id or .gguf file")
    p.add_argument("--draft", action="append", default=None,
                   help="a drafter (repeatable): 'ngram', 'feature:DIR', 'eagle3:DIR', a model, 'store:DOMAIN'; "
                        "default: ngram")
    p.add_argument("--tokenizer", default=None, help="default: the target's")
    p.add_argument("--corpus", default="../shared/corpus", help="the three-domain corpus (held-out part)")
    add_workload_arguments(p, counts="--prompts counts its requests (MT-bench: first turns).")
    p.add_argument("--prompts", type=int, default=6, help="requests of the workload (a multiple of --batch)")
    p.add_argument("--snippet-tokens", type=int, default=192, help="corpus tokens in a corpus request's snippet")
    p.add_argument("--gammas", default="1,2,3,4",
                   help="comma-separated; each a fixed allocation with every drafter at that γ")
    p.add_argument("--expand", action="append", default=None, metavar="NAME=TOPK,NODES",
                   help="drafter NAME's part of each tree is a top-k expansion (at depth γ it keeps min(NODES, "
                        "TOPK + (γ − 1)·TOPK²) nodes; feature and EAGLE-3 heads, ngram; repeatable)")
    p.add_argument("--batch", type=int, default=1, help="prompts per generate_tree call")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens each row generates (EOS does not stop it)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds of each part timed alone (median)")
    p.add_argument("--no-selection", action="store_true", help="skip the gammas='auto' pass that times selection")
    p.add_argument("--seed", type=int, default=0, help="draws the corpus snippets")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", default=f"bench-results/{NAME}", help=f"folder for {NAME}.json, .md and .png")
    p.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """``flashspec bench tree-anatomy``: check every option, load the engine, run, write and print."""
    from ..checks import check_int
    from ..data import workloads
    from ..decode.request import MAX_DRAFT_TOKENS
    from ..engine import SpeculativeEngine
    from ..models.loading import DTYPES

    gammas = comma_gammas(args.gammas)
    if max(gammas) > MAX_DRAFT_TOKENS:
        raise ValueError(f"--gammas must be at most {MAX_DRAFT_TOKENS}; got {args.gammas!r}.")
    expand = parse_expand(args.expand)
    for gamma in gammas:
        expansions_at(expand, gamma)
    for flag, value, low in (("--batch", args.batch, 1), ("--prompts", args.prompts, 1),
                             ("--max-new-tokens", args.max_new_tokens, 2), ("--rounds", args.rounds, 1),
                             ("--snippet-tokens", args.snippet_tokens, 1)):
        check_int(flag, value, low)
    if args.prompts % args.batch:
        raise ValueError(f"--prompts ({args.prompts}) must be a multiple of --batch ({args.batch}): every group "
                         "of prompts must have the same rows.")
    if args.workload in workloads.CORPUS_WORKLOADS and not Path(args.corpus).is_dir():
        raise ValueError(f"--corpus {args.corpus!r} is not a folder (the three-domain corpus).")
    if args.workload in ("mt-bench", "mixed"):  # a missing or corrupt file fails before the model loads
        workloads.read_mtbench(workloads.mtbench_file(args.mtbench_file))
    if args.workload in ("humaneval", "mixed"):
        workloads.read_humaneval(workloads.humaneval_file(args.humaneval_file))
    engine = SpeculativeEngine(args.target, args.draft or ["ngram"], tokenizer=args.tokenizer, device=args.device,
                               dtype=DTYPES[args.dtype] if args.dtype else None, warmup=False)
    if engine.tokenizer is None:
        raise ValueError("The workload's chat requests need a tokenizer: give --tokenizer.")
    requests = workloads.load(args.workload, engine.tokenizer, count=args.prompts, corpus=args.corpus,
                              mtbench_file=args.mtbench_file, humaneval_file=args.humaneval_file, seed=args.seed,
                              snippets=(args.snippet_tokens,))
    results = run(engine, [r.ids for r in requests], gammas=gammas, expand=expand, batch=args.batch,
                  max_new_tokens=args.max_new_tokens, rounds=args.rounds, selection=not args.no_selection,
                  out=Path(args.out), workload=workloads.describe(args.workload, requests))
    print(table(results))
