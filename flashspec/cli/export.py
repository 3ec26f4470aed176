"""``flashspec export-drafter``: an EAGLE-3 head rewritten in the EAGLE/SpecForge or the
``speculators`` layout (SPEC.md §11.9), for vLLM, SGLang or speculators to load."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..drafters.checkpoint import read_meta
from ..drafters.eagle3_formats import KIND, LAYOUTS, read_eagle3, target_embedding, write_eagle3

__all__ = ["add_parsers", "export_drafter"]

# Why FlashSpec's own heads are refused: their layer is not EAGLE-3's, and no rewrite is exact.
NOT_EAGLE3 = ("{folder!r} holds a FlashSpec {kind} drafter. Its layer is not EAGLE-3's: FlashSpec feeds "
              "fc([g; e]) into a decoder layer of the target's class (the residual starts from fc's output), "
              "where EAGLE-3's attention reads [input_layernorm(e); hidden_norm(g)] through 2·hidden-wide "
              "q/k/v projections and its residual starts from g. RMSNorm of a mix of g and e is no linear "
              "map of the two normed halves, so no exact EAGLE-3 weights exist and it is not exported. "
              "export-drafter rewrites EAGLE-3 heads between the EAGLE and speculators layouts; for vLLM or "
              "SGLang, train one with flashspec train-drafter --layout eagle3.")


def add_parsers(sub: Any) -> None:
    parser = sub.add_parser(
        "export-drafter", help="write an EAGLE-3 head in the EAGLE/SpecForge or speculators layout",
        description="Rewrite the EAGLE-3 head in DIR (either layout) in the layout --to names: the same "
                    "tensors, so it drafts exactly as before. What the layout cannot express is refused.")
    parser.add_argument("source", metavar="DIR", help="an EAGLE-3 head: EAGLE/SpecForge or speculators layout, or "
                                                      "one flashspec train-drafter --layout eagle3 wrote")
    parser.add_argument("--to", required=True, choices=LAYOUTS,
                        help="eagle3: EAGLE/SpecForge; speculators: Eagle3Speculator")
    parser.add_argument("--out", required=True, metavar="OUT", help="the folder to write (created if missing)")
    parser.add_argument("--verifier", default=None, metavar="MODEL",
                        help="the target's hub id or folder, recorded in a speculators config, whose token "
                             "embedding the speculators layout carries where DIR has none (needed --to "
                             "speculators unless DIR records one, as a head train-drafter wrote does)")
    parser.set_defaults(run=export_drafter)


def export_drafter(args: argparse.Namespace) -> None:
    """Write the EAGLE-3 head in ``args.source`` (either layout, or one ``train-drafter --layout
    eagle3`` wrote) in the layout ``args.to`` names."""
    source, out = Path(args.source), Path(args.out)
    kind = read_meta(source).get("kind", "") if (source / "drafter.json").is_file() else None
    if kind is not None and kind != KIND:  # FlashSpec's own layouts; its EAGLE-3 heads export as they are
        raise ValueError(NOT_EAGLE3.format(folder=str(source), kind=kind))
    if out.exists() and out.resolve() == source.resolve():
        raise ValueError("--out must be another folder than DIR.")
    ckpt = read_eagle3(source)
    if args.verifier:
        ckpt.verifier["name_or_path"] = args.verifier
    if args.to == "speculators" and not ckpt.verifier.get("name_or_path"):
        raise ValueError("A speculators checkpoint names its target: give --verifier MODEL (its hub id or folder; "
                         "speculators' Eagle3DraftModel.from_pretrained reads that model's config).")
    if args.to == "speculators" and "embed_tokens.weight" not in ckpt.tensors:
        # A head that shares the target's embedding (one train-drafter wrote, most EAGLE-layout heads): the
        # speculators layout carries it, as speculators writes its own, since its loader takes it from there.
        verifier = str(ckpt.verifier["name_or_path"])
        embed = target_embedding(verifier)
        if tuple(embed.shape) != (ckpt.vocab_size, ckpt.hidden):
            raise ValueError(f"The verifier {verifier!r} is not this head's target: its embedding is "
                             f"{tuple(embed.shape)}, the head's vocabulary and hidden size ({ckpt.vocab_size}, "
                             f"{ckpt.hidden}).")
        ckpt.tensors["embed_tokens.weight"] = embed
    write_eagle3(ckpt, out, args.to)
    print(f"Wrote {ckpt.layout} head {str(source)!r} in the {args.to} layout to {str(out)!r}.")
