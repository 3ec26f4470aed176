"""Probe (session 26, scratch): what a feature drafter's step costs after a gap of target-only steps.

In the default configuration's H200 runs, feature steps after ≥ 4 steps of other arms took 2.25 ms
against 2.10 after fewer (BENCHMARKS.md, session 26). This replays fixed scripts — the target alone
for ``g`` steps, then one feature step — on a random-weight model of the target's shape with the
committed general feature drafter (step time does not depend on weight values), and reports the
feature steps' median time per gap, i.e. per re-fed window width (4, 8, 16, 32).
Usage: python benchmarks/probes/feature_gap.py OUT.json [tiny]
"""
import json
import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import flashspec.train as train
from flashspec import SpeculativeEngine
from flashspec.bench.e2e import ScriptedSelector

out_path, tiny = sys.argv[1], len(sys.argv) > 2
cuda = torch.cuda.is_available()
device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
config = Qwen2Config(hidden_size=1536, intermediate_size=8960 if not tiny else 256, num_hidden_layers=28 if not tiny else 2,
                     num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                     max_position_embeddings=32768, rope_theta=1e6)
torch.manual_seed(0)
with torch.device(device):
    model = Qwen2ForCausalLM(config).to(dtype).eval()
folder = "flashspec/checkpoints/qwen2.5-coder-1.5b-instruct/general"
real_record = train._target_record
meta = json.load(open(f"{folder}/drafter.json"))
train._target_record = lambda target, shared: {**real_record(target, shared), **{k: meta["target"][k] for k in ("shared_sha256",)}}
second = "flashspec/checkpoints/qwen2.5-coder-1.5b-instruct/code"
engine = SpeculativeEngine(model, [f"feature:{folder}", f"feature:{second}", "ngram"], selector="fixed", target_only=True, slack=None,
                           compile=cuda, device=device)
prompt = torch.randint(0, 150000, (1, 300), generator=torch.Generator().manual_seed(1)).tolist()
results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "arms": [engine.arm_label(a, 4) for a in range(len(engine.arms))], "gaps": {}}
feature, other, ngram, target = 0, 1, 2, engine.target_only_arm
new = 256 if not tiny else 40
SCRIPTS = {"0": [feature], "t1": [target, feature], "t5": [target] * 5 + [feature],
           "other1": [other, feature], "other5": [other] * 5 + [feature], "ngram1": [ngram, feature],
           "ngram5": [ngram] * 5 + [feature], "mix5": [other, target, ngram, target, other, feature]}
for gap, script in SCRIPTS.items():
    times = []
    for trial in range(3):  # the first: compilations and captures
        engine.selection = engine.new_selection(ScriptedSelector(len(engine.arms), script))
        started = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=new, eos_token_id=[], seed=0)
        log = out.stats.step_log
        if trial:
            times += [r.seconds for r in log[len(script):] if r.arm == engine.arm_label(feature, 4) and r.rows]
        base = [r.seconds for r in log if r.arm == engine.arm_label(target, 4) and r.rows]
    if not times:
        continue
    results["gaps"][gap] = {"feature_ms_median": 1e3 * statistics.median(times), "feature_steps": len(times),
                            "target_ms_median": 1e3 * statistics.median(base) if base else None,
                            "feature_ms_q": [1e3 * q for q in statistics.quantiles(times, n=4)] if len(times) > 3 else None}
    print(gap, results["gaps"][gap], flush=True)
    json.dump(results, open(out_path, "w"), indent=1)
