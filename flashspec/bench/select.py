"""``flashspec bench select``: bandits against every fixed (drafter, γ) arm on a mixed real workload.

One engine holds every arm; each system (a fixed arm, or a bandit configuration with its own
learning state) decodes every prompt of the workload in turn, domains interleaved, so all
systems see the same machine state. The fixed arms' best is only known in hindsight.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..data.corpus import DOMAINS, HELDOUT_FRACTION, heldout_prompts
from ..engine import SpeculativeEngine
from ..select import SELECTORS

__all__ = ["bandit_configs", "run_selection", "summarize_selection"]


def bandit_configs(selectors: list[str]) -> dict[str, dict[str, Any]]:
    """The bandit configurations :func:`run_selection` compares for each selector name: one
    learning state shared by all prompts, and one per domain (``context="domain"``). A name that
    is not a learning selector is a ValueError."""
    for name in selectors:
        if name not in SELECTORS or name in ("fixed", "oracle"):
            raise ValueError(f"Unknown bandit {name!r} for --selectors; choose from ucb1, thompson, "
                             "discounted-ucb, sliding-window-ucb, epsilon-greedy.")
    bandits = {}
    for name in selectors:
        bandits[f"{name} (shared)"] = {"selector": name, "options": {"seed": 0}}
        bandits[f"{name} (per domain)"] = {"selector": name, "options": {"seed": 0}, "context": "domain"}
    return bandits


def run_selection(
    engine: SpeculativeEngine,
    corpus_dir: Path,
    *,
    bandits: dict[str, dict[str, Any]],
    prompts_per_domain: int = 4,
    prompt_tokens: int = 128,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    warm_start_prompts: int = 0,
) -> dict[str, Any]:
    """A mixed workload (domains interleaved) decoded by every fixed arm of ``engine`` and by
    each bandit configuration in ``bandits`` (name -> ``{"selector": ..., "options": {...},
    "context": "domain" | None}``), prompt by prompt, side by side. Bandits learn across the
    workload in its order (shared selectors).

    ``warm_start_prompts > 0`` adds, for each bandit, a copy that first learns (untimed) on that
    many prompts per domain cut from *training* text — what a deployed selector whose state
    survives restarts (``save_selector``/``load_selector``) knows — and then keeps learning on
    the held-out workload like the others. The fixed arms' best is only known in hindsight."""
    tokenizer = engine.tokenizer
    by_domain = {d: heldout_prompts(corpus_dir, d, prompts_per_domain, prompt_tokens, tokenizer, seed) for d in DOMAINS}
    workload = [(d, i, by_domain[d][i]) for i in range(prompts_per_domain) for d in DOMAINS]
    if warm_start_prompts:
        bandits = {**bandits, **{f"{name}, warm-started": {**config, "warm": True} for name, config in bandits.items()}}
        train = {d: heldout_prompts(corpus_dir, d, warm_start_prompts, prompt_tokens, tokenizer, seed, part="train")
                 for d in DOMAINS}
        warm_workload = [(d, train[d][i]) for i in range(warm_start_prompts) for d in DOMAINS]
    systems: dict[str, tuple[Any, dict[str, Any], str | None]] = {}
    for arm in range(len(engine.arms)):
        systems[f"fixed {engine.arm_label(arm)}"] = ("fixed", {"arm": arm}, None)
    for name, config in bandits.items():
        systems[name] = (config["selector"], config.get("options", {}), config.get("context"))
    selections = {}
    for name, (selector, options, _) in systems.items():
        selections[name] = engine.new_selection(selector, **options)  # each system keeps its own learning state
    sampling = dict(do_sample=temperature > 0, temperature=temperature or 1.0)
    # Warm every arm (compilation, CUDA-graph capture) before anything is timed.
    warm = tokenizer("def f(x):\n    return")["input_ids"]
    for arm in range(len(engine.arms)):
        engine.selection = engine.new_selection("fixed", arm=arm)
        engine.generate([warm], max_new_tokens=48, eos_token_id=[], **sampling)
    rows = []

    def use(name: str) -> None:  # make ``name``'s learning state the engine's
        engine.selection = selections[name]

    for name, config in bandits.items():
        if config.get("warm"):
            use(name)
            for domain, prompt in tqdm(warm_workload, desc=f"warm-up: {name}", unit="prompt"):
                engine.generate([prompt], max_new_tokens=max_new_tokens, eos_token_id=[], seed=seed,
                                context=domain if config.get("context") == "domain" else None, **sampling)
    for domain, index, prompt in tqdm(workload, desc="mixed workload", unit="prompt"):
        row: dict[str, Any] = {"domain": domain, "prompt": index, "systems": {}}
        for name, (_, _, context_kind) in systems.items():
            use(name)
            context = domain if context_kind == "domain" else None
            out = engine.generate([prompt], max_new_tokens=max_new_tokens, eos_token_id=[], seed=seed + index,
                                  context=context, **sampling)
            s = out.stats
            row["systems"][name] = {
                "tokens": s.new_tokens, "seconds": s.seconds, "steps": s.steps,
                "selector_seconds": s.selector_seconds, "decode_seconds": s.decode_seconds,
                "arms": {k: v.steps for k, v in s.per_arm.items() if v.steps},
                "acceptance_rate": s.acceptance_rate,
            }
        rows.append(row)
    return {
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "device": str(engine.target.device), "dtype": str(engine.target.dtype)},
        "settings": {"prompts_per_domain": prompts_per_domain, "prompt_tokens": prompt_tokens,
                     "max_new_tokens": max_new_tokens, "temperature": temperature,
                     "warm_start_prompts_per_domain": warm_start_prompts,
                     "arms": [engine.arm_label(a) for a in range(len(engine.arms))],
                     "bandits": {k: {kk: vv for kk, vv in v.items()} for k, v in bandits.items()},
                     "order": "domains interleaved: code, prose, chat, code, ...",
                     "heldout": f"last {HELDOUT_FRACTION:.0%} of each corpus file's decompressed bytes"},
        "rows": rows,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def summarize_selection(results: dict[str, Any]) -> str:
    """Markdown: tokens/s per system per domain and overall, bandit vs the best fixed arm,
    and the selector's time per step."""
    rows = results["rows"]
    names = list(rows[0]["systems"])
    domains = list(dict.fromkeys(r["domain"] for r in rows))

    def rate(name: str, domain: str | None) -> float:
        chosen = [r["systems"][name] for r in rows if domain is None or r["domain"] == domain]
        return sum(c["tokens"] for c in chosen) / sum(c["seconds"] for c in chosen)

    fixed = [n for n in names if n.startswith("fixed ")]
    lines = ["| system | " + " | ".join(domains) + " | overall (mixed) |", "|---|" + "---|" * (len(domains) + 1)]
    for name in names:
        cells = [f"{rate(name, d):.2f}" for d in domains] + [f"**{rate(name, None):.2f}**"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    best_overall = max(fixed, key=lambda n: rate(n, None))
    for name in names:
        if name in fixed:
            continue
        parts = [f"{name}: overall {rate(name, None) / rate(best_overall, None):.2f}× the best single fixed arm "
                 f"({best_overall})"]
        for d in domains:
            best = max(fixed, key=lambda n: rate(n, d))
            parts.append(f"{d} {rate(name, d) / rate(best, d):.2f}× its best ({best})")
        per_step = [c for r in rows for c in [r["systems"][name]]]
        us = 1e6 * sum(c["selector_seconds"] for c in per_step) / sum(c["steps"] for c in per_step)
        share = sum(c["selector_seconds"] for c in per_step) / sum(c["decode_seconds"] for c in per_step)
        parts.append(f"selection {us:.0f} µs per step ({share:.3%} of decode time)")
        lines.append("* " + "; ".join(parts) + ".")
    return "\n".join(lines)
