"""The report of ``flashspec bench acceptance`` (:mod:`flashspec.bench.acceptance`): markdown
tables of tokens per step and α by arm and category (with every category pooled), decode
tokens/s, and a plot of tokens per step against γ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .results import pyplot, save_figure, write_results

__all__ = ["arm_label", "plot", "summarize", "write"]


def arm_label(drafter: str, gamma: int, rule: str = "token") -> str:
    """``drafter@γ``, with `` block`` where the drafts are verified as a block."""
    return f"{drafter}@{gamma}" + (" block" if rule == "block" else "")


def _arms(rows: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    return list(dict.fromkeys((r["drafter"], r["gamma"], r.get("acceptance", "token")) for r in rows))


def _source(settings: dict[str, Any]) -> str:
    """Where the prompts came from, in words."""
    workload = settings.get("workload", "corpus")
    if workload == "corpus":
        return f"the {settings['heldout']}"
    quoted = workload in ("mixed", "code-edit", "extraction")
    corpus = f", corpus snippets from the {settings['heldout']}" if quoted else ""
    return f"the {workload} workload (the fewest of one category; MT-bench counts both turns{corpus})"


def _unit(settings: dict[str, Any]) -> str:
    return "domain" if settings.get("workload", "corpus") == "corpus" else "category"


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _overall(rows: list[dict[str, Any]]) -> str:
    """Tokens per step (α) over several domains' rows: their totals pooled, step by step."""
    steps, proposed = sum(r["row_steps"] for r in rows), sum(r["proposed"] for r in rows)
    if not steps:
        return "—"
    alpha = sum(r["accepted"] for r in rows) / proposed if proposed else 0.0
    return f"{sum(r['decode_tokens'] for r in rows) / steps:.2f} ({alpha:.2f})"


def summarize(results: dict[str, Any]) -> str:
    """Markdown: per style, tokens/step (α) by drafter@γ and domain; then decode tokens/s
    (drafter forward share)."""
    m, s = results["machine"], results["settings"]
    rows = results["rows"]
    lines = ["# Acceptance by drafter, γ, domain and prompt style", "",
             (f"Machine: {m['processor']}, {m['threads']} threads, {m.get('gpu', m['device'])}; "
              f"torch {m['torch']}, transformers {m['transformers']}; {m['dtype']}. Created {results['created']}."),
             (f"{'Temperature ' + str(s['temperature']) if s['temperature'] else 'Greedy'}; batch {s['batch']}; "
              f"{s['max_new_tokens']} new tokens per row; {s['prompts_per_domain']} prompts per {_unit(s)} and style "
              f"from {_source(s)}; one fixed arm per drafter × γ; EOS {s['eos']}.")]
    if s.get("target"):
        lines.append(f"Target: {s['target']}; drafters: {', '.join(s['drafters'])}.")
    if s.get("block_size"):
        lines.append(f"Every arm's drafts drafted, scored and verified in chunks of {s['block_size']} (SPEC.md §2, "
                     "\"Chunked drafting\"); the tree arms in one piece.")
    if s.get("tree"):
        lines.append("`tree@γ`: every drafter's chain of γ tokens in one draft tree per step, verified in one target "
                     "forward (`generate_tree`); α is over all its nodes.")
    for name, (topk, nodes) in (s.get("expand") or {}).items():
        if name == "ngram":  # several continuations, not a model's top-k (SPEC.md §7)
            lines.append(f"In `tree@γ`, ngram's part is its best distinct continuations of depth γ (at least {topk}), "
                         f"breadth first, {nodes} nodes at most, instead of its chain.")
        else:
            lines.append(f"In `tree@γ`, {name}'s part is a top-k expansion of depth γ ({topk} children per node, "
                         f"the {nodes} most probable nodes kept) instead of its chain.")
    lines.append("")
    describe = {"text": "continuations of held-out corpus text",
                "chat": "chat-formatted requests: a held-out snippet inside a user instruction, chat template applied"}
    if s.get("workload", "corpus") != "corpus":
        describe = {"text": "completion prompts: HumanEval's raw prompts, corpus continuations",
                    "chat": "chat requests through the chat template; MT-bench both turns"}
    for style in s["styles"]:
        own = [r for r in rows if r["style"] == style]
        domains = list(dict.fromkeys(r["domain"] for r in own))
        arms = _arms(own)
        get = {(r["drafter"], r["gamma"], r.get("acceptance", "token"), r["domain"]): r for r in own}
        lines += [f"## {style} prompts ({describe.get(style, style)})", "",
                  ("Tokens per step per row (accepted drafts + the target's token), with the acceptance rate α "
                   "(accepted / proposed drafts) in brackets; `block`: the drafts verified as a block."), "",
                  "| drafter@γ | " + " | ".join(domains) + " | all |", "|---|" + "---|" * (len(domains) + 1)]
        for arm in arms:
            cells = [f"{get[(*arm, dom)]['tokens_per_step']:.2f} ({get[(*arm, dom)]['acceptance_rate']:.2f})"
                     if (*arm, dom) in get else "—" for dom in domains]
            pooled = _overall([r for r in own if (r["drafter"], r["gamma"], r.get("acceptance", "token")) == arm])
            lines.append(f"| {arm_label(*arm)} | " + " | ".join(cells + [pooled]) + " |")
        lines += ["", ("Decode tokens/s (prefill excluded), with the drafter's share of decode time in brackets "
                       "where it has forwards of its own."), "",
                  "| drafter@γ | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
        for arm in arms:
            cells = []
            for dom in domains:
                r = get.get((*arm, dom))
                if r is None:
                    cells.append("—")
                    continue
                share = r["drafter_forward_share"]
                rate = _fmt(r["decode_tokens_per_second"], ".1f")
                cells.append(rate + (f" ({share:.0%})" if share is not None else ""))
            lines.append(f"| {arm_label(*arm)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Raw numbers per (drafter, γ, domain, style), steps included: `acceptance.json`.")
    return "\n".join(lines)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``acceptance.png``: tokens per step against γ, one line per drafter, one panel per
    domain × style. Returns the files written."""
    plt = pyplot()
    rows = results["rows"]
    styles = results["settings"]["styles"]
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    drafters = list(dict.fromkeys((r["drafter"], r.get("acceptance", "token")) for r in rows))
    fig, axes = plt.subplots(len(styles), len(domains), figsize=(4.2 * len(domains), 3.2 * len(styles)),
                             squeeze=False, sharey=True)
    for axes_row, style in zip(axes, styles):
        for ax, domain in zip(axes_row, domains):
            for name, rule in drafters:
                points = sorted((r["gamma"], r["tokens_per_step"]) for r in rows
                                if (r["drafter"], r.get("acceptance", "token")) == (name, rule)
                                and r["domain"] == domain and r["style"] == style)
                if points:
                    ax.plot(*zip(*points), marker="o", linestyle="--" if rule == "block" else "-",
                            label=name + (" (block)" if rule == "block" else ""))
            ax.set_title(f"{domain}, {style} prompts", fontsize=9)
            ax.set_xlabel("γ (draft tokens per step)", fontsize=8)
            ax.set_ylabel("tokens per step", fontsize=8)
            ax.set_xticks(results["settings"]["gammas"])
            if ax.lines:  # a category may have no prompts of this style (MT-bench: chat only)
                ax.legend(fontsize=7)
    fig.tight_layout()
    return [save_figure(fig, Path(out_dir) / "acceptance.png", dpi=110, bbox_inches="tight")]


def write(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """``acceptance.json``, ``acceptance.md`` and, where matplotlib is installed, ``acceptance.png``."""
    out_dir = Path(out_dir)
    written = write_results(out_dir / "acceptance.json", results, summarize(results))
    try:
        written += plot(results, out_dir)
    except ValueError as error:  # no matplotlib: the tables are still written
        print(f"no plot: {error}")
    return written
