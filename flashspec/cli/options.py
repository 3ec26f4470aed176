"""Option groups the ``flashspec`` commands share, so that a flag means the same everywhere."""

from __future__ import annotations

import argparse

from ..models.loading import DTYPES

__all__ = ["add_acceptance", "add_block_size", "add_compile", "add_device", "add_drafts", "add_progress",
           "add_sampling", "add_target", "add_tokenizer", "check_block_size_flag"]

MODEL = "folder, hub id or .gguf file"
DRAFTERS = ("drafter: folder, hub id, .gguf file, 'ngram', 'early-exit:N', 'feature:DIR' or 'shallow:DIR' "
            "(repeatable)")


def add_target(p: argparse.ArgumentParser, *, required: bool = True, help: str = MODEL) -> None:
    """``--target``: the model every command runs (a default when not ``required``: see ``help``)."""
    p.add_argument("--target", required=required, default=None, help=help)


def add_drafts(p: argparse.ArgumentParser, *, repeatable: bool = True, help: str = DRAFTERS) -> None:
    """``--draft``: the drafters (a list when ``repeatable``, else one or None)."""
    if repeatable:
        p.add_argument("--draft", action="append", default=None, help=help)
    else:
        p.add_argument("--draft", default=None, help=help)


def add_tokenizer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the target's)")


def add_device(p: argparse.ArgumentParser, *, device: str | None = None, dtype: str | None = None,
               dtype_help: str = "default: bfloat16 on CUDA, float32 on CPU") -> None:
    """``--device`` and ``--dtype`` (with their defaults)."""
    p.add_argument("--device", default=device,
                   help=f"cpu or cuda (default: {device or 'cuda when available'})")
    p.add_argument("--dtype", default=dtype, choices=sorted(DTYPES),
                   help=f"default: {dtype}" if dtype else dtype_help)


def add_compile(p: argparse.ArgumentParser, help: str = "torch.compile the decode forwards (worth it on a GPU)"
                ) -> None:
    p.add_argument("--compile", action="store_true", help=help)


def add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_acceptance(p: argparse.ArgumentParser) -> None:
    """``--acceptance``: the verification rule (SPEC.md §2)."""
    p.add_argument("--acceptance", default="token", choices=["token", "block"],
                   help="token (default): each draft tested alone; block: the drafted block verified jointly "
                        "(the same output law, never fewer drafts kept in expectation)")


def add_block_size(p: argparse.ArgumentParser) -> None:
    """``--block-size``: chunked drafting (SPEC.md §2)."""
    p.add_argument("--block-size", type=int, default=None,
                   help="draft, score and verify each step's drafts in chunks of this many (1 to 64), the target "
                        "scoring a chunk while the drafter drafts the next; default: one piece")


def check_block_size_flag(args: argparse.Namespace) -> None:
    """``--block-size`` from 1 to 64 (or absent), checked before any model loads."""
    if getattr(args, "block_size", None) is not None and not 1 <= args.block_size <= 64:
        raise ValueError(f"--block-size must be from 1 to 64 (drafts per chunk); got {args.block_size}.")


def add_sampling(p: argparse.ArgumentParser) -> None:
    """The sampling, draft-length and timing flags of ``generate`` and ``demo``."""
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 turns top-k off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 turns top-p off")
    p.add_argument("--num-draft-tokens", "--gamma", type=int, default=None,
                   help="tokens drafted per step (default: chosen per drafter by timing its steps here)")
    p.add_argument("--seed", type=int, default=None)
    add_acceptance(p)
    add_block_size(p)
    add_device(p, dtype_help="default: bfloat16 on CUDA; on a CPU the faster of float32 and bfloat16 here "
                             "(timed once)")
    p.add_argument("--no-calibration-cache", action="store_true",
                   help="time forwards and steps again even when cached timings match")
    p.add_argument("--bit-exact", action="store_true",
                   help="bit-exact mode: greedy output equal to target-only output token for token in bfloat16 "
                        "too (SPEC.md §14; a CUDA GPU, Llama/Qwen2/Qwen3/Mistral targets)")
    p.add_argument("--repeats", type=int, default=None,
                   help="with a comparison: alternating speculative / target-only pairs; the speedup is their "
                        "median ratio (default 3: one pair is too noisy on a shared machine)")
