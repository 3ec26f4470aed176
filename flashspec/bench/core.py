"""``flashspec bench core`` and ``flashspec bench forward``: speculative vs target-only decoding
on held-out prompts, side by side in one run, and the cost of one cached forward.

Prompts come from the held-out part of the three-domain corpus (:mod:`flashspec.data.corpus`:
the last 5 % of each file's decompressed bytes, which no training script reads). Each prompt is
decoded by the target alone and speculatively, alternating, so both see the same machine state;
we report ratios.
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

__all__ = ["run_core", "run_forward_costs", "summarize", "summarize_forward_costs"]


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
    speculative = SpeculativeEngine(target, [drafter], selector="fixed", tokenizer=tokenizer)
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


def run_forward_costs(
    specs: dict[str, str], dtypes: tuple[str, ...], tokens: tuple[int, ...] = (1, 2, 3, 5),
    context: int = 100, repeats: int = 7, device: str = "cpu",
) -> dict[str, Any]:
    """Median wall time of one cached forward over ``n`` new tokens after a ``context``-token
    prefix, per model and dtype: what a drafting step and a verification step cost."""
    from ..models.cached import make_lm
    from ..models.loading import load_model

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
