"""Benchmarks: speculative vs target-only decoding on held-out prompts, side by side in one run.

Prompts come from the held-out part of the three-domain corpus (the last 5 % of each file's
decompressed bytes, which no training script reads). Each prompt is decoded by the target alone
and speculatively, alternating, so both see the same machine state; we report ratios.
"""

from __future__ import annotations

import json
import lzma
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..engine import SpeculativeEngine

DOMAINS = {"code": "code.txt.xz", "prose": "prose.txt.xz", "chat": "dialogue.txt.xz"}
HELDOUT_FRACTION = 0.05


def _split(corpus_dir: Path, domain: str) -> tuple[bytes, int]:
    """The domain's decompressed corpus file and where its held-out part (a line start) begins."""
    if domain not in DOMAINS:
        raise ValueError(f"Unknown domain {domain!r}; choose from {', '.join(DOMAINS)}.")
    path = Path(corpus_dir) / DOMAINS[domain]
    if not path.is_file():
        raise ValueError(f"Corpus file {path} not found; pass --corpus pointing at shared/corpus.")
    data = lzma.decompress(path.read_bytes())
    return data, data.index(b"\n", int(len(data) * (1 - HELDOUT_FRACTION))) + 1


def heldout_text(corpus_dir: Path, domain: str, part: str = "heldout") -> str:
    """The last 5 % of the domain's corpus file (decompressed), cut at a line start.
    ``part="train"``: the 5 % just before it instead (inside the 95 % that training may read),
    for warming up learners without touching the evaluation text."""
    if part not in ("heldout", "train"):
        raise ValueError(f"part must be 'heldout' or 'train', got {part!r}.")
    data, cut = _split(corpus_dir, domain)
    if part == "heldout":
        return data[cut:].decode("utf-8", errors="replace")
    begin = data.index(b"\n", int(len(data) * (1 - 2 * HELDOUT_FRACTION))) + 1
    return data[begin:cut].decode("utf-8", errors="replace")


def training_text(corpus_dir: Path, domain: str, max_bytes: int = 4_000_000) -> str:
    """The last ``max_bytes`` of the domain's training part (the first 95 %, cut at line
    starts): text a retrieval drafter may index without seeing the held-out prompts."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be an integer >= 1; got {max_bytes!r}.")
    data, cut = _split(corpus_dir, domain)
    begin = max(0, cut - max_bytes)
    if begin:
        begin = data.index(b"\n", begin) + 1
    return data[begin:cut].decode("utf-8", errors="replace")


def store_drafters(specs: list[str], corpus_dir: Path, tokenizer: Any, max_bytes: int = 4_000_000) -> list[Any]:
    """``"store:DOMAIN"`` entries of ``specs`` become :class:`DatastoreDrafter` objects named
    ``store-DOMAIN`` over that domain's training text; other entries pass through."""
    from ..drafters import DatastoreDrafter

    out = []
    for spec in specs:
        if isinstance(spec, str) and spec.startswith("store:"):
            domain = spec.split(":", 1)[1]
            text = training_text(corpus_dir, domain, max_bytes)
            out.append(DatastoreDrafter.from_text(text, tokenizer, name=f"store-{domain}"))
        else:
            out.append(spec)
    return out


def heldout_prompts(
    corpus_dir: Path, domain: str, count: int, prompt_tokens: int, tokenizer: Any, seed: int = 0,
    part: str = "heldout",
) -> list[list[int]]:
    """``count`` prompts of ``prompt_tokens`` tokens, each starting at a random line of the
    held-out text (fixed seed); ``part="train"`` cuts them from training text instead."""
    text = heldout_text(corpus_dir, domain, part)
    line_starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
    rng = random.Random(f"{domain}-{seed}")
    prompts = []
    while len(prompts) < count:
        start = rng.choice(line_starts[: int(len(line_starts) * 0.9)])
        ids = tokenizer(text[start : start + 8 * prompt_tokens])["input_ids"][:prompt_tokens]
        if len(ids) == prompt_tokens:
            prompts.append(ids)
    return prompts


def run_core(
    target: Any,
    drafter: Any,
    tokenizer: Any,
    corpus_dir: Path,
    *,
    prompts_per_domain: int = 3,
    prompt_tokens: int = 128,
    max_new_tokens: int = 64,
    num_draft_tokens: int = 4,
    temperatures: tuple[float, ...] = (0.0, 0.7),
    seed: int = 0,
) -> dict[str, Any]:
    """Time target-only and speculative decoding of the same prompts; return raw rows."""
    baseline = SpeculativeEngine(target, [], tokenizer=tokenizer)
    speculative = SpeculativeEngine(target, [drafter], tokenizer=tokenizer)
    warm = tokenizer("def f(x):\n    return")["input_ids"]
    for engine in (baseline, speculative):  # first calls allocate; keep them out of the timing
        engine.generate([warm], max_new_tokens=4)
    rows = []
    jobs = [
        (domain, t, i, p)
        for domain in DOMAINS
        for t in temperatures
        for i, p in enumerate(heldout_prompts(corpus_dir, domain, prompts_per_domain, prompt_tokens, tokenizer, seed))
    ]
    for domain, temperature, index, prompt in tqdm(jobs, desc="benchmark", unit="prompt"):
        sampling = dict(do_sample=temperature > 0, temperature=temperature or 1.0, seed=seed + index)
        result = {"domain": domain, "temperature": temperature, "prompt": index}
        for name, engine in (("target_only", baseline), ("speculative", speculative)):
            out = engine.generate(
                [prompt], max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
                eos_token_id=[], **sampling,
            )
            result[name] = out.stats.as_dict()
            if name == "speculative" and temperature == 0:
                result["greedy_outputs_equal"] = out.sequences == result.pop("_baseline_sequences")
            if name == "target_only" and temperature == 0:
                result["_baseline_sequences"] = out.sequences
        result.pop("_baseline_sequences", None)
        result["speedup"] = result["speculative"]["tokens_per_second"] / result["target_only"]["tokens_per_second"]
        rows.append(result)
    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "device": str(target.device),
            "dtype": str(target.dtype),
        },
        "settings": {
            "prompts_per_domain": prompts_per_domain,
            "prompt_tokens": prompt_tokens,
            "max_new_tokens": max_new_tokens,
            "num_draft_tokens": num_draft_tokens,
            "temperatures": list(temperatures),
            "heldout": f"last {HELDOUT_FRACTION:.0%} of each corpus file's decompressed bytes",
        },
        "rows": rows,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def summarize(results: dict[str, Any]) -> str:
    """A markdown table: per domain and temperature, tokens/s of both, speedup, accepted/step."""
    lines = [
        "| domain | temperature | target-only tok/s | speculative tok/s | speedup | mean tokens/step | acceptance | engine overhead | greedy equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in results["rows"]:
        groups.setdefault((row["domain"], row["temperature"]), []).append(row)
    for (domain, temperature), rows in groups.items():
        base = sum(r["target_only"]["new_tokens"] for r in rows) / sum(r["target_only"]["seconds"] for r in rows)
        spec = sum(r["speculative"]["new_tokens"] for r in rows) / sum(r["speculative"]["seconds"] for r in rows)
        per_step = sum(r["speculative"]["mean_tokens_per_step"] for r in rows) / len(rows)
        accept = sum(r["speculative"]["acceptance_rate"] for r in rows) / len(rows)
        overhead = sum(r["speculative"]["overhead_fraction"] for r in rows) / len(rows)
        equal = "—" if temperature else ("yes" if all(r.get("greedy_outputs_equal") for r in rows) else "NO")
        lines.append(
            f"| {domain} | {'greedy' if temperature == 0 else temperature} | {base:.2f} | {spec:.2f} | "
            f"{spec / base:.2f}× | {per_step:.2f} | {accept:.2f} | {overhead:.1%} | {equal} |"
        )
    return "\n".join(lines)


def write(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(summarize(results) + "\n")


def run_forward_costs(
    specs: dict[str, str], dtypes: tuple[str, ...], tokens: tuple[int, ...] = (1, 2, 3, 5),
    context: int = 100, repeats: int = 7, device: str = "cpu",
) -> dict[str, Any]:
    """Median wall time of one cached forward over ``n`` new tokens after a ``context``-token
    prefix, per model and dtype: what a drafting step and a verification step cost."""
    from ..cache import make_lm
    from ..models import load_model

    rows = []
    for dtype in dtypes:
        for name, spec in specs.items():
            model = load_model(spec, device, getattr(torch, dtype))
            lm = make_lm(model)  # the wrapper the engine uses for this model
            gen = torch.Generator().manual_seed(0)
            for n in tqdm(tokens, desc=f"{name} {dtype}", unit="shape"):
                times = []
                for _ in range(repeats):
                    lm.reset(1, context + max(tokens))
                    prefix = torch.randint(0, 1000, (1, context), generator=gen).to(model.device)
                    zero = torch.zeros(1, dtype=torch.long, device=model.device)
                    lm.forward(prefix, zero, logits_at=zero[:, None] + context - 1)
                    new = torch.randint(0, 1000, (1, n), generator=gen).to(model.device)
                    started = time.perf_counter()
                    lm.forward(new, zero + context)
                    times.append(time.perf_counter() - started)
                times.sort()
                rows.append({"model": name, "dtype": dtype, "tokens": n, "ms": 1000 * times[len(times) // 2]})
            del model, lm
    return {"rows": rows, "context": context, "repeats": repeats, "threads": torch.get_num_threads(),
            "platform": platform.platform(), "torch": torch.__version__, "created": time.strftime("%Y-%m-%d %H:%M:%S")}


def summarize_forward_costs(results: dict[str, Any]) -> str:
    """Markdown: ms per forward by model, dtype and new tokens, and the drafter/target ratio c."""
    rows = results["rows"]
    tokens = sorted({r["tokens"] for r in rows})
    lines = ["| model | dtype | " + " | ".join(f"{n} token{'s' if n > 1 else ''}" for n in tokens) + " |",
             "|---|---|" + "---|" * len(tokens)]
    cell = {(r["model"], r["dtype"], r["tokens"]): r["ms"] for r in rows}
    for model, dtype in dict.fromkeys((r["model"], r["dtype"]) for r in rows):
        lines.append(f"| {model} | {dtype} | " + " | ".join(f"{cell[(model, dtype, n)]:.0f} ms" for n in tokens) + " |")
    names = list(dict.fromkeys(r["model"] for r in rows))
    if len(names) == 2 and 1 in tokens:
        for dtype in dict.fromkeys(r["dtype"] for r in rows):
            c = cell[(names[1], dtype, 1)] / cell[(names[0], dtype, 1)]
            lines.append(f"\nc = {names[1]} / {names[0]} at 1 token, {dtype}: **{c:.2f}**")
    return "\n".join(lines)


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
        engine.set_selector(selector, **options)
        selections[name] = engine.selection  # each system keeps its own learning state
    sampling = dict(do_sample=temperature > 0, temperature=temperature or 1.0)
    # Warm every arm (compilation, CUDA-graph capture) before anything is timed.
    warm = tokenizer("def f(x):\n    return")["input_ids"]
    for arm in range(len(engine.arms)):
        engine.set_selector("fixed", arm=arm)
        engine.generate([warm], max_new_tokens=48, eos_token_id=[], **sampling)
    rows = []

    def use(name: str) -> None:  # make ``name``'s learning state the engine's
        engine.use_selection(selections[name])

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
