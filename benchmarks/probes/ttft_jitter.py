"""Scratch probe (session 20, removed after): where the 21-45 ms spread of time-to-first-token of
target-only calls on the H200 comes from. A random-weight target of Qwen2.5-1.5B's shape (time does
not depend on weight values), compiled, bf16, target only; calls of 256 new tokens on prompts of
231-400 random tokens, interleaved over three conditions: back to back, after a 0.3 s idle gap,
after a 0.3 s gap with Python's GC off. Per call: setup before the prefill, the prefill's host
time, and the prefill forward alone timed with CUDA events; then a graph-captured prefill at a
padded width for comparison. Usage: python3 benchmarks/probes/ttft_jitter.py OUT.json [tiny]"""
import gc, json, statistics, sys, time
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from flashspec import SpeculativeEngine

tiny = len(sys.argv) > 2
dev = "cpu" if tiny else "cuda"
cfg = Qwen2Config(hidden_size=64 if tiny else 1536, intermediate_size=128 if tiny else 8960,
                  num_hidden_layers=2 if tiny else 28, num_attention_heads=4 if tiny else 12,
                  num_key_value_heads=2, vocab_size=1000 if tiny else 151936, max_position_embeddings=4096,
                  rope_theta=1e6, tie_word_embeddings=True)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(dev).eval()
engine = SpeculativeEngine(model, [], device=dev, dtype=torch.bfloat16, compile=not tiny)
new = 8 if tiny else 256
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(10, cfg.vocab_size - 10, (int(n),), generator=g).tolist()
           for n in torch.randint(231, 400, (60,), generator=g)]
out = {"calls": [], "forward": {}, "graph": {}}

def call(p):
    t0 = time.perf_counter()
    o = engine.generate([p], max_new_tokens=new, do_sample=False, eos_token_id=[])
    t = time.perf_counter() - t0
    s = o.stats
    return {"total": t, "setup": t - s.seconds, "prefill": s.prefill_seconds, "ttft": t - s.seconds + s.prefill_seconds,
            "len": len(p)}

for p in prompts[:3]:
    call(p)  # warm
conds = ["back_to_back", "gap_0.3s", "gap_0.3s_gc_off"]
for i in range(0, 60 if not tiny else 6):
    c = conds[i % 3]
    if c != "back_to_back":
        time.sleep(0.3)
    if c.endswith("gc_off"):
        gc.disable()
    r = call(prompts[i]); r["cond"] = c
    gc.enable()
    out["calls"].append(r)
    print(c, {k: round(v * 1e3, 1) if isinstance(v, float) else v for k, v in r.items() if k != "cond"}, flush=True)
for c in conds:
    rs = [r for r in out["calls"] if r["cond"] == c]
    out[c] = {k: [round(x["%s" % k] * 1e3, 1) for x in rs] for k in ("setup", "prefill", "ttft")}
    print(c, {k: (min(v), statistics.median(v), max(v)) for k, v in out[c].items()}, flush=True)

# The prefill forward alone, eager, as the engine runs it, timed with events (GPU) and the host clock.
lm = engine._target_lm
if not tiny:
    for width in (256, 333, 512):
        tokens = torch.randint(10, 1000, (1, width), device=dev)
        zeros = torch.zeros(1, dtype=torch.long, device=dev)
        at = torch.full((1, 1), width - 1, device=dev)
        host, gpu = [], []
        for rep in range(15):
            if rep % 2:
                time.sleep(0.3)
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter(); e0.record()
            lm.forward(tokens, zeros, None, logits_at=at, eager=True)
            e1.record(); th = time.perf_counter() - t0; torch.cuda.synchronize()
            host.append(round(th * 1e3, 2)); gpu.append(round(e0.elapsed_time(e1), 2))
        out["forward"][width] = {"host_launch_ms": host, "gpu_ms": gpu}
        print("eager prefill", width, "launch", host, "gpu", gpu, flush=True)
        try:
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                lm.forward(tokens, zeros, None, logits_at=at, eager=True)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                lm.forward(tokens, zeros, None, logits_at=at, eager=True)
            reps = []
            for rep in range(15):
                if rep % 2:
                    time.sleep(0.3)
                torch.cuda.synchronize(); t0 = time.perf_counter(); graph.replay(); torch.cuda.synchronize()
                reps.append(round((time.perf_counter() - t0) * 1e3, 2))
            out["graph"][width] = reps
            print("graph prefill", width, reps, flush=True)
        except Exception as e:  # noqa: BLE001
            out["graph"][width] = repr(e)[:300]
            print("graph failed", repr(e)[:300], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
