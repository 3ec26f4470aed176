"""Command line: ``flashspec generate``, ``flashspec demo`` and ``flashspec bench core``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}

DEMO_PROMPT = (
    "# Python: a binary search tree with insert, search and in-order traversal\n"
    "class Node:\n"
    "    def __init__(self, key):\n"
)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 turns top-k off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 turns top-p off")
    p.add_argument("--num-draft-tokens", "--gamma", type=int, default=4)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashspec", description="Exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt speculatively")
    gen.add_argument("--target", required=True, help="folder, hub id or .gguf file")
    gen.add_argument(
        "--draft", action="append", default=[], help="drafter: folder, hub id, .gguf file or 'ngram' (repeatable)"
    )
    gen.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the target's)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--compare", action="store_true", help="also run target-only decoding and print the speedup")
    _add_sampling(gen)

    demo = sub.add_parser("demo", help="Qwen2.5-Coder 1.5B with its 0.5B drafter on a code prompt")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    _add_sampling(demo)
    # On the CPU a bf16 matmul costs the same for 1 and 5 tokens, a float32 one does not
    # (BENCHMARKS.md), so the demo runs in bfloat16 everywhere.
    demo.set_defaults(dtype="bfloat16")

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

    fwd = bench_sub.add_parser("forward", help="cost of one cached forward by model, dtype and token count")
    fwd.add_argument("--target", default=None, help="default: the demo's 1.5B target")
    fwd.add_argument("--draft", default=None, help="default: the demo's 0.5B drafter")
    fwd.add_argument("--dtypes", default="float32,bfloat16")
    fwd.add_argument("--device", default="cpu")
    fwd.add_argument("--out", default="benchmarks/results/forward_cpu.json")

    band = bench_sub.add_parser("bandit", help="regret of the drafter selectors on simulated Bernoulli arms")
    band.add_argument("--steps", type=int, default=10_000, help="horizon T")
    band.add_argument("--arms", type=int, default=3, help="number of arms K")
    band.add_argument("--seeds", type=int, default=20, help="runs per selector and scenario")
    band.add_argument("--json", dest="json_path", default="benchmarks/results/bandit.json")
    band.add_argument("--plot", default="benchmarks/results/bandit.png", help="regret curves (PNG)")
    band.add_argument("--no-progress", action="store_true")

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
    return parser


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.temperature > 0,
        temperature=args.temperature if args.temperature > 0 else 1.0,
        top_k=args.top_k,
        top_p=args.top_p,
        num_draft_tokens=args.num_draft_tokens,
        seed=args.seed,
    )


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--temperatures must be comma-separated numbers; got {text!r}.") from None
    if not values or any(not t >= 0 for t in values):
        raise ValueError(f"--temperatures must be numbers >= 0 (0 means greedy); got {text!r}.")
    return values


def _report(label: str, out) -> None:
    s = out.stats
    drafts = f"acceptance {s.acceptance_rate:.2f}, " if s.proposed else ""
    print(
        f"[{label}] {s.new_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_second:.2f} tokens/s; "
        f"{drafts}{s.mean_tokens_per_step:.2f} tokens/step, {s.steps} steps, "
        f"engine overhead {s.overhead_fraction:.1%}"
    )


def _run(engine, baseline, prompt: str, args: argparse.Namespace) -> None:
    kwargs = _engine_kwargs(args)
    out = engine.generate(prompt, progress=True, **kwargs)
    print(prompt + out.text[0])
    print()
    _report("speculative", out)
    if baseline is not None:
        base = baseline.generate(prompt, progress=True, **kwargs)
        _report("target-only", base)
        speedup = out.stats.tokens_per_second / base.stats.tokens_per_second
        if base.sequences == out.sequences:
            same = "identical"
        elif kwargs.get("do_sample"):
            same = "different (sampling draws differ)"
        else:
            same = ("different: in reduced precision a (γ+1)-token forward can round a near-tie the other way "
                    "(SPEC.md §7; float32 output is token-for-token equal)")
        print(f"speedup {speedup:.2f}x; outputs {same}")


def _load_pair(target: str, drafts: list[str], tokenizer: str | None, device: str | None, dtype: str | None,
               **engine_options):
    import torch

    from .engine import SpeculativeEngine

    torch_dtype = getattr(torch, dtype) if dtype else None
    engine = SpeculativeEngine(target, drafts, tokenizer=tokenizer, device=device, dtype=torch_dtype, **engine_options)
    baseline = SpeculativeEngine(engine.target, [], tokenizer=engine.tokenizer)
    return engine, baseline


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            engine, baseline = _load_pair(args.target, args.draft, args.tokenizer, args.device, args.dtype)
            _run(engine, baseline if args.compare else None, args.prompt, args)
        elif args.command == "demo":
            from .models import DEMO_DRAFT, DEMO_TARGET, fetch_demo_model

            target, draft = fetch_demo_model(DEMO_TARGET), fetch_demo_model(DEMO_DRAFT)
            engine, baseline = _load_pair(target, [draft], None, args.device, args.dtype)
            _run(engine, baseline, args.prompt, args)
        elif args.command == "bench" and args.bench == "core":
            from .bench import core as bench
            from .models import DEMO_DRAFT, DEMO_TARGET, fetch_demo_model

            temperatures = _temperatures(args.temperatures)  # before minutes of model loading
            target = args.target or fetch_demo_model(DEMO_TARGET)
            draft = args.draft or fetch_demo_model(DEMO_DRAFT)
            engine, _ = _load_pair(target, [draft], args.tokenizer, args.device, args.dtype)
            results = bench.run_core(
                engine.target, engine.drafters[0], engine.tokenizer, Path(args.corpus),
                prompts_per_domain=args.prompts_per_domain, prompt_tokens=args.prompt_tokens,
                max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                temperatures=temperatures,
            )
            bench.write(results, Path(args.out))
            print(bench.summarize(results))
        elif args.command == "bench" and args.bench == "forward":
            import json

            from .bench import core as bench
            from .models import DEMO_DRAFT, DEMO_TARGET, fetch_demo_model

            specs = {
                "target": args.target or fetch_demo_model(DEMO_TARGET),
                "drafter": args.draft or fetch_demo_model(DEMO_DRAFT),
            }
            dtypes = tuple(d for d in args.dtypes.split(",") if d)
            for d in dtypes:
                if d not in DTYPES:
                    raise ValueError(f"Unknown dtype {d!r}; choose from {', '.join(sorted(DTYPES))}.")
            results = bench.run_forward_costs(specs, dtypes, device=args.device)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
            table = bench.summarize_forward_costs(results)
            out.with_suffix(".md").write_text(table + "\n")
            print(table)
        elif args.command == "bench" and args.bench == "bandit":
            from .bench import bandit as bench_bandit

            results = bench_bandit.run(
                steps=args.steps, arms=args.arms, seeds=args.seeds, json_path=args.json_path,
                plot_path=args.plot, progress=not args.no_progress,
            )
            print(bench_bandit.summarize(results))
        elif args.command == "bench" and args.bench == "select":
            import json

            from .bench import core as bench
            from .models import DEMO_DRAFT, DEMO_TARGET, fetch_demo_model

            try:  # checked before minutes of model loading
                gammas = [int(g) for g in args.gammas.split(",") if g.strip()]
            except ValueError:
                raise ValueError(f"--gammas must be comma-separated integers >= 1; got {args.gammas!r}.") from None
            if not gammas or min(gammas) < 1:
                raise ValueError(f"--gammas must be comma-separated integers >= 1; got {args.gammas!r}.")
            if args.warm_start_prompts < 0:
                raise ValueError(f"--warm-start-prompts must be >= 0; got {args.warm_start_prompts}.")
            from .select import SELECTORS

            selectors = [s for s in args.selectors.split(",") if s]
            for name in selectors:
                if name not in SELECTORS or name in ("fixed", "oracle"):
                    raise ValueError(f"Unknown bandit {name!r} for --selectors; choose from ucb1, thompson, "
                                     "discounted-ucb, sliding-window-ucb, epsilon-greedy.")
            target = args.target or fetch_demo_model(DEMO_TARGET)
            drafts = args.draft or [fetch_demo_model(DEMO_DRAFT), "ngram"]
            if any(d.startswith("store:") for d in drafts):
                from .models import load_tokenizer

                drafts = bench.store_drafters(drafts, Path(args.corpus), load_tokenizer(args.tokenizer or target))
            engine, _ = _load_pair(target, drafts, args.tokenizer, args.device, args.dtype, gammas=gammas,
                                   compile=args.compile)
            bandits = {}
            for name in selectors:
                bandits[f"{name} (shared)"] = {"selector": name, "options": {"seed": 0}}
                bandits[f"{name} (per domain)"] = {"selector": name, "options": {"seed": 0}, "context": "domain"}
            results = bench.run_selection(
                engine, Path(args.corpus), bandits=bandits, prompts_per_domain=args.prompts_per_domain,
                prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                warm_start_prompts=args.warm_start_prompts,
            )
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
            table = bench.summarize_selection(results)
            out.with_suffix(".md").write_text(table + "\n")
            print(table)
        elif args.command == "bench" and args.bench == "gpu":
            from .bench import gpu as bench_gpu

            shaped = tuple(s for s in args.shaped.split(",") if s)
            for name in shaped:
                if name not in bench_gpu.SHAPES:
                    raise ValueError(f"Unknown shape {name!r}; choose from {', '.join(bench_gpu.SHAPES)}.")
            bench_gpu.run(
                Path(args.out), target=args.target, drafter=args.draft, corpus=Path(args.corpus), shaped=shaped,
                kernels=not args.no_kernels, prompts_per_domain=args.prompts_per_domain,
                prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                gamma=args.num_draft_tokens, compile=not args.no_compile,
            )
        elif args.command == "bench" and args.bench == "e2e" and args.rewrite_report:
            from .bench import e2e as bench_e2e

            for path in bench_e2e.rewrite_report(Path(args.rewrite_report)):
                print(f"wrote {path}")
        elif args.command == "bench" and args.bench == "e2e":
            from .bench import e2e as bench_e2e

            # Every option is checked before minutes of model loading.
            regimes = bench_e2e.parse_regimes(args.regimes)
            batch_sizes = bench_e2e.parse_ints(args.batch_sizes, "--batch-sizes")
            gammas = bench_e2e.parse_ints(args.gammas, "--gammas")
            systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
            options = dict(systems=bench_e2e.FAMILY_NAMES if systems is None else systems, batch_sizes=batch_sizes,
                           gammas=gammas, prompts_per_domain=args.prompts_per_domain,
                           temperature=args.temperature, regimes=regimes,
                           hf_prompts_per_domain=args.hf_prompts_per_domain)
            bench_e2e.check_options(**options)
            if args.shaped and (args.target or args.draft):
                raise ValueError("--shaped builds its own target and drafters; leave out --target and --draft.")
            drafts = [] if args.shaped else args.draft
            if drafts is None:
                from .models import DEMO_DRAFT, fetch_demo_model

                drafts = [fetch_demo_model(DEMO_DRAFT), "ngram"]
            names = ["llama3-1b", "ngram"] if args.shaped else [bench_e2e.drafter_name(d) for d in drafts]
            bench_e2e.check_options(**options, drafters=names)
            target = args.target
            if target is None and not args.shaped:
                from .models import DEMO_TARGET, fetch_demo_model

                target = fetch_demo_model(DEMO_TARGET)
            results = bench_e2e.load_and_run(
                Path(args.out), target=target, drafts=drafts, tokenizer=args.tokenizer, corpus=Path(args.corpus),
                shaped=args.shaped, device=args.device, dtype=args.dtype, regimes=regimes,
                prompts_per_domain=args.prompts_per_domain, seed=args.seed, systems=systems,
                batch_sizes=batch_sizes, gammas=gammas, temperature=args.temperature, compile=args.compile,
                hf_prompts_per_domain=args.hf_prompts_per_domain, progress=not args.no_progress,
            )
            print(bench_e2e.summarize(results))
    except ValueError as error:
        print(f"flashspec: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
