"""``flashspec bench ...``: one parser and one function per benchmark.

Every option is checked before any model is loaded (minutes on a CPU): a bad value is a
``ValueError`` that :func:`flashspec.cli.main` prints as an error.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..models import DTYPES

__all__ = ["add_parsers"]


def add_parsers(sub: Any) -> None:
    """Add ``bench`` and its sub-commands to the ``flashspec`` parser's sub-parsers ``sub``."""
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)

    core = bench_sub.add_parser("core", help="speculative vs target-only on held-out corpus prompts")
    core.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    core.add_argument("--draft", default=None, help="default: the demo's 0.5B drafter")
    core.add_argument("--tokenizer", default=None)
    core.add_argument("--corpus", default="../shared/corpus")
    core.add_argument("--prompts-per-domain", type=int, default=3)
    core.add_argument("--prompt-tokens", type=int, default=128)
    core.add_argument("--max-new-tokens", type=int, default=64)
    core.add_argument("--num-draft-tokens", type=int, default=4)
    core.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 means greedy")
    core.add_argument("--device", default=None)
    core.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    core.add_argument("--out", default="benchmarks/results/core_cpu.json")
    core.set_defaults(run=bench_core)

    fwd = bench_sub.add_parser("forward", help="cost of one cached forward by model, dtype and token count")
    fwd.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    fwd.add_argument("--draft", default=None, help="default: the demo's 0.5B drafter")
    fwd.add_argument("--dtypes", default="float32,bfloat16")
    fwd.add_argument("--device", default="cpu")
    fwd.add_argument("--out", default="benchmarks/results/forward_cpu.json")
    fwd.set_defaults(run=bench_forward)

    band = bench_sub.add_parser("bandit", help="regret of the drafter selectors on simulated Bernoulli arms")
    band.add_argument("--steps", type=int, default=10_000, help="horizon T")
    band.add_argument("--arms", type=int, default=3, help="number of arms K")
    band.add_argument("--seeds", type=int, default=20, help="runs per selector and scenario")
    band.add_argument("--json", dest="json_path", default="benchmarks/results/bandit.json")
    band.add_argument("--plot", default="benchmarks/results/bandit.png", help="regret curves (PNG)")
    band.add_argument("--no-progress", action="store_true")
    band.set_defaults(run=bench_bandit)

    sel = bench_sub.add_parser("select", help="bandit vs every fixed (drafter, γ) arm on a mixed real workload")
    sel.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    sel.add_argument("--draft", action="append", default=None,
                     help="a drafter (repeatable; 'ngram' for prompt lookup; 'store:code' for retrieval from "
                          "the training part of a corpus domain); default: the demo's 0.5B and ngram")
    sel.add_argument("--gammas", default="2,4", help="comma-separated draft lengths; arms = drafters × gammas")
    sel.add_argument("--selectors", default="thompson,ucb1", help="comma-separated bandits to compare")
    sel.add_argument("--tokenizer", default=None)
    sel.add_argument("--corpus", default="../shared/corpus")
    sel.add_argument("--prompts-per-domain", type=int, default=4)
    sel.add_argument("--prompt-tokens", type=int, default=128)
    sel.add_argument("--max-new-tokens", type=int, default=64)
    sel.add_argument("--temperature", type=float, default=0.0)
    sel.add_argument("--device", default=None)
    sel.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    sel.add_argument("--warm-start-prompts", type=int, default=0,
                     help="also run each bandit warm-started on this many training-text prompts per domain")
    sel.add_argument("--compile", action="store_true", help="torch.compile the decode forwards (worth it on a GPU)")
    sel.add_argument("--out", default="benchmarks/results/select_cpu.json")
    sel.set_defaults(run=bench_select)

    gpu = bench_sub.add_parser("gpu", help="verify kernels, roofline and speculative step anatomy on a CUDA GPU")
    gpu.add_argument("--target", default=None, help="a real target (folder, hub id or .gguf); omit to skip")
    gpu.add_argument("--draft", default=None, help="its drafter")
    gpu.add_argument("--corpus", default="../shared/corpus", help="folder with the three-domain corpus")
    gpu.add_argument("--shaped", default="llama3-8b", help="comma-separated random-weight shapes ('' for none)")
    gpu.add_argument("--no-kernels", action="store_true", help="skip the verify-kernel table")
    gpu.add_argument("--no-compile", action="store_true", help="decode without torch.compile")
    gpu.add_argument("--prompts-per-domain", type=int, default=4)
    gpu.add_argument("--prompt-tokens", type=int, default=256)
    gpu.add_argument("--max-new-tokens", type=int, default=256)
    gpu.add_argument("--num-draft-tokens", type=int, default=4)
    gpu.add_argument("--out", default="benchmarks/results/gpu_h200")
    gpu.set_defaults(run=bench_gpu)

    e2e = bench_sub.add_parser("e2e", help="FlashSpec beside transformers' generate / assisted / prompt lookup, "
                                           "same prompts, one run")
    e2e.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    e2e.add_argument("--draft", action="append", default=None,
                     help="a drafter (repeatable; 'ngram' for prompt lookup; 'store:code' for retrieval from the "
                          "training part of a corpus domain); default: the demo's 0.5B and ngram")
    e2e.add_argument("--tokenizer", default=None, help="default: the target's")
    e2e.add_argument("--corpus", default="../shared/corpus")
    e2e.add_argument("--prompts-per-domain", type=int, default=20)
    e2e.add_argument("--regimes", default="long,short", help="comma-separated: long (256-512 prompt tokens, 256 new), "
                                                             "short (32 prompt tokens, 20 new)")
    e2e.add_argument("--batch-sizes", default="1", help="comma-separated")
    e2e.add_argument("--systems", default=None,
                     help="comma-separated subset of: hf, hf-static, hf-assisted, hf-lookup, flashspec, "
                          "flashspec-fixed, flashspec-bandit (default all)")
    e2e.add_argument("--hf-prompts-per-domain", type=int, default=None,
                     help="run transformers' systems on only the first N batches of each domain (they are "
                          "10-40x slower on a GPU); paired ratios use the batches both ran. Default: all")
    e2e.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    e2e.add_argument("--gammas", default="2,4", help="comma-separated draft lengths of the FlashSpec arms")
    e2e.add_argument("--seed", type=int, default=0)
    e2e.add_argument("--device", default=None)
    e2e.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    e2e.add_argument("--compile", action="store_true", help="torch.compile FlashSpec's decode forwards (GPU)")
    e2e.add_argument("--shaped", action="store_true",
                     help="random-weight Llama-3-8B-shaped target, Llama-3.2-1B-shaped drafter and ngram, random "
                          "prompts: step costs only (acceptance is meaningless)")
    e2e.add_argument("--out", default="benchmarks/results/e2e", help="folder for e2e.json, e2e.md and the PNGs")
    e2e.add_argument("--no-progress", action="store_true")
    e2e.add_argument("--rewrite-report", metavar="DIR", default=None,
                     help="decode nothing: recompute the tables and plots of a previous run's DIR/e2e.json")
    e2e.set_defaults(run=bench_e2e)

    tp = bench_sub.add_parser("tp", help="tensor parallelism: equality, distribution and throughput checks; "
                                         "one process per GPU: torchrun --nproc-per-node N -m flashspec bench tp")
    tp.add_argument("--out", default="benchmarks/results/tp", help="folder for tp{N}.json (rank 0 writes)")
    tp.add_argument("--summarize", metavar="DIR", default=None,
                    help="run nothing: write DIR/tp.md from the tp*.json of earlier runs and print it")
    tp.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile the decode forwards in the throughput section (default on)")
    tp.add_argument("--max-new-tokens", type=int, default=128)
    tp.add_argument("--prompt-tokens", type=int, default=128)
    tp.add_argument("--prompts", type=int, default=2)
    tp.add_argument("--gamma", type=int, default=4)
    tp.add_argument("--samples", type=int, default=20_000, help="rows of the distribution test")
    tp.add_argument("--skip-equality", action="store_true")
    tp.add_argument("--skip-distribution", action="store_true")
    tp.add_argument("--skip-throughput", action="store_true")
    tp.add_argument("--smoke", action="store_true", help="tiny stand-in shapes (runs on CPUs with gloo)")
    tp.set_defaults(run=bench_tp)


# ----------------------------------------------------------------------------- helpers
def _engine(target: str, drafts: list[str], tokenizer: str | None, device: str | None, dtype: str | None,
            **options: Any) -> Any:
    from ..engine import SpeculativeEngine

    return SpeculativeEngine(target, drafts, tokenizer=tokenizer, device=device,
                             dtype=DTYPES[dtype] if dtype else None, **options)


def _demo_target() -> str:
    from ..demo import DEMO_TARGET, fetch_demo_model

    return fetch_demo_model(DEMO_TARGET)


def _demo_draft() -> str:
    from ..demo import DEMO_DRAFT, fetch_demo_model

    return fetch_demo_model(DEMO_DRAFT)


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--temperatures must be comma-separated numbers; got {text!r}.") from None
    if not values or any(not t >= 0 for t in values):
        raise ValueError(f"--temperatures must be numbers >= 0 (0 means greedy); got {text!r}.")
    return values


# ----------------------------------------------------------------------------- commands
def bench_core(args: argparse.Namespace) -> None:
    """Speculative vs target-only on held-out corpus prompts (BENCHMARKS.md)."""
    from . import core

    temperatures = _temperatures(args.temperatures)
    engine = _engine(args.target or _demo_target(), [args.draft or _demo_draft()], args.tokenizer,
                     args.device, args.dtype)
    results = core.run_core(
        engine.target, engine.drafters[0], engine.tokenizer, Path(args.corpus),
        prompts_per_domain=args.prompts_per_domain, prompt_tokens=args.prompt_tokens,
        max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens, temperatures=temperatures,
    )
    core.write(results, Path(args.out))
    print(core.summarize(results))


def bench_forward(args: argparse.Namespace) -> None:
    """Cost of one cached forward by model, dtype and token count."""
    import json

    from . import core

    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"Unknown dtype {d!r}; choose from {', '.join(sorted(DTYPES))}.")
    specs = {"target": args.target or _demo_target(), "drafter": args.draft or _demo_draft()}
    results = core.run_forward_costs(specs, dtypes, device=args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    table = core.summarize_forward_costs(results)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


def bench_bandit(args: argparse.Namespace) -> None:
    """The selectors' regret on simulated arms, with a plot."""
    from . import bandit

    results = bandit.run(steps=args.steps, arms=args.arms, seeds=args.seeds, json_path=args.json_path,
                         plot_path=args.plot, progress=not args.no_progress)
    print(bandit.summarize(results))


def bench_select(args: argparse.Namespace) -> None:
    """Bandits against every fixed (drafter, γ) arm on a mixed real workload."""
    import json

    from ..select import SELECTORS
    from . import core

    try:
        gammas = [int(g) for g in args.gammas.split(",") if g.strip()]
    except ValueError:
        raise ValueError(f"--gammas must be comma-separated integers >= 1; got {args.gammas!r}.") from None
    if not gammas or min(gammas) < 1:
        raise ValueError(f"--gammas must be comma-separated integers >= 1; got {args.gammas!r}.")
    if args.warm_start_prompts < 0:
        raise ValueError(f"--warm-start-prompts must be >= 0; got {args.warm_start_prompts}.")
    selectors = [s for s in args.selectors.split(",") if s]
    for name in selectors:
        if name not in SELECTORS or name in ("fixed", "oracle"):
            raise ValueError(f"Unknown bandit {name!r} for --selectors; choose from ucb1, thompson, "
                             "discounted-ucb, sliding-window-ucb, epsilon-greedy.")
    target = args.target or _demo_target()
    drafts = args.draft or [_demo_draft(), "ngram"]
    if any(d.startswith("store:") for d in drafts):
        from ..models import load_tokenizer

        drafts = core.store_drafters(drafts, Path(args.corpus), load_tokenizer(args.tokenizer or target))
    engine = _engine(target, drafts, args.tokenizer, args.device, args.dtype, gammas=gammas, compile=args.compile)
    bandits = {}
    for name in selectors:
        bandits[f"{name} (shared)"] = {"selector": name, "options": {"seed": 0}}
        bandits[f"{name} (per domain)"] = {"selector": name, "options": {"seed": 0}, "context": "domain"}
    results = core.run_selection(
        engine, Path(args.corpus), bandits=bandits, prompts_per_domain=args.prompts_per_domain,
        prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        warm_start_prompts=args.warm_start_prompts,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    table = core.summarize_selection(results)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


def bench_gpu(args: argparse.Namespace) -> None:
    """The H200 report: verify kernels, roofline, step anatomy, drift (CUDA)."""
    from . import gpu

    shaped = tuple(s for s in args.shaped.split(",") if s)
    for name in shaped:
        if name not in gpu.SHAPES:
            raise ValueError(f"Unknown shape {name!r}; choose from {', '.join(gpu.SHAPES)}.")
    gpu.run(
        Path(args.out), target=args.target, drafter=args.draft, corpus=Path(args.corpus), shaped=shaped,
        kernels=not args.no_kernels, prompts_per_domain=args.prompts_per_domain,
        prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
        gamma=args.num_draft_tokens, compile=not args.no_compile,
    )


def bench_e2e(args: argparse.Namespace) -> None:
    """Every system side by side on the same prompts: transformers and FlashSpec."""
    from . import e2e

    if args.rewrite_report:
        for path in e2e.rewrite_report(Path(args.rewrite_report)):
            print(f"wrote {path}")
        return
    regimes = e2e.parse_regimes(args.regimes)
    batch_sizes = e2e.parse_ints(args.batch_sizes, "--batch-sizes")
    gammas = e2e.parse_ints(args.gammas, "--gammas")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    options = dict(systems=e2e.FAMILY_NAMES if systems is None else systems, batch_sizes=batch_sizes,
                   gammas=gammas, prompts_per_domain=args.prompts_per_domain, temperature=args.temperature,
                   regimes=regimes, hf_prompts_per_domain=args.hf_prompts_per_domain)
    e2e.check_options(**options)
    if args.shaped and (args.target or args.draft):
        raise ValueError("--shaped builds its own target and drafters; leave out --target and --draft.")
    drafts = [] if args.shaped else args.draft
    if drafts is None:
        drafts = [_demo_draft(), "ngram"]
    names = ["llama3-1b", "ngram"] if args.shaped else [e2e.drafter_name(d) for d in drafts]
    e2e.check_options(**options, drafters=names)
    target = args.target
    if target is None and not args.shaped:
        target = _demo_target()
    results = e2e.load_and_run(
        Path(args.out), target=target, drafts=drafts, tokenizer=args.tokenizer, corpus=Path(args.corpus),
        shaped=args.shaped, device=args.device, dtype=args.dtype, regimes=regimes,
        prompts_per_domain=args.prompts_per_domain, seed=args.seed, systems=systems,
        batch_sizes=batch_sizes, gammas=gammas, temperature=args.temperature, compile=args.compile,
        hf_prompts_per_domain=args.hf_prompts_per_domain, progress=not args.no_progress,
    )
    print(e2e.summarize(results))


def bench_tp(args: argparse.Namespace) -> None:
    """Tensor-parallel checks and timings (one process per GPU under torchrun), or their summary."""
    from . import tp

    if args.summarize:
        print(tp.summarize(Path(args.summarize)))
        return
    if args.samples < 10_000 and not args.smoke:
        raise ValueError("--samples must be at least 10,000 (the distribution test's design, SPEC.md §6).")
    tp.run(args)
