"""Scratch probe (session 23): does a CUDA graph's first replay cost more than later ones (the
upload), and what does eval_mode cost on this host with the real module counts?"""
import json, os, time, torch, transformers
from flashspec.cache import StaticLM
from flashspec.graphs import Graphs
from flashspec.models import eval_mode
out = {}
def qwen(layers, hidden, inter, heads, kv):
    cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
target = qwen(28, 1536, 8960, 12, 2)
draft = qwen(24, 896, 4864, 14, 2)
def timed(models, n=50):
    t = time.perf_counter()
    for _ in range(n):
        with eval_mode(*models): pass
    return (time.perf_counter() - t) / n * 1e3
def old(models, n=50):
    t = time.perf_counter()
    for _ in range(n):
        for m in models: m.eval()
        for m in models: m.train(False)
    return (time.perf_counter() - t) / n * 1e3
out["eval_mode_ms"] = {"target": timed((target,)), "target+draft": timed((target, draft))}
out["old_eval_mode_ms"] = {"target": old((target,)), "target+draft": old((target, draft))}
t = time.perf_counter()
for _ in range(50): any(s.training for s in target.modules()); any(s.training for s in draft.modules())
out["check_both_ms"] = (time.perf_counter() - t) / 50 * 1e3
out["has_raw_exec"] = hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec")
print(out, flush=True)
lm = StaticLM(target)
lm.reset(1, 768)
tokens = torch.randint(0, 1000, (1, 768), device="cuda")
zero = torch.zeros(1, dtype=torch.long, device="cuda")
last = torch.zeros(1, 1, dtype=torch.long, device="cuda")
g = Graphs(enabled=True)
def sync_time(f):
    torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize(); return (time.perf_counter() - t) * 1e3
rows = []
for width in (32, 64, 128, 256, 512):
    fn = lambda w=width: lm.forward(tokens[:, :w], zero, None, logits_at=last, eager=True)
    eager = [sync_time(fn) for _ in range(3)]
    g.run(("a", width), fn)  # eager + capture
    replays = [sync_time(lambda: g.run(("a", width), fn)) for _ in range(5)]
    g.run(("b", width), fn)  # capture again, then one warming replay
    g.run(("b", width), fn)
    warmed = [sync_time(lambda: g.run(("b", width), fn)) for _ in range(5)]
    rows.append({"width": width, "eager_ms": eager, "replays_ms_first_then": replays, "after_warming_replay_ms": warmed})
    print(rows[-1], flush=True)
out["replays"] = rows
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe23.json"), "w"), indent=1)
