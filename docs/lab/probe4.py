"""Ran at commit a46f870 (2026-11-30), as benchmarks/probes/probe4.py (results committed with it); it
imports modules by their paths at that commit — check it out there to run it again.
Flash-decoding kernel vs SDPA inside StaticLM (eager + CUDA graphs, no compile), H200."""
import json, os, torch
from flashspec import bench_gpu
from flashspec.cache import StaticLM

out = {}
for shape, widths in (("qwen2.5-1.5b", (1, 5)), ("llama3-8b", (1, 5))):
    model = bench_gpu.shaped_model(shape)
    lm = StaticLM(model)
    for fast in (False, True):
        lm.fast_attention = fast
        for w in widths:
            t = bench_gpu.time_forward(lm, 1, w, 300, iters=30)
            out[f"{shape}/q={w}/fast={fast}"] = t
            print(f"{shape} q={w} fast_attention={fast}: {t * 1e3:.3f} ms", flush=True)
    del model, lm
    torch.cuda.empty_cache()
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/probe4.json", "w"), indent=1)
