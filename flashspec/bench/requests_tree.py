"""``flashspec bench requests --tree``: draft trees beside the default and every fixed arm.

On the warm engine, after the fixed chain arms, the same requests run as draft trees
(``SpeculativeEngine.generate_tree``, SPEC.md §7): first one fixed tree per γ, ``tree@γ`` — every
drafter's chain of γ tokens in one tree per step (with ``expand``, that drafter's part a top-k
expansion), γ running over the drafters' largest γ — then ``tree auto``: ``gammas="auto"`` with no
context label, one :class:`~flashspec.select.tree_budget.TreeBudget` learning across the whole
stream in request order from a fresh start (``engine.tree_budget = None`` before it). The fixed trees
run first so that the eager tree path has been touched once before the learned one is timed.

The comparisons (:func:`summary`), all on the warm engine:

* **Stream totals.** A system's throughput over the whole stream is its tokens over its seconds,
  summed over every request. The *best single fixed configuration* is the fixed system (the target
  alone, every chain arm, every fixed tree) of the highest stream throughput: one configuration for
  the whole stream, chosen in hindsight. The default and ``tree auto`` are divided by it.
* **Per request.** ``tree auto`` over the target alone (lowest, median, requests below 0.97×) and
  over the best fixed system for that request (chosen in hindsight per request).
* **Settling** (:func:`settle_steps`). For a request's steps, the allocation ``tree auto`` ran most
  in it (ties: the first run), and the number of steps run before the first window of
  ``w = min(20, steps)`` consecutive steps of which at least 80 % run that allocation: 0 when it
  holds from the first step; None when no window does (the choice did not settle within the
  request). Summarised over the requests whose category differs from the previous request's (a
  change of domain in the stream), beside the others; the stream's first request is neither.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["SETTLE_SHARE", "SETTLE_WINDOW", "TARGET_ALONE", "TREE_AUTO", "check_trees", "group_labels", "measure",
           "most_run", "run_trees", "settle_steps", "summary", "tree_gammas", "tree_lines"]

TREE_AUTO = "tree auto"
TARGET_ALONE = "target@0"
DEFAULT = "warm"  # the default configuration's warm pass
SETTLE_WINDOW, SETTLE_SHARE = 20, 0.8
NEVER_SLOWER = 0.97  # "never below 0.97× the target alone on any request"
PASSES = ("first", "warm")


def measure(engine: Any, generate: Callable[..., Any], group: list[dict[str, Any]], temperature: float,
            seed: int) -> tuple[Any, dict[str, Any]]:
    """One call of ``generate`` (``engine.generate`` or a ``generate_tree``) on ``group``'s prompts,
    timed as the caller sees it (prefill included): its output and the fields every system reports."""
    from ..tuning.timing import measured

    new = max(r["max_new_tokens"] for r in group)
    with measured(engine.target.device) as m:
        out = generate([r["ids"] for r in group], max_new_tokens=new, do_sample=temperature > 0,
                       temperature=temperature or 1.0, seed=seed)
    s = out.stats
    return out, {"tokens": s.new_tokens, "seconds": m["seconds"], "tokens_per_second": s.new_tokens / m["seconds"],
                 "steps": {label: per.steps for label, per in s.per_arm.items() if per.steps},
                 "cold_steps": s.cold_steps, "decode_tokens": s.decode_tokens, "row_steps": s.row_steps,
                 "selector_seconds": s.selector_seconds, "guard_refused": s.guard_refused}


def tree_gammas(engine: Any) -> list[int]:
    """The fixed trees' γs: each drafter's largest γ (as ``gammas="auto"`` takes for its γ_max),
    distinct, ascending. A ``ValueError`` saying why where the engine cannot decode trees."""
    from ..decode.tree_loop import check_tree_engine

    return sorted(set(check_tree_engine(engine, None, 4)))


def check_trees(engine: Any, expand: dict[str, Any] | None) -> dict[str, Any]:
    """``expand`` (drafter name → ``(topk, nodes)``) as ``generate_tree(expand=...)``, checked against
    the engine's drafters at every fixed tree's γ and at ``tree auto``'s γ_max, before anything runs."""
    from ..decode.tree_build import check_expand
    from ..decode.tree_loop import check_tree_engine

    count = len(engine.drafters)
    for gammas in [[g] * count for g in tree_gammas(engine)] + [check_tree_engine(engine, None, 4)]:
        checked = check_expand(engine.drafters, expand, gammas)
    return {engine.drafters[i].name: e for i, e in checked.items()}


def run_trees(engine: Any, groups: list[list[dict[str, Any]]], temperature: float, seed: int,
              expand: dict[str, Any], progress: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Every ``tree@γ``, then ``tree auto`` (a fresh budget learning across ``groups`` in order),
    one call per group: the module docstring's systems, as ``{name: [call per group]}``."""
    from tqdm.auto import tqdm

    from ..decode.tree_warmup import warm_trees

    systems: dict[str, list[dict[str, Any]]] = {}
    fixed = [[g] * len(engine.drafters) for g in tree_gammas(engine)]
    # Every layout the tree systems may step through, captured before they are timed (SPEC.md §7).
    sampling = [{"do_sample": True, "temperature": temperature}] if temperature > 0 else [{}]
    warm_trees(engine, batch_sizes=sorted({len(g) for g in groups}), expand=expand or None, sampling=sampling,
               extra=fixed)
    runs = [(f"tree@{gammas[0]}", gammas) for gammas in fixed] + [(TREE_AUTO, "auto")]
    for name, gammas in runs:
        if gammas == "auto":
            engine.tree_budget = engine.tree_guard_memory = None  # learn from scratch, across this stream only
        calls = []
        generate = functools.partial(engine.generate_tree, gammas=gammas, expand=expand or None)
        for group in tqdm(groups, desc=name, disable=not progress):
            out, call = measure(engine, generate, group, temperature, seed)
            if gammas == "auto":
                labels = [r.arm or TARGET_ALONE for r in out.stats.step_log]
                most, share = most_run(labels)
                call.update(allocations=[[label, n] for label, n in _runs(labels)], most_run=most,
                            most_run_share=share, settle_steps=settle_steps(labels))
            calls.append(call)
        systems[name] = calls
    return systems


def _runs(labels: Sequence[str]) -> list[tuple[str, int]]:
    """``labels`` run-length encoded: ``[(label, consecutive steps), ...]``."""
    out: list[tuple[str, int]] = []
    for label in labels:
        if out and out[-1][0] == label:
            out[-1] = (label, out[-1][1] + 1)
        else:
            out.append((label, 1))
    return out


def most_run(labels: Sequence[str]) -> tuple[str | None, float]:
    """The label most frequent in ``labels`` (ties: the first run) and its share of them."""
    if not labels:
        return None, 0.0
    label, count = Counter(labels).most_common(1)[0]  # equal counts keep first-seen order
    return label, count / len(labels)


def settle_steps(labels: Sequence[str], window: int = SETTLE_WINDOW, share: float = SETTLE_SHARE) -> int | None:
    """Steps run before the choice settles on the request's most-run allocation: the first ``j``
    such that at least ``share`` of steps ``j … j + w − 1`` (``w = min(window, len(labels))``) run
    it; None when no such window exists (or no step ran)."""
    mode, _ = most_run(labels)
    if mode is None:
        return None
    w = min(window, len(labels))
    need = math.ceil(share * w - 1e-9)
    hits = [label == mode for label in labels]
    count = sum(hits[:w])
    for j in range(len(labels) - w + 1):
        if j:
            count += hits[j + w - 1] - hits[j - 1]
        if count >= need:
            return j
    return None


def group_labels(groups: list[dict[str, Any]]) -> list[str]:
    """Each group's category (``workload/category`` when several workloads ran), ``a+b`` for a
    group of several categories."""
    mixed = len({w for g in groups for w in g.get("workloads", ["corpus"])}) > 1
    out = []
    for g in groups:
        sources = g.get("workloads", ["corpus"] * len(g["domains"]))
        names = [f"{w}/{c}" if mixed and c != w else c for w, c in zip(sources, g["domains"])]
        out.append("+".join(dict.fromkeys(names)))
    return out


def _fixed(systems: dict[str, Any]) -> list[str]:
    """The fixed systems: the target alone, every chain arm, every fixed tree."""
    return [name for name in systems if name not in (*PASSES, TREE_AUTO)]


def _throughput(calls: list[dict[str, Any]]) -> float:
    """Tokens over seconds, summed over ``calls``."""
    return sum(c["tokens"] for c in calls) / sum(c["seconds"] for c in calls)


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"lowest": min(values), "median": statistics.median(values)} if values else None


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The module docstring's comparisons from ``results["systems"]``, as a JSON-ready dict."""
    systems = results["systems"]
    fixed = _fixed(systems)
    totals = {name: _throughput(calls) for name, calls in systems.items()}
    best = max(fixed, key=totals.__getitem__) if fixed else None
    out: dict[str, Any] = {"stream_tokens_per_second": totals, "best_single_fixed": best}
    if best is None:
        return out
    out["default_over_best_single_fixed"] = totals[DEFAULT] / totals[best]
    if TREE_AUTO not in systems:
        return out
    auto = systems[TREE_AUTO]
    out["tree_auto_over_best_single_fixed"] = totals[TREE_AUTO] / totals[best]
    if TARGET_ALONE in systems:
        over = [c["tokens_per_second"] / t["tokens_per_second"] for c, t in zip(auto, systems[TARGET_ALONE])]
        out["tree_auto_over_target"] = {**_spread(over), "below": sum(x < NEVER_SLOWER for x in over),
                                        "requests": len(over)}
    per_best = [max(fixed, key=lambda n: systems[n][i]["tokens_per_second"]) for i in range(len(auto))]
    out["best_fixed_per_request"] = per_best
    out["tree_auto_over_best_fixed_per_request"] = _spread(
        [c["tokens_per_second"] / systems[b][i]["tokens_per_second"] for i, (c, b) in enumerate(zip(auto, per_best))])
    steps = sum(sum(c["steps"].values()) for c in auto)
    out["tree_auto_selector_ms_per_step"] = 1e3 * sum(c.get("selector_seconds", 0.0) for c in auto) / max(steps, 1)
    labels = group_labels(results["groups"])
    changed = [i for i in range(1, len(labels)) if labels[i] != labels[i - 1]]
    same = [i for i in range(1, len(labels)) if labels[i] == labels[i - 1]]
    out["settle"] = {"window": SETTLE_WINDOW, "share": SETTLE_SHARE,
                     "after_change": _settled([auto[i]["settle_steps"] for i in changed], changed),
                     "no_change": _settled([auto[i]["settle_steps"] for i in same], same)}
    return out


def _settled(values: list[int | None], index: list[int]) -> dict[str, Any]:
    """Settle steps of some requests: which, how many did not settle, median and largest of the rest."""
    done = [v for v in values if v is not None]
    return {"requests": index, "not_settled": len(values) - len(done),
            "median": statistics.median(done) if done else None, "largest": max(done) if done else None}


def tree_lines(results: dict[str, Any]) -> list[str]:
    """The report's part on stream totals (always) and on the tree systems (where they ran)."""
    systems, s = results["systems"], summary(results)
    best = s["best_single_fixed"]
    if best is None:
        return []
    totals = s["stream_tokens_per_second"]
    among = "the target alone, every chain arm" + (", every fixed tree" if TREE_AUTO in systems else "")
    lines = [f"* Stream totals (tokens over seconds, every request): default {totals[DEFAULT]:.1f} tok/s; best single "
             f"fixed configuration ({among}) {best} {totals[best]:.1f} tok/s; default / best single fixed "
             f"{s['default_over_best_single_fixed']:.2f}."]
    if TREE_AUTO not in systems:
        return lines
    lines.append(f"* Tree auto over the stream: {totals[TREE_AUTO]:.1f} tok/s, "
                 f"{s['tree_auto_over_best_single_fixed']:.2f}× the best single fixed configuration (goal: at least "
                 f"1.15); allocator {s['tree_auto_selector_ms_per_step']:.2f} ms per step.")
    if "tree_auto_over_target" in s:
        t = s["tree_auto_over_target"]
        lines.append(f"* Tree auto over the target alone: lowest {t['lowest']:.2f}, median {t['median']:.2f}, "
                     f"{t['below']} of {t['requests']} requests below {NEVER_SLOWER} (goal: none).")
    b = s["tree_auto_over_best_fixed_per_request"]
    lines.append(f"* Tree auto over the best fixed configuration of each request (chosen in hindsight per request): "
                 f"lowest {b['lowest']:.2f}, median {b['median']:.2f}.")
    trees = [n for n in systems if n.startswith("tree@")]
    for tree in trees:
        gamma = tree.removeprefix("tree@")
        chains = ", ".join(f"{n} {totals[n]:.1f}" for n in _fixed(systems) if n.endswith(f"@{gamma}")
                           and not n.startswith("tree@") and n != TARGET_ALONE)
        lines.append(f"* {tree} (every drafter's chain of {gamma} in one tree) over the stream: {totals[tree]:.1f} "
                     f"tok/s; the chains alone at γ = {gamma}: {chains or 'none'}.")
    for key, words in (("after_change", "after a change of category"), ("no_change", "of the previous category")):
        st = s["settle"][key]
        if st["requests"]:
            lines.append(f"* Steps until tree auto settles, requests {words} ({len(st['requests'])}): "
                         + (f"median {st['median']}, largest {st['largest']}" if st["median"] is not None else "—")
                         + f", {st['not_settled']} not settled.")
    lines.append(f"* Settling: the steps run before the first window of min({SETTLE_WINDOW}, the request's steps) "
                 f"consecutive steps of which at least {SETTLE_SHARE:.0%} run the allocation tree auto ran most in "
                 "that request; not settled: no such window.")
    return lines + _tree_table(results, s, trees)


def _tree_table(results: dict[str, Any], s: dict[str, Any], trees: list[str]) -> list[str]:
    """One row per request (group): tree auto beside the target alone, the fixed trees and the best
    fixed configuration of that request; its most-run allocation and settle steps."""
    systems = results["systems"]
    labels = group_labels(results["groups"])
    lines = ["", "Draft trees (warm engine; tree auto learns across the stream in request order, from a fresh "
                 "start):", "",
             "| # | category | tree auto tok/s | × target alone | " + "".join(f"{t} tok/s | " for t in trees)
             + "best fixed | tree auto / best | most-run allocation | settle steps |",
             "|---|---|---|---|" + "---|" * len(trees) + "---|---|---|---|"]
    for i, call in enumerate(systems[TREE_AUTO]):
        target = systems[TARGET_ALONE][i]["tokens_per_second"] if TARGET_ALONE in systems else None
        best = s["best_fixed_per_request"][i]
        vs_target = f"{call['tokens_per_second'] / target:.2f}" if target else "—"
        settle = call.get("settle_steps")
        lines.append(f"| {i} | {labels[i]} | {call['tokens_per_second']:.1f} | {vs_target} | "
                     + "".join(f"{systems[t][i]['tokens_per_second']:.1f} | " for t in trees)
                     + f"{best} | {call['tokens_per_second'] / systems[best][i]['tokens_per_second']:.2f} | "
                     f"{call.get('most_run') or '—'} ({call.get('most_run_share', 0.0):.0%}) | "
                     f"{'—' if settle is None else settle} |")
    return lines
