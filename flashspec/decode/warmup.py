"""Compiling and capturing when the engine is built, not inside requests (SPEC.md §7, "Warm
shapes"): every arm once, greedy and sampled, alone and after gaps of target-only steps (the
catch-up widths a switch meets, SPEC.md §4), at each batch size to be warmed. The guard, its
budget lifted, measures each arm's steady step and each catch-up while it runs, so the first
request's guard starts from measured costs (SPEC.md §8)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..select.fixed import ScriptedSelector

__all__ = ["GAPS", "PROMPT_TOKENS", "warm_up"]

PROMPT_TOKENS = 64  # the warm-up prompt's length (a prefill captures every padded width at once)
STEPS = 8  # decode steps per warm-up call (the first ones compile and capture, the rest are steady)
GAPS = (1, 20)  # target-only steps before an arm's step: a short gap and one past the compiled widths
SAMPLED = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}  # a sampled request's kernels and graphs


def warm_up(engine: Any, batch_sizes: Sequence[int] = (1,), progress: bool = True) -> float:
    """Run ``engine``'s warm-up (see the module docstring) and return its seconds. ``engine`` is
    a :class:`~flashspec.SpeculativeEngine`; its selection and slack are put back afterwards."""
    started = time.perf_counter()
    arms = list(range(len(engine.arms)))
    ids = torch.randint(0, engine.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    scripts = [[arm] for arm in arms] or [None]
    baseline = engine.target_only_arm
    for arm, (d, _) in enumerate(engine.arms):
        if d is not None and baseline is not None:  # a switch back after target-only steps
            scripts.append([baseline, arm] + [a for gap in GAPS for a in [baseline] * gap + [arm]])
    calls = [(rows, sampling, script) for rows in batch_sizes for sampling in ({}, SAMPLED) for script in scripts]
    selection, slack = engine.selection, engine.slack
    engine.slack = None if slack is None else 1e9  # every scripted choice runs; the guard still measures
    try:
        for rows, sampling, script in tqdm(calls, desc="warming up (compiling, capturing)", unit="call",
                                           disable=not progress):
            if script is not None:
                engine.selection = engine.new_selection(ScriptedSelector(len(engine.arms), script))
            steps = STEPS if script is None else STEPS + len(script)
            engine.generate([ids] * rows, max_new_tokens=steps, eos_token_id=[], seed=0, **sampling)
    finally:
        engine.selection, engine.slack = selection, slack
    return time.perf_counter() - started
