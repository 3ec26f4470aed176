"""Tensor-parallel benchmark and checks for the GPUs of one host (SPEC.md §9).

Launch one process per GPU::

    torchrun --standalone --nproc-per-node 2 -m flashspec bench tp --out bench-results/tp
    flashspec bench tp --summarize bench-results/tp      # markdown table of all runs

(``benchmarks/tp.sh`` runs 1, 2 and, where there are 4 GPUs, 4 processes, then the summary.)
``flashspec bench tp`` turns its flags into a :class:`TPOptions` and calls :func:`run`. With
``N`` processes, rank 0 writes ``OUT/tp{N}.json``. Sections:

1. **equality** (N > 1): greedy tokens of the sharded target vs one process with the whole
   model on rank 0's GPU, float32: tiny Llama (GQA), Qwen2 (q/k/v biases) and Qwen3 (tied head,
   vocabulary not divisible by N) models with no drafter, a model drafter and the n-gram
   drafter; and the Llama-3-8B shape (random weights) with no drafter and the 1B-shaped drafter.
2. **distribution** (N > 1): a tiny target with a 16-token vocabulary, ``--samples`` rows in one
   batch, temperature ≠ 1 with top-k/top-p, χ² of the first three tokens against the exact law
   enumerated with transformers' logits warpers on the whole model (as tests/test_distribution.py).
3. **throughput**: Llama-3-8B-shaped target (bfloat16, random weights) at batch 1, target-only
   and speculative with a replicated Llama-3.2-1B-shaped drafter, ``torch.compile`` on unless
   ``--no-compile``. With N > 1 and ``OUT/tp1.json`` present, the outputs are compared with the
   one-GPU run's (bfloat16: they may drift at near-ties, since partial sums are reduced in
   another order).

Every rank checks that all ranks produced the same tokens. NVLink multicast stays off:
``NCCL_NVLS_ENABLE=0`` (and PyTorch's and NVSHMEM's switches) are set before NCCL starts.
``--smoke`` runs everything on tiny shapes, on the CPU with gloo when there is no GPU.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

# Multicast off before anything can start NCCL: a program using it can take the host's shared
# GPUs out of service (the machines' notes). Set unconditionally, not as defaults.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

from ..engine import SpeculativeEngine  # noqa: E402
from ..models.parallel import (  # noqa: E402
    TensorParallel,
    check_shardable,
    init_tensor_parallel,
    local_device,
    shard_model,
)
from ..tuning.timing import forward_seconds, synchronize  # noqa: E402
from .gpu import SHAPES, kv_bytes_per_token, weight_bytes_per_token  # noqa: E402
from .results import write_results  # noqa: E402

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.2)
TINY_CASES = {  # name: (transformers config class, extra fields)
    "llama": ("LlamaConfig", dict(vocab_size=128)),
    "qwen2": ("Qwen2Config", dict(vocab_size=128, use_sliding_window=False, sliding_window=None)),
    "qwen3-tied": ("Qwen3Config", dict(vocab_size=127, head_dim=8, use_sliding_window=False, sliding_window=None,
                                       tie_word_embeddings=True)),
}
SMOKE_SHAPES = {  # stand-ins for the 8B/1B shapes in --smoke runs
    "llama3-8b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=1024),
    "llama3-1b": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024, tie_word_embeddings=True),
}
PROMPTS = [[11], [5, 9, 17], [3, 8, 3, 8, 3, 8, 3], [40, 41, 42, 43, 40, 41, 42, 43, 40, 41]]
DIST_VOCAB = 16
DIST_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so the n-gram drafter finds matches
DIST_CASES = [  # drafter, temperature, top_k, top_p, γ
    ("model", 0.8, 8, 0.9, 3),
    ("none", 1.3, 0, 0.8, 1),
    ("ngram", 0.7, 6, 1.0, 3),
]
ALPHA = 1e-3


@dataclass(frozen=True)
class TPOptions:
    """What a run does (``flashspec bench tp``'s flags); recorded as the JSON's ``settings``."""

    out: str = "bench-results/tp"  # folder for tp{N}.json (rank 0 writes)
    compile: bool = True  # torch.compile the decode forwards in the throughput section
    max_new_tokens: int = 128
    prompt_tokens: int = 128
    prompts: int = 2
    gamma: int = 4
    samples: int = 20_000  # rows of the distribution test
    skip_equality: bool = False
    skip_distribution: bool = False
    skip_throughput: bool = False
    smoke: bool = False  # tiny stand-in shapes (runs on CPUs with gloo)

    def __post_init__(self) -> None:
        if self.samples < 10_000 and not self.smoke:
            raise ValueError("--samples must be at least 10,000 (the distribution test's design, SPEC.md §6).")


# ------------------------------------------------------------------------------------ helpers
def _build(config_class: str, fields: dict[str, Any], device: torch.device | str, dtype: torch.dtype, seed: int):
    """A random-weight causal LM built directly on ``device`` (the same weights on every rank:
    same seed, same kernels)."""
    import transformers

    config = getattr(transformers, config_class)(**fields, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _shaped(name: str, device: torch.device, dtype: torch.dtype, seed: int, smoke: bool):
    shape = dict((SMOKE_SHAPES if smoke else SHAPES)[name])
    kind = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[shape.pop("model_type", "llama")]
    return _build(kind, shape, device, dtype, seed)


def _noisy(model, noise: float, seed: int):
    """A perturbed copy: a drafter that agrees with the target often, not always."""
    clone = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * noise * float(p.std())).to(p.device, p.dtype))
    return clone


def _same_everywhere(value: Any) -> bool:
    """Whether every rank holds the same (JSON-able) ``value``."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def _weights_agree(model) -> bool:
    """Whether every rank built the same weights (a float64 checksum of every parameter)."""
    total = sum(float(p.detach().double().sum()) * (i + 1) for i, p in enumerate(model.parameters()))
    return _same_everywhere(total)


def _free(device: torch.device) -> None:
    """Hand cached GPU memory back after a section's models are gone."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _drift(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many outputs differ, and where each first difference falls."""
    firsts = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), None) for u, v in zip(a, b)]
    firsts = [f if f is not None or len(u) == len(v) else min(len(u), len(v)) for f, u, v in zip(firsts, a, b)]
    differing = [f for f in firsts if f is not None]
    return {"outputs": len(a), "differing": len(differing), "first_difference": differing}


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's χ² p-value of counts against a law; cells with expected count < 5 pooled
    (as tests/stats_helpers.py; the survival function via the regularised incomplete gamma)."""
    observed, probs = observed.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        return 1.0
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


# ----------------------------------------------------------------------------------- sections
def equality_tiny(tp: TensorParallel, device: torch.device) -> dict[str, Any]:
    """Greedy float32 tokens: sharded target vs the whole target in one process (rank 0)."""
    out: dict[str, Any] = {}
    for name, (config_class, extra) in TINY_CASES.items():
        fields = {**TINY, **extra}
        try:
            check_shardable(SimpleNamespace(**fields), tp.world_size)
        except ValueError as error:
            out[name] = {"skipped": str(error)}
            continue
        whole = _build(config_class, fields, "cpu", torch.float32, seed=len(name))  # CPU: identical everywhere
        drafters = {"none": [], "model": [_noisy(whole, 0.05, seed=100).to(device)], "ngram": ["ngram"]}
        reference = copy.deepcopy(whole).to(device) if tp.rank == 0 else None
        model = shard_model(whole).to(device)
        case: dict[str, Any] = {}
        for kind, drafter in drafters.items():
            kwargs = dict(max_new_tokens=24, num_draft_tokens=3, eos_token_id=[])
            got = SpeculativeEngine(model, drafter, selector="fixed", device=device).generate(PROMPTS, **kwargs).sequences
            row: dict[str, Any] = {"ranks_agree": _same_everywhere(got)}
            if reference is not None:
                expected = SpeculativeEngine(reference, drafter, selector="fixed", device=device).generate(PROMPTS, **kwargs).sequences
                row["equal_to_one_process"] = got == expected
                row["drift"] = _drift(got, expected)
            case[kind] = row
        out[name] = case
        del model, reference, drafters
        dist.barrier()
    return out


def equality_shaped(tp: TensorParallel, device: torch.device, smoke: bool, new_tokens: int = 32) -> dict[str, Any]:
    """Greedy float32 tokens of the 8B-shaped target, sharded vs whole (rank 0), target-only and
    with the 1B-shaped drafter. Rank 0 decodes with the whole model first, then every rank
    shards the same weights."""
    target = _shaped("llama3-8b", device, torch.float32, seed=0, smoke=smoke)
    drafter = _shaped("llama3-1b", device, torch.float32, seed=1, smoke=smoke)
    result: dict[str, Any] = {"weights_agree": _weights_agree(target) and _weights_agree(drafter)}
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    kwargs = dict(max_new_tokens=new_tokens, num_draft_tokens=4, eos_token_id=[])
    expected: dict[str, list[int]] = {}
    if tp.rank == 0:
        for kind, drafters in (("none", []), ("model", [drafter])):
            engine = SpeculativeEngine(target, drafters, selector="fixed", device=device)
            expected[kind] = engine.generate([prompt], **kwargs).sequences[0]
            del engine
        _free(device)
    dist.barrier()
    shard_model(target)
    for kind, drafters in (("none", []), ("model", [drafter])):
        got = SpeculativeEngine(target, drafters, selector="fixed", device=device).generate([prompt], **kwargs).sequences[0]
        row: dict[str, Any] = {"ranks_agree": _same_everywhere(got)}
        if tp.rank == 0:
            row["equal_to_one_process"] = got == expected[kind]
            row["drift"] = _drift([got], [expected[kind]])
        result[kind] = row
    del target, drafter
    _free(device)
    return result


def _exact_law(model, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """P(x1, x2, x3) after ``DIST_PROMPT`` for every continuation, ``[V, V, V]``, by enumeration
    with transformers' own logits warpers (not FlashSpec's sampling code)."""
    from transformers import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    V = DIST_VOCAB
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))
    ids = torch.cat([torch.tensor(DIST_PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[:, -3:].float()

    def law(z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(warpers(None, z), dim=-1).double()

    p1 = law(logits[:1, 0])[0]
    p2 = law(logits[:, 1]).view(V, V, V)[:, 0]
    p3 = law(logits[:, 2]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def distribution(tp: TensorParallel, device: torch.device, samples: int) -> dict[str, Any]:
    """χ² of the sharded engine's samples against the exact law (float32, one batch per case)."""
    fields = {**TINY, "vocab_size": DIST_VOCAB, "max_position_embeddings": 64, "initializer_range": 0.02}
    try:
        check_shardable(SimpleNamespace(**fields), tp.world_size)
    except ValueError as error:
        return {"skipped": str(error), "cases": [], "passed": None}
    whole = _build("LlamaConfig", fields, "cpu", torch.float32, seed=0)
    with torch.no_grad():  # larger logits than the default init: laws far from uniform
        whole.lm_head.weight.mul_(8.0)
    laws = {case: _exact_law(whole, *case[1:4]) for case in DIST_CASES}
    power_law = _exact_law(whole, 1.0, 0, 1.0)
    drafter = _noisy(whole, 1.0, seed=7).to(device)
    model = shard_model(whole).to(device)
    rows = []
    for case in DIST_CASES:
        kind, temperature, top_k, top_p, gamma = case
        drafters = {"model": [drafter], "ngram": ["ngram"], "none": []}[kind]
        engine = SpeculativeEngine(model, drafters, selector="fixed", device=device)
        started = time.perf_counter()
        out = engine.generate([DIST_PROMPT] * samples, max_new_tokens=4, do_sample=True, temperature=temperature,
                              top_k=top_k, top_p=top_p, num_draft_tokens=gamma, eos_token_id=[], seed=1234)
        seconds = time.perf_counter() - started
        first3 = torch.tensor([s[:3] for s in out.sequences])
        cells = (first3[:, 0] * DIST_VOCAB + first3[:, 1]) * DIST_VOCAB + first3[:, 2]
        counts = torch.bincount(cells, minlength=DIST_VOCAB**3)
        row = {
            "drafter": kind, "temperature": temperature, "top_k": top_k, "top_p": top_p, "gamma": gamma,
            "samples": samples, "seconds": seconds, "acceptance_rate": out.stats.acceptance_rate,
            "pvalue": chi2_pvalue(counts, laws[case]),
            "pvalue_against_T1_law": chi2_pvalue(counts, power_law),  # power: should be tiny
            "ranks_agree": _same_everywhere(counts.tolist()),
        }
        row["passed"] = row["pvalue"] > ALPHA and row["ranks_agree"]
        rows.append(row)
    return {"alpha": ALPHA, "vocab": DIST_VOCAB, "cases": rows, "passed": all(r["passed"] for r in rows)}


def _decode(engine: SpeculativeEngine, prompts: list[list[int]], new_tokens: int, gamma: int,
            device: torch.device) -> dict[str, Any]:
    """Each prompt alone (batch 1): tokens/s of the decode steps and of the whole call."""
    decode_rates, total_rates, outputs, accepted, proposed, steps = [], [], [], 0, 0, 0
    for prompt in prompts:
        synchronize(device)
        out = engine.generate([prompt], max_new_tokens=new_tokens, num_draft_tokens=gamma, eos_token_id=[])
        s = out.stats
        decode_rates.append(s.decode_tokens / s.decode_seconds)
        total_rates.append(s.new_tokens / s.seconds)
        outputs.append(out.sequences[0])
        accepted, proposed, steps = accepted + s.accepted, proposed + s.proposed, steps + s.steps
    return {
        "tokens_per_second_median": statistics.median(decode_rates),
        "tokens_per_second_all": decode_rates,
        "end_to_end_tokens_per_second_median": statistics.median(total_rates),
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_tokens_per_step": sum(len(o) - 1 for o in outputs) / steps if steps else None,
        "outputs": outputs,
    }


def throughput(tp: TensorParallel, device: torch.device, options: TPOptions) -> dict[str, Any]:
    """Tokens/s at batch 1 of the 8B-shaped target (bfloat16), target-only and speculative."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = _shaped("llama3-8b", device, dtype, seed=0, smoke=options.smoke)
    drafter = _shaped("llama3-1b", device, dtype, seed=1, smoke=options.smoke)
    result: dict[str, Any] = {
        "target": "llama3-8b", "drafter": "llama3-1b (replicated)", "dtype": str(dtype).replace("torch.", ""),
        "compile": options.compile, "gamma": options.gamma, "max_new_tokens": options.max_new_tokens,
        "prompt_tokens": options.prompt_tokens, "prompts": options.prompts,
        "weights_agree": _weights_agree(target) and _weights_agree(drafter),
        "note": "random weights: acceptance is meaningless; forward and step costs are real",
    }
    shard_model(target)
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (options.prompt_tokens,), generator=gen).tolist()
               for _ in range(options.prompts)]
    engines = {
        "target_only": SpeculativeEngine(target, [], device=device, compile=options.compile),
        "speculative": SpeculativeEngine(target, [drafter], selector="fixed", device=device, compile=options.compile),
    }
    started = time.perf_counter()
    for engine in engines.values():  # compile and capture outside the timings
        engine.generate([prompts[0]], max_new_tokens=options.max_new_tokens, num_draft_tokens=options.gamma,
                        eos_token_id=[])
    synchronize(device)
    result["warmup_seconds"] = time.perf_counter() - started
    for name, engine in engines.items():
        result[name] = _decode(engine, prompts, options.max_new_tokens, options.gamma, device)
        result[name]["ranks_agree"] = _same_everywhere(result[name]["outputs"])
    result["speedup"] = (result["speculative"]["tokens_per_second_median"]
                         / result["target_only"]["tokens_per_second_median"])
    result["greedy_drift_speculative_vs_target_only"] = _drift(result["speculative"]["outputs"],
                                                               result["target_only"]["outputs"])
    context = options.prompt_tokens + options.max_new_tokens // 2
    weights = weight_bytes_per_token(target)  # this rank's shard (+ replicated norms)
    kv = kv_bytes_per_token(target, context) / tp.world_size
    result["bytes_per_token_per_gpu"] = {"weights": weights, "kv_at_mean_context": kv}
    if device.type == "cuda":
        from .kernels import measure_copy_bandwidth

        bandwidth = measure_copy_bandwidth(device)
        lm = engines["target_only"]._target_lm
        result["copy_bandwidth_bytes_per_second"] = bandwidth
        result["roofline_tokens_per_second"] = bandwidth / (weights + kv)  # collectives not counted
        result["forward_seconds"] = {"target_1": forward_seconds(lm, 1, 1, context),
                                     f"target_{options.gamma + 1}": forward_seconds(lm, 1, options.gamma + 1, context)}
    return result


# ---------------------------------------------------------------------------------- the run
def run(options: TPOptions) -> dict[str, Any]:
    """The sections of the module docstring that ``options`` ask for, in this process's rank;
    rank 0 writes ``OUT/tp{N}.json`` after each section and prints the summary at the end."""
    os.environ.update(MULTICAST_OFF)
    tp = init_tensor_parallel()
    device = local_device()
    out_dir = Path(options.out)
    results: dict[str, Any] = {
        "world_size": tp.world_size,
        "machine": {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "backend": str(dist.get_backend()), "torch": torch.__version__, "platform": platform.platform(),
                    "created": time.strftime("%Y-%m-%d %H:%M:%S"), "multicast": dict(MULTICAST_OFF)},
        "settings": asdict(options),
    }
    path = out_dir / f"tp{tp.world_size}.json"

    def save() -> None:
        if tp.rank == 0:
            write_results(path, results)

    def section(name: str, fn: Any) -> None:
        started = time.perf_counter()
        if tp.rank == 0:
            print(f"[{tp.world_size} GPU(s)] {name} ...", flush=True)
        results[name] = fn()
        results[name + "_seconds"] = time.perf_counter() - started
        save()
        if tp.rank == 0:
            print(f"[{tp.world_size} GPU(s)] {name} done in {results[name + '_seconds']:.0f} s", flush=True)

    if tp.world_size > 1 and not options.skip_equality:
        section("equality_tiny", lambda: equality_tiny(tp, device))
        section("equality_8b_float32", lambda: equality_shaped(tp, device, options.smoke))
    if tp.world_size > 1 and not options.skip_distribution:
        section("distribution", lambda: distribution(tp, device, options.samples))
    if not options.skip_throughput:
        section("throughput", lambda: throughput(tp, device, options))
        single = out_dir / "tp1.json"
        if tp.world_size > 1 and single.exists():
            one = json.loads(single.read_text()).get("throughput", {})
            results["throughput"]["drift_vs_one_gpu"] = {
                name: _drift(results["throughput"][name]["outputs"], one[name]["outputs"])
                for name in ("target_only", "speculative") if name in one
            }
    save()
    if tp.rank == 0:
        print(summarize_runs([results]), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return results


# ---------------------------------------------------------------------------------- summary
def _ok(flag: Any) -> str:
    return "—" if flag is None else ("yes" if flag else "**NO**")


def _equality_flag(results: dict[str, Any]) -> bool | None:
    rows = []
    for section in ("equality_tiny", "equality_8b_float32"):
        for case in results.get(section, {}).values():
            if isinstance(case, dict) and "skipped" not in case:
                rows += [r for r in case.values() if isinstance(r, dict)]
    if not rows:
        return None
    return all(r.get("equal_to_one_process", True) and r.get("ranks_agree", True) for r in rows)


def summarize_runs(runs: list[dict[str, Any]]) -> str:
    """A markdown table of runs at different world sizes (JSONs of :func:`run`)."""
    runs = sorted(runs, key=lambda r: r["world_size"])
    base = next((r["throughput"]["target_only"]["tokens_per_second_median"] for r in runs
                 if r["world_size"] == 1 and "throughput" in r), None)
    first = next((r for r in runs if "throughput" in r), None)
    lines = []
    if first is not None:
        t = first["throughput"]
        shapes = "Tiny stand-ins (--smoke) for the" if first["settings"].get("smoke") else "A"
        lines += [f"{shapes} Llama-3-8B-shaped target ({t['dtype']}, random weights), Llama-3.2-1B-shaped drafter replicated "
                  f"on every GPU; batch 1, {t['prompts']} prompts of {t['prompt_tokens']} tokens, "
                  f"{t['max_new_tokens']} new tokens, γ = {t['gamma']}, compile = {t['compile']}; "
                  f"{first['machine']['gpu']}, torch {first['machine']['torch']}.", ""]
    lines += ["| GPUs | target-only tok/s | × 1 GPU | speculative tok/s | speedup | target 1-token forward | "
              "roofline tok/s | greedy TP = 1 process (fp32) | χ² p-values (α = 1e-3) | ranks agree |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        t = r.get("throughput")
        agree = [case.get("ranks_agree") for case in (t or {}).values()
                 if isinstance(case, dict) and "ranks_agree" in case]
        dist_cases = r.get("distribution", {}).get("cases", [])
        agree += [c["ranks_agree"] for c in dist_cases]
        pvalues = ", ".join(f"{c['pvalue']:.3f}" for c in dist_cases) or "—"
        if t is None:
            cells = ["—"] * 6
        else:
            base_rate = t["target_only"]["tokens_per_second_median"]
            fwd = t.get("forward_seconds", {}).get("target_1")
            roof = t.get("roofline_tokens_per_second")
            cells = [f"{base_rate:.0f}", f"{base_rate / base:.2f}×" if base else "—",
                     f"{t['speculative']['tokens_per_second_median']:.0f}", f"{t['speedup']:.2f}×",
                     f"{fwd * 1e3:.2f} ms" if fwd else "—", f"{roof:.0f}" if roof else "—"]
        lines.append(f"| {r['world_size']} | " + " | ".join(cells) + f" | {_ok(_equality_flag(r))} | {pvalues} | "
                     f"{_ok(all(agree) if agree else None)} |")
    for r in runs:
        drift = (r.get("throughput") or {}).get("drift_vs_one_gpu")
        if drift:
            text = "; ".join(f"{k}: {v['differing']}/{v['outputs']} differ" for k, v in drift.items())
            lines.append(f"\n{r['throughput']['dtype']} greedy outputs at {r['world_size']} GPUs vs 1 GPU: {text} "
                         "(partial sums reduced in another order; see SPEC.md §9).")
    return "\n".join(lines)


def summarize(out_dir: Path) -> str:
    """Read every ``tp*.json`` in ``out_dir``, write ``tp.md`` beside them, return the table."""
    runs = [json.loads(p.read_text()) for p in sorted(out_dir.glob("tp[0-9]*.json"))]
    if not runs:
        raise ValueError(f"No tp*.json results in {out_dir}.")
    text = summarize_runs(runs)
    write_results(out_dir / "tp.md", markdown=text)
    return text
