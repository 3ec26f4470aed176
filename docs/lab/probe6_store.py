"""Ran at commit 2c0c874 (2026-12-01) and, for its prompt lookup at longer drafts, 4e9df5f
(2026-12-01), as benchmarks/probes/probe6_store.py; it imports modules by their paths at those
commits — check out 4e9df5f to run it again.
Probe 6: would per-domain retrieval drafters (DatastoreDrafter over each domain's training
text) give the bandit arms whose ranking changes with the domain? Replays the target's own
greedy outputs from the H200 e2e run (benchmarks/results/e2e_h200/long_b1/e2e.json: the same
held-out prompts, 256 new tokens) and counts, step by step, how many drafts each drafter would
have had accepted (greedy acceptance is a prefix match, so this is exact without the model).

    python benchmarks/probes/probe6_store.py ../shared/corpus ../shared/tokenizers/qwen2.5
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from flashspec.bench import DOMAINS, store_drafters
from flashspec.bench_e2e import REGIMES, make_prompts
from flashspec.drafters import History, NgramDrafter
from flashspec.models import load_tokenizer
from flashspec.sampling import SamplingParams


def replay(drafter, prompt: list[int], output: list[int], gamma: int) -> tuple[int, int]:
    """(steps, tokens) of greedy speculative decoding of ``output`` after ``prompt``."""
    seq = prompt + output
    tokens = torch.tensor([seq])
    pos, steps = len(prompt), 0
    while pos < len(seq):
        history = History(tokens, torch.tensor([pos]), None, pos)
        draft = drafter.propose(history, gamma, SamplingParams(), torch.zeros(1, gamma, dtype=torch.float64))
        proposed = draft.tokens[0].tolist()
        accepted = 0
        while accepted < gamma and pos + accepted < len(seq) and proposed[accepted] == seq[pos + accepted]:
            accepted += 1
        pos += accepted + 1
        steps += 1
    return steps, len(output)


def main(corpus: str, tokenizer_path: str) -> None:
    results = json.loads(Path("benchmarks/results/e2e_h200/long_b1/e2e.json").read_text())
    tokenizer = load_tokenizer(tokenizer_path)
    prompts = make_prompts({"long": REGIMES["long"]}, 20, tokenizer=tokenizer, corpus=Path(corpus), seed=0)["long"]
    outputs = {(c["domain"], c["prompts"][0]): c["sequences"][0] for c in results["cells"][0]["calls"]
               if c["system"] == "flashspec"}
    stores = store_drafters([f"store:{d}" for d in DOMAINS], Path(corpus), tokenizer)  # context first
    alone = []
    for s in stores:  # the same stores without the request's own text
        a = copy.copy(s)
        a.in_context, a.name = None, s.name + "-alone"
        alone.append(a)
    drafters = [NgramDrafter()] + stores + alone
    print("tokens per step (greedy replay of the target's outputs, 20 prompts × 256 tokens per domain)")
    print("drafter@γ      " + "".join(f"{d:>8}" for d in DOMAINS))
    for drafter in drafters:
        for gamma in (2, 4):
            row = []
            for domain in DOMAINS:
                steps = tokens = 0
                for i, prompt in enumerate(prompts[domain]):
                    s, t = replay(drafter, prompt, outputs[(domain, i)], gamma)
                    steps, tokens = steps + s, tokens + t
                row.append(tokens / steps)
            print(f"{drafter.name + '@' + str(gamma):15}" + "".join(f"{v:8.2f}" for v in row))
    print("\nprompt lookup at longer drafts (H200: a 5-token target forward cost 3 % more than a 1-token one; longer ones not yet timed)")
    for gamma in (6, 8, 12, 16):
        row = []
        for domain in DOMAINS:
            steps = tokens = 0
            for i, prompt in enumerate(prompts[domain]):
                s, t = replay(NgramDrafter(), prompt, outputs[(domain, i)], gamma)
                steps, tokens = steps + s, tokens + t
            row.append(tokens / steps)
        print(f"{'ngram@' + str(gamma):15}" + "".join(f"{v:8.2f}" for v in row))


if __name__ == "__main__":
    main(*sys.argv[1:3])
