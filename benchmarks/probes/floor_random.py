"""Probe (session 24): what the default configuration costs where no drafter can pay.

Random-weight models of the demo pair's shapes (Qwen2.5-Coder-1.5B target, 0.5B drafter), bf16,
`compile=True`, on one GPU; sampled at T = 1 from near-uniform logits over 151,936 tokens, so no
draft is ever accepted and every drafting step loses. Per prompt, side by side: the target alone,
then `selector="auto"` (the 0.5B drafter and n-gram at γ = 4 beside the target-only arm) at
δ = 0.005, 0.01, 0.02, each with this session's two host-side changes (SPEC.md §7 polls counted by
the launched steps' draft lengths; §8 the selector not asked while no drafting step fits) and
without them (both patched back). Writes OUT/floor.json and prints a table.
Usage: python benchmarks/probes/floor_random.py OUT [PROMPTS]"""
import json
import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashspec import SpeculativeEngine, loop
from flashspec.select.guard import Guard

out = sys.argv[1]
prompts_n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
torch.manual_seed(0)


def model(hidden, inter, layers, heads):
    cfg = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1e6, tie_word_embeddings=True)
    with torch.device("cuda"):
        m = Qwen2ForCausalLM(cfg)
    return m.to(torch.bfloat16).eval()


target, draft = model(1536, 8960, 28, 12), model(896, 4864, 24, 14)
base = SpeculativeEngine(target, [], compile=True)
auto = SpeculativeEngine(target, [draft, "ngram"], gammas=[4], compile=True)
gen = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 151936, (300,), generator=gen).tolist() for _ in range(prompts_n)]
kw = dict(max_new_tokens=256, eos_token_id=[], do_sample=True, temperature=1.0)


def timed(engine, prompt, seed):
    torch.cuda.synchronize()
    t = time.perf_counter()
    o = engine.generate([prompt], seed=seed, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t, o.stats


new_choose, new_most = Guard.choose, loop._Run.most_committed


def mode(old):
    Guard.choose = Guard._choose if old else new_choose
    loop._Run.most_committed = (lambda self: max(self.plan.arm_gammas) + 1) if old else new_most


t0 = time.perf_counter()
for _ in range(2):  # compile and capture every arm's graphs outside the timed calls
    timed(base, prompts[0], 0)
    for arm in range(len(auto.arms)):
        auto.selection = auto.new_selection("fixed", arm=arm)
        auto.slack, s = None, auto.slack
        timed(auto, prompts[0], 0)
        auto.slack = s
print(f"warm-up {time.perf_counter() - t0:.1f} s", flush=True)
variants = [(d, old) for d in (0.005, 0.01, 0.02) for old in (False, True)]
selections = {v: auto.new_selection("auto", seed=0) for v in variants}
rows = []
for i, p in enumerate(prompts):
    mode(False)
    b, _ = timed(base, p, i)
    row = {"prompt": i, "target_only_s": b, "variants": {}}
    for d, old in variants:
        mode(old)
        auto.selection, auto.slack = selections[(d, old)], d
        s, st = timed(auto, p, i)
        arms = [r.arm for r in st.step_log]
        row["variants"][f"{d}/{'old' if old else 'new'}"] = {
            "seconds": s, "ratio": b / s, "steps": st.steps, "drafting_steps": sum(a != "target@0" for a in arms),
            "guard_refused": st.guard_refused, "selector_us_per_step": 1e6 * st.selector_seconds / max(st.steps, 1)}
    mode(False)
    rows.append(row)
    print(i, " ".join(f"{k}:{v['ratio']:.3f}" for k, v in row["variants"].items()), flush=True)
summary = {}
for k in rows[0]["variants"]:
    r = [row["variants"][k]["ratio"] for row in rows]
    summary[k] = {"median": statistics.median(r), "min": min(r), "below_0.97": sum(x < 0.97 for x in r),
                  "drafting_share": sum(row["variants"][k]["drafting_steps"] for row in rows)
                  / sum(row["variants"][k]["steps"] for row in rows),
                  "selector_us_per_step": statistics.median(row["variants"][k]["selector_us_per_step"] for row in rows)}
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "prompts": prompts_n,
           "target_only_tok_s": statistics.median(256 / r["target_only_s"] for r in rows),
           "summary": summary, "rows": rows}, open(f"{out}/floor.json", "w"), indent=1)
print("| δ / host changes | median | lowest | below 0.97× | drafting steps | selector µs/step |")
for k, v in summary.items():
    print(f"| {k} | {v['median']:.3f}× | {v['min']:.3f}× | {v['below_0.97']} | {v['drafting_share']:.1%} | "
          f"{v['selector_us_per_step']:.0f} |")
