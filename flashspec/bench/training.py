"""``flashspec bench training``: what each trained drafter cost and reached, from its own record.

Every checkpoint of ``flashspec train-drafter`` keeps its training log in ``drafter.json`` (SPEC.md
§11.3): steps, tokens, seconds, peak GPU memory, the acceptance estimates by step and depth, and
the estimate on the checkpoint as saved. This command reads those records (checkpoint folders or
copies of their ``drafter.json``) and writes one table and one plot of the learning curves, so
that the figures in BENCHMARKS.md come from the run's own files and are never typed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..training.train import training_totals
from .results import pyplot, save_figure, write_results

__all__ = ["read_record", "training_table", "bench_training"]


def read_record(path: str | Path) -> dict[str, Any]:
    """The record of one trained drafter: ``path`` is a checkpoint folder or its ``drafter.json``
    (a copy may carry another name). Adds ``name``, and ``bytes`` (its weights file) for a folder."""
    path = Path(path)
    meta_path = path / "drafter.json" if path.is_dir() else path
    if not meta_path.is_file():
        raise ValueError(f"{path} is neither a drafter checkpoint folder nor a drafter.json file.")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path} is not valid JSON ({err}).") from None
    if not isinstance(meta, dict) or "training" not in meta:
        raise ValueError(f"{meta_path} holds no training record: it was not written by flashspec train-drafter.")
    meta["name"] = path.name if path.is_dir() else path.stem
    weights = path / meta.get("weights", "drafter.safetensors")  # an EAGLE-3 head's: model.safetensors
    if path.is_dir() and weights.is_file():
        meta["bytes"] = weights.stat().st_size  # older records do not say
    return meta


def _design(meta: dict[str, Any]) -> str:
    options = meta["training"].get("options", {})
    if meta.get("base") is not None:
        return f"rank-{meta.get('rank')} delta over {Path(meta['base']['path']).name}"
    if meta.get("kind") == "eagle3":  # train-drafter --layout eagle3 (SPEC.md §11.9)
        vocab = f"vocab {meta['draft_vocab']}" if meta.get("draft_vocab") else "full vocab"
        return (f"EAGLE-3 layer, MLP {meta.get('width')}, {meta.get('heads')} heads, {vocab}, taps "
                f"{','.join(map(str, meta.get('taps') or []))}, unroll {options.get('unroll', 1)}")
    parts = [f"{meta.get('layers')} layer{'s' if meta.get('layers') != 1 else ''}"]
    if meta.get("kind") == "shallow":
        parts.insert(0, f"target's first {meta.get('shared_layers')} +")
    if meta.get("kind") == "feature":
        parts.append(f"MLP {meta['width']}, {meta['heads']} heads" if meta.get("width") else "target-width MLP and heads")
    if meta.get("head_width") is not None:
        parts.append(f"head MLP {meta['head_width']}")
    if meta.get("kind") == "feature":
        parts.append(f"vocab {meta['vocab']}" if meta.get("vocab") else "full vocab")
        if meta.get("taps"):  # fused features (SPEC.md §11.8)
            parts.append(f"taps {','.join(map(str, meta['taps']))}")
            if meta.get("fuse_rank"):
                parts.append(f"fuse rank {meta['fuse_rank']}")
    if meta.get("kind") == "feature":
        parts.append(f"unroll {options.get('unroll', 1)}, feature loss {options.get('feature_weight', 0):g}")
    return ", ".join(parts)


def _alphas(log: dict[str, Any]) -> str:
    """α by depth on the checkpoint as saved (train-drafter's last estimate), else the last estimate."""
    values = log.get("alpha_saved") or ([log["alpha1_saved"]] if log.get("alpha1_saved") is not None else None)
    if not values and log.get("estimates"):
        values = log["estimates"][-1]["alpha"]
    return "/".join(f"{a:.3f}" for a in values) if values else "—"


def _runs(log: dict[str, Any], key: str) -> str:
    """``key``'s total, and for a drafter trained further its runs' share: ``"3000 (1632 + 1368)"``."""
    total = training_totals(log)[key]
    if not isinstance(log.get("before"), dict):
        return f"{total:.0f}"
    before = training_totals(log["before"])[key]
    return f"{total:.0f} ({before:.0f} + {total - before:.0f})"


def training_table(records: list[dict[str, Any]]) -> str:
    """A markdown table: design, steps, tokens, seconds, α by depth as saved, peak memory, bytes."""
    header = ("| drafter | kind | design | steps | tokens seen | seconds | α₁/α₂/α₃ (as saved) "
              "| peak GPU memory | checkpoint |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for meta in records:
        log = meta["training"]
        total = training_totals(log)  # a drafter trained further counts its earlier runs too
        memory = log.get("peak_memory_bytes")
        size = meta.get("bytes")
        lines.append(
            f"| {meta['name']} | {meta.get('kind')} | {_design(meta)} | {_runs(log, 'steps')} | {total['tokens']:,} "
            f"| {_runs(log, 'seconds')} | {_alphas(log)} "
            f"| {'—' if memory is None else f'{memory / 2**30:.1f} GiB'} "
            f"| {'—' if size is None else f'{size / 1e6:.1f} MB'} |")
    return "\n".join(lines)


def _curves(records: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, meta in enumerate(records):
        log = meta["training"]
        before = log.get("before") if isinstance(log.get("before"), dict) else {}
        offset = training_totals(before)["steps"] if before else 0  # steps counted from the first run's start
        estimates = list(before.get("estimates", [])) + [{**e, "step": e["step"] + offset}
                                                         for e in log.get("estimates", [])]
        style = {"marker": ".", "label": meta["name"], "color": f"C{i % 10}"}  # one colour per drafter
        if not estimates:
            continue
        steps = [e["step"] for e in estimates]
        axes[0].plot(steps, [e["alpha"][0] for e in estimates], **style)
        deeper = [e["alpha"][1] for e in estimates if len(e.get("alpha", [])) > 1]
        if len(deeper) == len(steps):
            axes[1].plot(steps, deeper, **style)
    for ax, title in zip(axes, ("α₁ (first draft)", "α₂ (second draft, after one of its own)")):
        ax.set(xlabel="training step", ylabel="agreement with the target's argmax", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def bench_training(paths: list[str], out: str | None = None) -> str:
    """Read the records at ``paths``, print and (with ``out``) write the table, the records' JSON
    and the learning-curve plot; return the table."""
    if not paths:
        raise ValueError("Give at least one checkpoint folder or drafter.json.")
    records = [read_record(p) for p in paths]
    table = training_table(records)
    if out is not None:
        folder = Path(out)
        write_results(folder / "training.json", records,
                      table)
        _curves(records, folder / "training.png")
    return table
