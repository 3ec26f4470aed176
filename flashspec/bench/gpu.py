"""The GPU benchmark: one run that checks, times and reports everything the GPU issue asks for.

``flashspec bench gpu`` runs, in one process on one GPU:

1. the device's copy bandwidth (the ceiling every "fraction of bandwidth" below refers to);
2. the verification kernels against the PyTorch reference over a grid of shapes
   (:mod:`flashspec.bench.kernels`);
3. end to end at batch 1, for each target given: target-only decoding against its HBM roofline
   (weight + KV bytes per token over the copy bandwidth), speculative decoding with its drafter,
   the share of a speculative step spent outside the model forwards, greedy drift in bf16 and
   token-for-token equality in float32.

Models are real checkpoints (``--target``/``--drafter``) and/or random-weight models of real
shapes (``--shaped llama3-8b``): a forward's time does not depend on the weights' values.
"""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..data.corpus import DOMAINS, heldout_prompts
from ..drafters.feature import FeatureDrafter
from ..drafters.shallow import ShallowDrafter
from ..engine import SpeculativeEngine
from ..kernels import pdl
from ..models.static import StaticLM
from ..tuning.timing import forward_seconds, synchronize
from .results import write_results

SHAPES = {
    # Llama-3-8B, Llama-3.2-1B and Qwen2.5-1.5B/0.5B shapes (public configs); random weights.
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                      tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                         max_position_embeddings=32768, tie_word_embeddings=True, use_sliding_window=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                         max_position_embeddings=32768, tie_word_embeddings=True, use_sliding_window=False),
}


def shaped_model(name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Any:
    """A random-weight model of a real model's shape, built directly on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(SHAPES[name])
    kind = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape.pop("model_type", "llama")]
    config = kind(**shape, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def weight_bytes_per_token(model: Any) -> int:
    """Bytes of weights one decode step must read: every parameter once, except the input
    embedding table, of which a step reads one row (when it is tied to the output head, the
    head reads it all, and it is counted once)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embedding and p is not head:
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model: Any, context: float) -> float:
    """Bytes of keys and values a decode step reads at ``context`` tokens of context."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_position * context * next(model.parameters()).element_size()


def _decode(engine: SpeculativeEngine, prompts: list[list[int]], max_new_tokens: int, **kwargs: Any) -> dict:
    """Decode each prompt alone (batch 1); tokens/s per prompt, stats and the outputs."""
    rates, steps, decode_seconds, outputs, accepted, proposed = [], 0, 0.0, [], 0, 0
    for prompt in prompts:
        synchronize(engine.target.device)
        out = engine.generate([prompt], max_new_tokens=max_new_tokens, eos_token_id=[], **kwargs)
        s = out.stats
        rates.append(s.decode_tokens / s.decode_seconds)
        steps += s.steps
        decode_seconds += s.decode_seconds
        accepted += s.accepted
        proposed += s.proposed
        outputs.append(out.sequences[0])
    return {
        "tokens_per_second_median": statistics.median(rates),
        "tokens_per_second_min": min(rates),
        "tokens_per_second_max": max(rates),
        "step_seconds": decode_seconds / steps,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_tokens_per_step": sum(len(o) - 1 for o in outputs) / steps,
        "outputs": outputs,
    }


def _hf_generate_rate(model: Any, prompt: list[int], max_new_tokens: int) -> float:
    ids = torch.tensor([prompt], device=model.device)
    model.generate(ids, max_new_tokens=8, do_sample=False)
    synchronize(model.device)
    begin = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    synchronize(model.device)
    return (out.shape[1] - len(prompt)) / (time.perf_counter() - begin)


def _drift(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many outputs differ, and where the first difference falls."""
    firsts = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), None) for u, v in zip(a, b)]
    differing = [f for f in firsts if f is not None]
    return {"prompts": len(a), "differing": len(differing), "first_difference": differing}


class _FedForward:
    """A feature drafter's forward as it runs per draft, for :func:`forward_seconds`: its network
    (:meth:`FeatureDrafter.network`: the input projection ``fc([f; e])``, its layer and head),
    compiled when the drafter's proposals are."""

    def __init__(self, drafter: FeatureDrafter) -> None:
        self.drafter, self.model = drafter, drafter.lm.model
        self._network = torch.compile(drafter.network, dynamic=False) if drafter.compiled else drafter.network

    def reset(self, batch: int, capacity: int) -> bool:
        return self.drafter.lm.reset(batch, capacity)

    @torch.inference_mode()  # as the drafter's proposals (the decode kernels have no backward)
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        features = self.drafter.lm.base.embed_tokens(tokens).zero_()  # a feature's cost, not its value
        return self._network(tokens, features, start, **kwargs)


def bench_pair(
    name: str,
    target: Any,
    drafter: Any,
    prompts: dict[str, list[list[int]]],
    copy_bandwidth: float,
    *,
    max_new_tokens: int,
    gamma: int,
    compile: bool,
    temperatures: tuple[float, ...] = (0.0,),
    hf_baseline: bool = False,
    maps_table: bool = True,
) -> dict[str, Any]:
    """Target-only vs speculative for one target/drafter pair on prompts by domain."""
    result: dict[str, Any] = {"name": name, "gamma": gamma, "compile": compile, "max_new_tokens": max_new_tokens}
    baseline = SpeculativeEngine(target, [], compile=compile)
    speculative = SpeculativeEngine(target, [drafter] if drafter is not None else [], selector="fixed", compile=compile)
    warm = next(iter(prompts.values()))[0]
    started = time.perf_counter()
    for engine in (baseline, speculative):  # compile and capture outside the timings
        for t in temperatures:
            engine.generate([warm], max_new_tokens=max_new_tokens, num_draft_tokens=gamma, eos_token_id=[],
                            do_sample=t > 0, temperature=t or 1.0, seed=0)
    result["warmup_seconds"] = time.perf_counter() - started

    context = statistics.mean(len(p) for ps in prompts.values() for p in ps) + max_new_tokens / 2
    weights = weight_bytes_per_token(target)
    per_token = weights + kv_bytes_per_token(target, context)
    result["bytes_per_token"] = {"weights": weights, "kv_at_mean_context": per_token - weights, "mean_context": context}
    result["roofline_tokens_per_second"] = copy_bandwidth / per_token

    rows = []
    for domain, domain_prompts in prompts.items():
        for t in temperatures:
            sampling = dict(do_sample=t > 0, temperature=t or 1.0, seed=0)
            base = _decode(baseline, domain_prompts, max_new_tokens, **sampling)
            spec = _decode(speculative, domain_prompts, max_new_tokens, num_draft_tokens=gamma, **sampling)
            row = {
                "domain": domain, "temperature": t, "prompts": len(domain_prompts),
                "target_only": {k: v for k, v in base.items() if k != "outputs"},
                "speculative": {k: v for k, v in spec.items() if k != "outputs"},
                "speedup": spec["tokens_per_second_median"] / base["tokens_per_second_median"],
            }
            row["target_only"]["roofline_fraction"] = base["tokens_per_second_median"] / result["roofline_tokens_per_second"]
            if t == 0:
                row["greedy_drift"] = _drift(base["outputs"], spec["outputs"])
            rows.append(row)
    result["rows"] = rows

    # Step anatomy: the forwards alone (graph replays) against a measured speculative step.
    lm_target = baseline._target_lm
    context_int = int(context)
    fwd = {"target_1": forward_seconds(lm_target, 1, 1, context_int),
           f"target_{gamma + 1}": forward_seconds(lm_target, 1, gamma + 1, context_int)}
    made = speculative.drafters[0] if drafter is not None else None
    window = getattr(made, "MIN_WINDOW", None) if isinstance(made, (FeatureDrafter, ShallowDrafter)) else None
    lm_draft = getattr(made, "lm", None) if window else getattr(made, "_lm", None)
    if isinstance(lm_draft, StaticLM):
        if isinstance(made, FeatureDrafter):
            lm_draft = _FedForward(made)
        fwd["drafter_1"] = forward_seconds(lm_draft, 1, 1, context_int)
        # a model drafter feeds 2 tokens first (its catch-up); a feature or shallow drafter
        # re-feeds its window, at least MIN_WINDOW positions (SPEC.md §11): timed at that width
        fwd["drafter_2" if window is None else f"drafter_{window}"] = forward_seconds(lm_draft, 1, window or 2,
                                                                                      context_int)
        if isinstance(made, ShallowDrafter):  # each draft also runs the target's first N layers on one token
            shared = forward_seconds(lm_target, 1, 1, context_int, layers=made.feature_layer)
            fwd["shared_layers_1"] = shared
            fwd["drafter_1"] += shared
            fwd[f"drafter_{window}"] += shared
    result["forward_seconds"] = fwd
    if maps_table and isinstance(lm_target, StaticLM):
        result["forward_by_decode_maps"] = forward_by_decode_maps(lm_target, (1, gamma + 1), context_int)
    greedy = [r for r in rows if r["temperature"] == 0]
    if greedy:
        base_step = statistics.mean(r["target_only"]["step_seconds"] for r in greedy)
        result["target_only_overhead"] = 1 - fwd["target_1"] / base_step
        if "drafter_1" in fwd:
            spec_step = statistics.mean(r["speculative"]["step_seconds"] for r in greedy)
            first = fwd["drafter_2"] if window is None else fwd[f"drafter_{window}"]
            inside = fwd[f"target_{gamma + 1}"] + first + (gamma - 1) * fwd["drafter_1"]
            result["speculative_step_seconds"] = spec_step
            result["speculative_forwards_seconds"] = inside
            result["speculative_overhead"] = 1 - inside / spec_step
    if hf_baseline:
        result["hf_generate_eager_tokens_per_second"] = _hf_generate_rate(target, warm, 64)
    return result


DECODE_MAP_SETS = {"none": (), "o": ("o",), "o+down": ("o", "down"), "qkv+o+down": ("qkv", "o", "down"),
                   "all": ("qkv", "o", "gate_up", "down")}


def forward_by_decode_maps(lm: StaticLM, widths: tuple[int, ...], context: int, rounds: int = 2) -> dict:
    """The decode forward's graph-replay time with each set of maps sent through
    :func:`flashspec.decode_linear.decode_linear` (:data:`DECODE_MAP_SETS`, set as both
    ``decode_maps`` and ``decode_maps_wide``; where :mod:`flashspec.pdl` runs, the defaults without
    it too), side by side in this process, ``rounds`` times over
    so drift between variants shows. Sets the model refuses (a float32 model; a norm decode_linear
    does not reproduce) are left out. The defaults are put back."""
    default, pdl_setting = (lm.decode_maps, lm.decode_maps_wide), pdl.ENABLED
    variants: list[tuple[str, Any, Any, bool]] = [(label, maps, maps, True) for label, maps in DECODE_MAP_SETS.items()]
    if pdl.enabled(next(lm.model.parameters()).device):  # and the defaults without flashspec.pdl
        variants.append(("defaults, PDL off", *default, False))
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for _ in range(rounds):
            for label, maps, wide, use_pdl in variants:
                try:
                    lm.decode_maps, lm.decode_maps_wide = maps, wide
                except ValueError:
                    continue
                pdl.ENABLED = pdl_setting and use_pdl
                times = out.setdefault(label, {})
                for width in widths:
                    times.setdefault(str(width), []).append(forward_seconds(lm, 1, width, context))
    finally:
        lm.decode_maps, lm.decode_maps_wide = default
        pdl.ENABLED = pdl_setting
    return {"default": sorted(default[0]), "default_wide": sorted(default[1]), "seconds": out}


def _decode_maps_lines(by_maps: dict) -> list[str]:
    """Markdown: forward time per map set and width, each round, and the change against none."""
    seconds = by_maps["seconds"]
    if "none" not in seconds:
        return []
    widths = list(seconds["none"])
    wide = by_maps.get("default_wide", by_maps["default"])
    lines = [f"Decode forward by the maps sent through `decode_linear` (graph replay, ms, each round; "
             f"defaults {{{', '.join(by_maps['default'])}}} for one token row, {{{', '.join(wide)}}} for "
             "several):", "",
             "| maps | " + " | ".join(f"width {w}" for w in widths) + " | change vs none (last round) |",
             "|---|" + "---|" * len(widths) + "---|"]
    for label, times in seconds.items():
        cells = [" / ".join(f"{t * 1e3:.3f}" for t in times[w]) for w in widths]
        change = ", ".join(f"{times[w][-1] / seconds['none'][w][-1] - 1:+.1%}" for w in widths)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {change} |")
    return lines + [""]


def float32_equality(target_spec: Any, drafter_spec: Any, prompts: list[list[int]], max_new_tokens: int,
                     gamma: int, loader: Any) -> dict:
    """Greedy speculative vs target-only outputs with float32 models: expected identical."""
    target, drafter = loader(target_spec, torch.float32), loader(drafter_spec, torch.float32)
    base = SpeculativeEngine(target, [])
    spec = SpeculativeEngine(target, [drafter], selector="fixed")
    a = [base.generate([p], max_new_tokens=max_new_tokens, eos_token_id=[]).sequences[0] for p in prompts]
    b = [spec.generate([p], max_new_tokens=max_new_tokens, num_draft_tokens=gamma, eos_token_id=[]).sequences[0]
         for p in prompts]
    del target, drafter, base, spec
    torch.cuda.empty_cache()
    return _drift(a, b)


def run(
    out_dir: Path,
    *,
    target: str | None,
    drafter: str | None,
    corpus: Path | None,
    shaped: tuple[str, ...] = ("llama3-8b",),
    kernels: bool = True,
    prompts_per_domain: int = 4,
    prompt_tokens: int = 256,
    max_new_tokens: int = 256,
    gamma: int = 4,
    compile: bool = True,
    maps_table: bool = True,
    hf_baseline: bool = True,
) -> dict[str, Any]:
    """Everything, in one process; writes ``gpu.json`` and ``gpu.md`` into ``out_dir``.
    ``maps_table``: also time the real target's forward per set of decode-linear maps (it
    captures the forward once per set); ``hf_baseline``: also time transformers' eager
    ``generate`` on it."""
    from ..models.loading import load_model, load_tokenizer
    from . import kernels as bench_kernels

    if not torch.cuda.is_available():
        raise ValueError("flashspec bench gpu needs a CUDA GPU.")
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {
        "machine": {"gpu": props.name, "multiprocessors": props.multi_processor_count, "torch": torch.__version__,
                    "platform": platform.platform(), "created": time.strftime("%Y-%m-%d %H:%M:%S")},
        "settings": {"prompts_per_domain": prompts_per_domain, "prompt_tokens": prompt_tokens,
                     "max_new_tokens": max_new_tokens, "gamma": gamma, "compile": compile},
    }
    try:
        import triton

        results["machine"]["triton"] = triton.__version__
    except ImportError:
        results["machine"]["triton"] = None
    copy_bw = bench_kernels.measure_copy_bandwidth("cuda")
    results["copy_bandwidth_bytes_per_second"] = copy_bw
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s", flush=True)

    def save() -> None:  # after every section, so that a later failure loses only that section
        write_results(out_dir / "gpu.json", results)

    if kernels:
        results["kernels"] = bench_kernels.bench_verify("cuda")
        save()
        table = bench_kernels.format_table(results["kernels"], copy_bw)
        write_results(out_dir / "kernels.md", markdown=table)
        print(table, flush=True)

    results["pairs"] = []
    if target is not None:
        load = lambda spec, dtype: load_model(spec, "cuda", dtype)  # noqa: E731
        tokenizer = load_tokenizer(target)
        prompts = {d: heldout_prompts(corpus, d, prompts_per_domain, prompt_tokens, tokenizer) for d in DOMAINS}
        t_model = load(target, torch.bfloat16)
        made_from_target = bool(drafter) and drafter.startswith(("early-exit:", "feature:", "shallow:"))
        d_model = drafter if made_from_target else load(drafter, torch.bfloat16) if drafter else None
        pair = bench_pair(Path(target).stem, t_model, d_model, prompts, copy_bw, max_new_tokens=max_new_tokens,
                          gamma=gamma, compile=compile, temperatures=(0.0, 0.7), hf_baseline=hf_baseline,
                          maps_table=maps_table)
        del t_model, d_model
        torch.cuda.empty_cache()
        if drafter and not made_from_target:  # float32_equality loads model drafters only
            few = [p for ps in prompts.values() for p in ps[:2]]
            pair["float32_greedy"] = float32_equality(target, drafter, few, 64, gamma, load)
        results["pairs"].append(pair)
        save()
        print(summarize(results), flush=True)
    for name in shaped:
        t_model = shaped_model(name)
        d_model = shaped_model("llama3-1b", seed=1)
        vocab = t_model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = {"random": [torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(2)]}
        pair = bench_pair(name, t_model, d_model, prompts, copy_bw, max_new_tokens=max_new_tokens,
                          gamma=gamma, compile=compile)
        pair["note"] = "random weights: acceptance is meaningless; forward and step costs are real"
        results["pairs"].append(pair)
        del t_model, d_model
        torch.cuda.empty_cache()
        save()
    write_results(out_dir / "gpu.json", results, summarize(results))
    print(summarize(results), flush=True)
    return results


def summarize(results: dict[str, Any]) -> str:
    """Markdown tables of the end-to-end results (the kernel table is :func:`flashspec.bench.kernels.format_table`)."""
    bw = results["copy_bandwidth_bytes_per_second"]
    lines = [f"Copy bandwidth (measured in this run): **{bw / 1e12:.2f} TB/s** on {results['machine']['gpu']}.", ""]
    for pair in results.get("pairs", []):
        lines += [
            f"### {pair['name']} (γ = {pair['gamma']}, compile = {pair['compile']}, "
            f"{pair['max_new_tokens']} new tokens, batch 1)",
            "",
            f"Roofline: {pair['bytes_per_token']['weights'] / 1e9:.2f} GB of weights + "
            f"{pair['bytes_per_token']['kv_at_mean_context'] / 1e6:.1f} MB of KV per token → "
            f"**{pair['roofline_tokens_per_second']:.0f} tokens/s**.",
            "",
            "| domain | T | target-only tok/s | of roofline | speculative tok/s | speedup | tokens/step | acceptance | greedy drift |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in pair["rows"]:
            base, spec = r["target_only"], r["speculative"]
            drift = r.get("greedy_drift")
            drift_text = f"{drift['differing']}/{drift['prompts']}" if drift else "—"
            accept = f"{spec['acceptance_rate']:.2f}" if spec["acceptance_rate"] is not None else "—"
            lines.append(
                f"| {r['domain']} | {r['temperature'] or 'greedy'} | {base['tokens_per_second_median']:.0f} | "
                f"{base['roofline_fraction']:.0%} | {spec['tokens_per_second_median']:.0f} | {r['speedup']:.2f}× | "
                f"{spec['mean_tokens_per_step']:.2f} | {accept} | {drift_text} |"
            )
        fwd = pair.get("forward_seconds", {})
        lines.append("")
        lines.append("Forward alone (graph replay): " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in fwd.items()) + ".")
        if "forward_by_decode_maps" in pair:
            lines += [""] + _decode_maps_lines(pair["forward_by_decode_maps"])
        if "target_only_overhead" in pair:
            lines.append(f"Target-only step outside the forward: {pair['target_only_overhead']:.1%}.")
        if "speculative_overhead" in pair:
            lines.append(
                f"Speculative step {pair['speculative_step_seconds'] * 1e3:.3f} ms, of which forwards "
                f"{pair['speculative_forwards_seconds'] * 1e3:.3f} ms: **{pair['speculative_overhead']:.1%} outside the "
                "model forwards**."
            )
        if "hf_generate_eager_tokens_per_second" in pair:
            lines.append(f"Hugging Face `generate()` (eager, same model): {pair['hf_generate_eager_tokens_per_second']:.0f} tokens/s.")
        if "float32_greedy" in pair:
            f = pair["float32_greedy"]
            lines.append(f"float32 greedy, speculative vs target-only: {f['prompts'] - f['differing']}/{f['prompts']} identical.")
        if "note" in pair:
            lines.append(f"_{pair['note']}_")
        lines.append("")
    return "\n".join(lines)
