"""Probe (session 24): what a join costs by prompt length, with a model drafter's join padded to
a captured width (as now, SPEC.md §12) and fed at prompt + 1 positions (as before: `_join_widths`
emptied, which is the old rule exactly).

Random-weight models of the demo pair's shapes (Qwen2.5-Coder-1.5B target, 0.5B drafter), bf16,
`compile=True`, one GPU; a running batch of 2 slots and `max_length` 512, warmed (joins captured
at 16 … 512). A join is `Batch.add` then `Batch.flush` (the first token read back): what a
request's time to first token holds beyond the server's queueing. Both rules interleaved, 8
repeats per length. Writes OUT/joins.json and prints a table.
Usage: python benchmarks/probes/join_widths.py OUT"""
import json
import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashspec import SpeculativeEngine

out = sys.argv[1]
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def model(hidden, inter, layers, heads):
    cfg = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1e6, tie_word_embeddings=True)
    with torch.device(device):
        m = Qwen2ForCausalLM(cfg)
    return m.to(torch.bfloat16).eval()


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


target, draft = model(1536, 8960, 28, 12), model(896, 4864, 24, 14)
engine = SpeculativeEngine(target, [draft], gammas=[4], compile=device == "cuda")
drafter = engine.drafters[0]
gen = torch.Generator().manual_seed(1)
lengths = (15, 16, 17, 63, 64, 65, 200)
times = {rule: {n: [] for n in lengths} for rule in ("padded", "prompt+1")}
with engine.batch(slots=2, max_length=512, num_draft_tokens=4) as batch:
    t = time.perf_counter()
    batch.warmup([1])
    warmup = time.perf_counter() - t
    widths = drafter._join_widths
    print(f"warm-up {warmup:.1f} s; join widths {widths}", flush=True)
    for repeat in range(8):
        for rule in ("padded", "prompt+1"):
            drafter._join_widths = widths if rule == "padded" else ()
            for n in lengths:
                prompt = torch.randint(0, 151936, (n,), generator=gen).tolist()
                sync()
                t = time.perf_counter()
                handle = batch.add(prompt, max_new_tokens=2)
                batch.flush()
                times[rule][n].append(time.perf_counter() - t)
                batch.cancel(handle)
    drafter._join_widths = widths
summary = {rule: {n: {"median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v), "max_ms": 1e3 * max(v)}
                  for n, v in per.items()} for rule, per in times.items()}
json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "warmup_s": warmup, "join_widths": list(widths), "summary": summary, "times_s": times},
          open(f"{out}/joins.json", "w"), indent=1)
print("| prompt tokens | padded: median ms (min–max) | prompt + 1: median ms (min–max) |")
for n in lengths:
    a, b = summary["padded"][n], summary["prompt+1"][n]
    print(f"| {n} | {a['median_ms']:.1f} ({a['min_ms']:.1f}–{a['max_ms']:.1f}) | "
          f"{b['median_ms']:.1f} ({b['min_ms']:.1f}–{b['max_ms']:.1f}) |")
