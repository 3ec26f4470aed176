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
before any timing), HumanEval (``text``: the raw prompts; ``chat``: chat requests) or a mix of the
three, and reports by category (MT-bench category, ``humaneval``, corpus domain) instead of domain.
"""

from __future__ import annotations

import math
import time
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
from ..drafters import ModelDrafter
from ..engine import SpeculativeEngine
from .e2e import _is_model, _is_self_drafter, _machine, drafter_name
from .results import pyplot, save_figure, write_results

__all__ = ["STYLES", "check_options", "load_and_run", "make_requests", "plot", "run", "summarize", "workload_requests",
           "write"]

STYLES = ("text", "chat")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")


def check_options(
    *, drafters: list[str], gammas: list[int], styles: list[str], prompts_per_domain: int, batch: int,
    max_new_tokens: int, prompt_tokens: int = 128, snippet_tokens: int = 192, temperature: float = 0.0,
) -> None:
    """Raise a ValueError for anything that would fail later (before minutes of model loading)."""
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
    per domain. ``text``: HumanEval's raw prompts and corpus continuations; ``chat``: chat requests.
    Categories read ``workload/category`` under ``mixed``."""
    from ..data import workloads as wl
    from .requests import first_answers

    if workload == "corpus":
        return make_requests(Path(corpus or "."), tokenizer, styles=styles, prompts_per_domain=per_category,
                             prompt_tokens=prompt_tokens, snippet_tokens=snippet_tokens, seed=seed)
    if workload not in wl.WORKLOADS:
        raise ValueError(f"Unknown workload {workload!r}; choose from: {', '.join(wl.WORKLOADS)}.")
    if workload == "mt-bench" and "text" in styles:
        raise ValueError("MT-bench has chat requests only: use --styles chat.")
    parts = {"mt-bench", "humaneval", "corpus"} if workload == "mixed" else {workload}
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
        out[style] = {}
        for source, category, ids in found:
            label = f"{source}/{category}" if workload == "mixed" and category != source else category
            out[style].setdefault(label, []).append(ids)
    return out


def _engine(target: Any, name: str, drafter: Any, gamma: int, tokenizer: Any, compile: bool) -> SpeculativeEngine:
    """One fixed arm (drafter, γ); a loaded model is shared, a spec string is built by the engine."""
    if _is_model(drafter):
        drafter = ModelDrafter(drafter, target.config.vocab_size, name=name, compile=compile)
    engine = SpeculativeEngine(target, [drafter], selector="fixed", gammas=[gamma], tokenizer=tokenizer,
                               compile=compile, warmup=False)  # run's own untimed call warms what it uses
    engine.drafters[0].name = name  # the engine calls self-drafters "early-exit:N": use the report's name
    return engine


def _drafter_seconds(engine: SpeculativeEngine) -> float | None:
    """Host seconds inside the drafter's own forwards so far; None where it has none of its own
    (n-gram lookup, early exit: its layers are the target's and count there)."""
    value = getattr(engine.drafters[0], "forward_seconds", None)
    return float(value) if isinstance(value, (int, float)) else None


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
) -> dict[str, Any]:
    """Decode every style's and domain's ``requests`` (from :func:`make_requests`) with one fixed
    arm per drafter × γ; one row per (drafter, γ, domain, style). ``stop_at_eos``: each answer
    ends at the target's EOS (the field's convention on MT-bench and HumanEval); otherwise every
    row generates exactly ``max_new_tokens``. ``drafters`` maps a name to a
    loaded model, ``"ngram"``, a self-drafter spec (``early-exit:N``, ``feature:DIR``,
    ``shallow:DIR``) or a Drafter object. ``warm_up``: one untimed call per engine and style first
    (allocation, compilation, CUDA graphs)."""
    styles = list(requests)
    counts = [len(ps) for by_domain in requests.values() for ps in by_domain.values()]
    check_options(drafters=list(drafters), gammas=list(gammas), styles=styles,
                  prompts_per_domain=min(counts, default=0), batch=batch, max_new_tokens=max_new_tokens,
                  temperature=temperature)
    results: dict[str, Any] = {
        "machine": _machine(target.device, next(target.parameters()).dtype),
        "settings": {
            "drafters": list(drafters), "gammas": list(gammas), "styles": styles, "batch": batch,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "compile": compile,
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
    total = len(drafters) * len(gammas) * sum(len(g) for by_domain in groups.values() for g in by_domain.values())
    bar = tqdm(total=total, desc="acceptance", unit="batch", disable=not progress)
    sample = {"do_sample": temperature > 0, "temperature": temperature or 1.0}
    eos = None if stop_at_eos else []  # None: the target's own EOS ids
    for name, drafter in drafters.items():
        for gamma in gammas:
            engine = _engine(target, name, drafter, gamma, tokenizer, compile)
            for style, by_domain in groups.items():
                if warm_up:
                    every = [b for bs in by_domain.values() for b in bs]
                    longest = max(every, key=lambda b: (len(b), max(map(len, b))))
                    engine.generate(longest, max_new_tokens=max_new_tokens, eos_token_id=[], seed=seed, **sample)
                for domain, batches in by_domain.items():
                    bar.set_postfix_str(f"{name}@{gamma} {style} {domain}", refresh=False)
                    totals = dict.fromkeys(("steps", "row_steps", "proposed", "accepted", "decode_tokens",
                                            "new_tokens"), 0)
                    seconds, drafter_seconds = 0.0, 0.0
                    for index, prompts in enumerate(batches):
                        before = _drafter_seconds(engine)
                        out = engine.generate(prompts, max_new_tokens=max_new_tokens, eos_token_id=eos,
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
                        "drafter": name, "gamma": gamma, "domain": domain, "style": style,
                        "prompts": sum(len(b) for b in batches), "batches": len(batches), **totals,
                        "accepted_per_step": totals["accepted"] / rows if rows else 0.0,
                        "tokens_per_step": totals["decode_tokens"] / rows if rows else 0.0,
                        "acceptance_rate": totals["accepted"] / totals["proposed"] if totals["proposed"] else 0.0,
                        "decode_seconds": seconds,
                        "decode_tokens_per_second": totals["decode_tokens"] / seconds if seconds else None,
                        "drafter_forward_share": (drafter_seconds / seconds
                                                  if _drafter_seconds(engine) is not None and seconds else None),
                    })
            del engine
    bar.close()
    return results


# ----------------------------------------------------------------------------- reporting
def _source(settings: dict[str, Any]) -> str:
    """Where the prompts came from, in words."""
    workload = settings.get("workload", "corpus")
    if workload == "corpus":
        return f"the {settings['heldout']}"
    corpus = f", corpus prompts from the {settings['heldout']}" if workload == "mixed" else ""
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
    lines.append("")
    describe = {"text": "continuations of held-out corpus text",
                "chat": "chat-formatted requests: a held-out snippet inside a user instruction, chat template applied"}
    if s.get("workload", "corpus") != "corpus":
        describe = {"text": "completion prompts: HumanEval's raw prompts, corpus continuations",
                    "chat": "chat requests through the chat template; MT-bench both turns"}
    for style in s["styles"]:
        own = [r for r in rows if r["style"] == style]
        domains = list(dict.fromkeys(r["domain"] for r in own))
        arms = list(dict.fromkeys((r["drafter"], r["gamma"]) for r in own))
        get = {(r["drafter"], r["gamma"], r["domain"]): r for r in own}
        lines += [f"## {style} prompts ({describe.get(style, style)})", "",
                  ("Tokens per step per row (accepted drafts + the target's token), with the acceptance rate α "
                   "(accepted / proposed drafts) in brackets."), "",
                  "| drafter@γ | " + " | ".join(domains) + " | all |", "|---|" + "---|" * (len(domains) + 1)]
        for d, g in arms:
            cells = [f"{get[(d, g, dom)]['tokens_per_step']:.2f} ({get[(d, g, dom)]['acceptance_rate']:.2f})"
                     if (d, g, dom) in get else "—" for dom in domains]
            lines.append(f"| {d}@{g} | " + " | ".join(cells + [_overall([r for r in own if (r["drafter"], r["gamma"])
                                                                          == (d, g)])]) + " |")
        lines += ["", ("Decode tokens/s (prefill excluded), with the drafter's share of decode time in brackets "
                       "where it has forwards of its own."), "",
                  "| drafter@γ | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
        for d, g in arms:
            cells = []
            for dom in domains:
                r = get.get((d, g, dom))
                if r is None:
                    cells.append("—")
                    continue
                share = r["drafter_forward_share"]
                rate = _fmt(r["decode_tokens_per_second"], ".1f")
                cells.append(rate + (f" ({share:.0%})" if share is not None else ""))
            lines.append(f"| {d}@{g} | " + " | ".join(cells) + " |")
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
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    fig, axes = plt.subplots(len(styles), len(domains), figsize=(4.2 * len(domains), 3.2 * len(styles)),
                             squeeze=False, sharey=True)
    for axes_row, style in zip(axes, styles):
        for ax, domain in zip(axes_row, domains):
            for name in drafters:
                points = sorted((r["gamma"], r["tokens_per_step"]) for r in rows
                                if r["drafter"] == name and r["domain"] == domain and r["style"] == style)
                if points:
                    ax.plot(*zip(*points), marker="o", label=name)
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
                  temperature=options.get("temperature", 0.0))
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
    results = run(model, drafters, requests, gammas=gammas, seed=seed, tokenizer=tok, **options)
    results["settings"].update(target=target, prompt_tokens=prompt_tokens, snippet_tokens=snippet_tokens,
                               workload=workload)
    write(results, out_dir)
    return results
