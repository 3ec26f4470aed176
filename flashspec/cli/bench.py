"""``flashspec bench ...``: one parser and one function per benchmark.

For each sub-command ``X``, ``_X_parser`` adds its options and ``bench_X`` runs it: check every
option, load the models, call its module in :mod:`flashspec.bench`, write the results
(:mod:`flashspec.bench.results`) and print the table. Every option is checked before any model
is loaded (minutes on a CPU): a bad value is a ``ValueError`` that :func:`flashspec.cli.main`
prints as an error.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..bench.workload_args import comma_gammas as _gammas
from ..bench.workload_args import comma_list as _names
from ..models.loading import DTYPES

__all__ = ["add_parsers"]


def add_parsers(sub: Any) -> None:
    """Add ``bench`` and its sub-commands to the ``flashspec`` parser's sub-parsers ``sub``."""
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for add in (_core_parser, _forward_parser, _bandit_parser, _select_parser, _gpu_parser, _e2e_parser,
                _training_parser, _tp_parser, _serve_parser):
        add(bench_sub)
    from ..bench import acceptance_args, hostile, requests, tree_anatomy  # parser and command live apart

    for module in (acceptance_args, hostile, requests, tree_anatomy):
        module.add_parser(bench_sub)


# ----------------------------------------------------------------------------- parsers
def _core_parser(sub: Any) -> None:
    p = sub.add_parser("core", help="speculative vs target-only on held-out corpus prompts")
    p.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    p.add_argument("--draft", default=None, help="default: the demo's 0.5B drafter")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--corpus", default="../shared/corpus")
    p.add_argument("--prompts-per-domain", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 means greedy")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--out", default="bench-results/core.json")
    p.set_defaults(run=bench_core)


def _forward_parser(sub: Any) -> None:
    p = sub.add_parser("forward", help="cost of one cached forward by model, dtype and token count")
    p.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    p.add_argument("--draft", default=None, help="default: the demo's 0.5B drafter")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="bench-results/forward.json")
    p.set_defaults(run=bench_forward)


def _bandit_parser(sub: Any) -> None:
    p = sub.add_parser("bandit", help="regret of the drafter selectors on simulated Bernoulli arms")
    p.add_argument("--steps", type=int, default=10_000, help="horizon T")
    p.add_argument("--arms", type=int, default=3, help="number of arms K")
    p.add_argument("--seeds", type=int, default=20, help="runs per selector and scenario")
    p.add_argument("--json", dest="json_path", default="bench-results/bandit.json")
    p.add_argument("--plot", default="bench-results/bandit.png", help="regret curves (PNG)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=bench_bandit)


def _select_parser(sub: Any) -> None:
    p = sub.add_parser("select", help="bandit vs every fixed (drafter, γ) arm on a mixed real workload")
    p.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    p.add_argument("--draft", action="append", default=None,
                   help="a drafter (repeatable; 'ngram' for prompt lookup; 'store:code' for retrieval from "
                        "the training part of a corpus domain); default: the demo's 0.5B and ngram")
    p.add_argument("--gammas", default="2,4", help="comma-separated draft lengths; arms = drafters × gammas")
    p.add_argument("--selectors", default="thompson,ucb1", help="comma-separated bandits to compare")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--corpus", default="../shared/corpus")
    p.add_argument("--prompts-per-domain", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--warm-start-prompts", type=int, default=0,
                   help="also run each bandit warm-started on this many training-text prompts per domain")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode forwards (worth it on a GPU)")
    p.add_argument("--out", default="bench-results/select.json")
    p.set_defaults(run=bench_select)


def _gpu_parser(sub: Any) -> None:
    p = sub.add_parser("gpu", help="verify kernels, roofline and speculative step anatomy on a CUDA GPU")
    p.add_argument("--target", default=None, help="a real target (folder, hub id or .gguf); omit to skip")
    p.add_argument("--draft", default=None, help="its drafter: a model, or early-exit:N, feature:DIR, shallow:DIR")
    p.add_argument("--corpus", default="../shared/corpus", help="folder with the three-domain corpus")
    p.add_argument("--shaped", default="llama3-8b", help="comma-separated random-weight shapes ('' for none)")
    p.add_argument("--no-kernels", action="store_true", help="skip the verify-kernel table")
    p.add_argument("--no-maps", action="store_true",
                   help="skip the real target's forward timed per set of decode-linear maps (one capture per set)")
    p.add_argument("--no-hf", action="store_true", help="skip timing transformers' eager generate on the real target")
    p.add_argument("--no-compile", action="store_true", help="decode without torch.compile")
    p.add_argument("--prompts-per-domain", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--out", default="bench-results/gpu")
    p.set_defaults(run=bench_gpu)


def _e2e_parser(sub: Any) -> None:
    p = sub.add_parser("e2e", help="FlashSpec beside transformers' generate / assisted / prompt lookup, "
                                   "same prompts, one run")
    p.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    p.add_argument("--draft", action="append", default=None,
                   help="a drafter (repeatable; 'ngram' for prompt lookup; 'store:code' for retrieval from the "
                        "training part of a corpus domain); default: the demo's 0.5B and ngram")
    p.add_argument("--tokenizer", default=None, help="default: the target's")
    p.add_argument("--corpus", default="../shared/corpus")
    p.add_argument("--prompts-per-domain", type=int, default=20)
    p.add_argument("--style", default="text", choices=["text", "chat"],
                   help="text: continuations of held-out corpus text (default); chat: chat-formatted requests "
                        "(a held-out snippet in a user instruction, the tokenizer's chat template), kept whole: "
                        "the regimes' prompt lengths do not apply, their new tokens do")
    p.add_argument("--snippet-tokens", type=int, default=192, help="--style chat: the corpus snippet's length")
    p.add_argument("--regimes", default="long,short", help="comma-separated: long (256-512 prompt tokens, 256 new), "
                                                           "short (32 prompt tokens, 20 new)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated")
    p.add_argument("--systems", default=None,
                   help="comma-separated subset of: hf, hf-static, hf-assisted, hf-lookup, flashspec, "
                        "flashspec-fixed, flashspec-bandit, flashspec-auto (default: these), flashspec-exact, "
                        "flashspec-fixed-exact (bit-exact mode, SPEC.md §14: a CUDA GPU; named only)")
    p.add_argument("--hf-prompts-per-domain", type=int, default=None,
                   help="run transformers' systems on only the first N batches of each domain (they are "
                        "10-40x slower on a GPU); paired ratios use the batches both ran. Default: all")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    p.add_argument("--gammas", default="2,4", help="comma-separated draft lengths of the FlashSpec arms")
    p.add_argument("--auto-slacks", default=None,
                   help="comma-separated δ values of the never-slower guard, one flashspec-auto system each, side "
                        "by side ('default' for the engine's default, 0.01); default: that one system")
    p.add_argument("--auto-selectors", default=None,
                   help="comma-separated selectors behind the never-slower guard, one flashspec-auto system per "
                        "(selector, δ), side by side ('default' for auto's own, thompson; e.g. default,request)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--compile", action="store_true", help="torch.compile FlashSpec's decode forwards (GPU)")
    p.add_argument("--shaped", action="store_true",
                   help="random-weight Llama-3-8B-shaped target, Llama-3.2-1B-shaped drafter and ngram, random "
                        "prompts: step costs only (acceptance is meaningless)")
    p.add_argument("--out", default="bench-results/e2e", help="folder for e2e.json, e2e.md and the PNGs")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--rewrite-report", metavar="DIR", default=None,
                   help="decode nothing: recompute the tables and plots of a previous run's DIR/e2e.json")
    p.set_defaults(run=bench_e2e)


def _training_parser(sub: Any) -> None:
    p = sub.add_parser("training", help="what each trained drafter cost and reached, from its checkpoint's own "
                                        "training record (a table and the learning curves)")
    p.add_argument("checkpoints", nargs="+", help="checkpoint folders of train-drafter, or copies of their drafter.json")
    p.add_argument("--out", default=None, help="folder for training.json, training.md and training.png")
    p.set_defaults(run=bench_training)


def _tp_parser(sub: Any) -> None:
    p = sub.add_parser("tp", help="tensor parallelism: equality, distribution and throughput checks; "
                                  "one process per GPU: torchrun --nproc-per-node N -m flashspec bench tp")
    p.add_argument("--out", default="bench-results/tp", help="folder for tp{N}.json (rank 0 writes)")
    p.add_argument("--summarize", metavar="DIR", default=None,
                   help="run nothing: write DIR/tp.md from the tp*.json of earlier runs and print it")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the decode forwards in the throughput section (default on)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--samples", type=int, default=20_000, help="rows of the distribution test")
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--skip-distribution", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny stand-in shapes (runs on CPUs with gloo)")
    p.set_defaults(run=bench_tp)


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="load test of flashspec serve on loopback: concurrent streaming clients, "
                                     "a burst past the queue, TTFT of new prompt lengths (SPEC.md §12)")
    p.add_argument("--target", required=True, help="folder, hub id or .gguf file")
    p.add_argument("--draft", action="append", default=None, help="a drafter (repeatable); default: ngram")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--corpus", default="../shared/corpus", help="prompts from its held-out text (else a word list)")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=256, help="requests of the load phase")
    p.add_argument("--sequential", type=int, default=32, help="the first K of them again, one at a time")
    p.add_argument("--min-tokens", type=int, default=8, help="max_tokens of a request: from here ...")
    p.add_argument("--max-tokens", type=int, default=32, help="... to here")
    p.add_argument("--prompt-lengths", default="16,32,64,128,200", help="comma-separated prompt token counts")
    p.add_argument("--max-batch", type=int, default=8, help="the server's batch slots")
    p.add_argument("--max-length", type=int, default=512, help="the server's prompt + max_tokens limit")
    p.add_argument("--max-queue", type=int, default=16, help="the burst server's queue (the load server's: --clients)")
    p.add_argument("--burst", type=int, default=64, help="non-streaming requests sent at once to the burst server")
    p.add_argument("--ttft-lengths", default="16,64,200", help="prompt lengths of the first-vs-warm TTFT check")
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--ttft-tokens", type=int, default=16, help="max_tokens of the TTFT requests")
    p.add_argument("--reference-batch", type=int, default=8, help="greedy prompts per offline generate call")
    p.add_argument("--num-draft-tokens", "--gamma", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on the whole run (no request starts later)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: the server's (float32 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode forwards (GPU); each server warms up every compiled shape at start")
    p.add_argument("--out", default="bench-results/serve", help="folder for serve.json and serve.md")
    p.set_defaults(run=bench_serve)


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
        values = tuple(float(t) for t in _names(text))
    except ValueError:
        raise ValueError(f"--temperatures must be comma-separated numbers; got {text!r}.") from None
    if not values or any(not t >= 0 for t in values):
        raise ValueError(f"--temperatures must be numbers >= 0 (0 means greedy); got {text!r}.")
    return values


def _dtypes(text: str) -> tuple[str, ...]:
    dtypes = tuple(_names(text))
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"Unknown dtype {d!r}; choose from {', '.join(sorted(DTYPES))}.")
    return dtypes


def _report(out: str, results: dict[str, Any], table: str) -> None:
    """Write ``results`` to ``out`` (JSON) and ``table`` beside it (``.md``); print the table."""
    from ..bench.results import write_results

    write_results(Path(out), results, table)
    print(table)


# ----------------------------------------------------------------------------- commands
def bench_core(args: argparse.Namespace) -> None:
    """Speculative vs target-only on held-out corpus prompts (BENCHMARKS.md)."""
    from ..bench import core

    temperatures = _temperatures(args.temperatures)
    engine = _engine(args.target or _demo_target(), [args.draft or _demo_draft()], args.tokenizer,
                     args.device, args.dtype)
    results = core.run_core(
        engine.target, engine.drafters[0], engine.tokenizer, Path(args.corpus),
        prompts_per_domain=args.prompts_per_domain, prompt_tokens=args.prompt_tokens,
        max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens, temperatures=temperatures,
    )
    _report(args.out, results, core.summarize(results))


def bench_forward(args: argparse.Namespace) -> None:
    """Cost of one cached forward by model, dtype and token count."""
    from ..bench import core

    dtypes = _dtypes(args.dtypes)
    specs = {"target": args.target or _demo_target(), "drafter": args.draft or _demo_draft()}
    results = core.run_forward_costs(specs, dtypes, device=args.device)
    _report(args.out, results, core.summarize_forward_costs(results))


def bench_bandit(args: argparse.Namespace) -> None:
    """The selectors' regret on simulated arms, with a plot."""
    from ..bench import bandit

    results = bandit.run(steps=args.steps, arms=args.arms, seeds=args.seeds, json_path=args.json_path,
                         plot_path=args.plot, progress=not args.no_progress)
    print(bandit.summarize(results))


def bench_select(args: argparse.Namespace) -> None:
    """Bandits against every fixed (drafter, γ) arm on a mixed real workload."""
    from ..bench import select

    gammas = _gammas(args.gammas)
    if args.warm_start_prompts < 0:
        raise ValueError(f"--warm-start-prompts must be >= 0; got {args.warm_start_prompts}.")
    bandits = select.bandit_configs(_names(args.selectors))
    target = args.target or _demo_target()
    drafts = args.draft or [_demo_draft(), "ngram"]
    if any(d.startswith("store:") for d in drafts):
        from ..data.corpus import store_drafters
        from ..models.loading import load_tokenizer

        drafts = store_drafters(drafts, Path(args.corpus), load_tokenizer(args.tokenizer or target))
    engine = _engine(target, drafts, args.tokenizer, args.device, args.dtype, gammas=gammas, selector="fixed",
                     compile=args.compile)  # the arms as given; each bandit is installed by run_selection
    results = select.run_selection(
        engine, Path(args.corpus), bandits=bandits, prompts_per_domain=args.prompts_per_domain,
        prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        warm_start_prompts=args.warm_start_prompts,
    )
    _report(args.out, results, select.summarize_selection(results))


def bench_gpu(args: argparse.Namespace) -> None:
    """The H200 report: verify kernels, roofline, step anatomy, drift (CUDA)."""
    from ..bench import gpu

    shaped = tuple(_names(args.shaped))
    for name in shaped:
        if name not in gpu.SHAPES:
            raise ValueError(f"Unknown shape {name!r}; choose from {', '.join(gpu.SHAPES)}.")
    gpu.run(
        Path(args.out), target=args.target, drafter=args.draft, corpus=Path(args.corpus), shaped=shaped,
        kernels=not args.no_kernels, prompts_per_domain=args.prompts_per_domain,
        prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
        gamma=args.num_draft_tokens, compile=not args.no_compile, maps_table=not args.no_maps,
        hf_baseline=not args.no_hf,
    )


def bench_e2e(args: argparse.Namespace) -> None:
    """Every system side by side on the same prompts: transformers and FlashSpec."""
    from ..bench import e2e

    if args.rewrite_report:
        for path in e2e.rewrite_report(Path(args.rewrite_report)):
            print(f"wrote {path}")
        return
    regimes = e2e.parse_regimes(args.regimes)
    options = dict(systems=_names(args.systems) if args.systems else e2e.DEFAULT_FAMILIES,
                   batch_sizes=e2e.parse_ints(args.batch_sizes, "--batch-sizes"),
                   gammas=e2e.parse_ints(args.gammas, "--gammas"), temperature=args.temperature,
                   hf_prompts_per_domain=args.hf_prompts_per_domain,
                   auto_slacks=None if args.auto_slacks is None else e2e.parse_slacks(args.auto_slacks),
                   auto_selectors=None if args.auto_selectors is None else e2e.parse_selectors(args.auto_selectors))
    e2e.check_options(**options, regimes=regimes, prompts_per_domain=args.prompts_per_domain)
    if args.shaped and (args.target or args.draft):
        raise ValueError("--shaped builds its own target and drafters; leave out --target and --draft.")
    drafts = [] if args.shaped else args.draft or [_demo_draft(), "ngram"]
    names = ["llama3-1b", "ngram"] if args.shaped else [e2e.drafter_name(d) for d in drafts]
    e2e.check_options(**options, regimes=regimes, prompts_per_domain=args.prompts_per_domain, drafters=names)
    results = e2e.load_and_run(
        Path(args.out), target=args.target or (None if args.shaped else _demo_target()), drafts=drafts,
        tokenizer=args.tokenizer, corpus=Path(args.corpus), shaped=args.shaped, device=args.device,
        dtype=args.dtype, regimes=regimes, prompts_per_domain=args.prompts_per_domain, seed=args.seed,
        style=args.style, snippet_tokens=args.snippet_tokens, compile=args.compile, progress=not args.no_progress,
        **options,
    )
    print(e2e.summarize(results))


def bench_training(args: argparse.Namespace) -> None:
    """The training records of trained drafters as one table and one plot."""
    from ..bench.training import bench_training as run

    print(run(args.checkpoints, args.out))


def bench_tp(args: argparse.Namespace) -> None:
    """Tensor-parallel checks and timings (one process per GPU under torchrun), or their summary."""
    from dataclasses import fields

    from ..bench import tp

    if args.summarize:
        print(tp.summarize(Path(args.summarize)))
        return
    tp.run(tp.TPOptions(**{f.name: getattr(args, f.name) for f in fields(tp.TPOptions)}))


def _lengths(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(n) for n in _names(text))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{name} must be comma-separated integers >= 1; got {text!r}.")
    return values


def bench_serve(args: argparse.Namespace) -> None:
    """``flashspec serve`` under load on loopback (SPEC.md §12)."""
    from ..bench import serve

    options = dict(clients=args.clients, requests=args.requests, sequential=args.sequential,
                   min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                   prompt_lengths=_lengths("--prompt-lengths", args.prompt_lengths), slots=args.max_batch,
                   max_length=args.max_length, max_queue=args.max_queue, burst=args.burst,
                   ttft_lengths=_lengths("--ttft-lengths", args.ttft_lengths), ttft_repeats=args.ttft_repeats,
                   ttft_tokens=args.ttft_tokens, timeout_s=args.timeout_s)
    serve.check_options(**options)
    if args.reference_batch < 1:
        raise ValueError(f"--reference-batch must be >= 1; got {args.reference_batch}.")
    drafts = args.draft or ["ngram"]
    from ..serve import load_cuda_modules_eagerly

    load_cuda_modules_eagerly()  # as `flashspec serve` does
    engine = _engine(args.target, drafts, args.tokenizer, args.device, args.dtype, compile=args.compile)
    results = serve.run(engine, corpus=Path(args.corpus), num_draft_tokens=args.num_draft_tokens, seed=args.seed,
                        reference_batch=args.reference_batch,
                        config={"target": args.target, "drafts": drafts, "compile": args.compile,
                                "selector": "auto (the server's default: target-only arm and guard)"}, **options)
    serve.write(results, args.out)
    print(serve.summarize(results))

