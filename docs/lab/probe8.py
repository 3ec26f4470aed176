"""Ran at commit 5dbbd9f (2026-12-01), as benchmarks/probes/probe8.py (results committed with it); it
imports modules by their paths at that commit — check it out there to run it again.
Probe 8 (H200): the KV-cache write under torch.compile — a plain scatter_ (functionalised:
a copy of each layer's whole cache per forward) against the in-place custom op
flashspec::write_kv — for the Llama-3-8B shape at two capacities. Run from the repo root:
    PYTHONPATH=. python benchmarks/probes/probe8.py
"""
import json, os, time

import torch

import flashspec.cache as cache
from flashspec import bench_gpu

OUT = os.environ.get("OUT", "/tmp")
in_place = cache.write_kv


def plain_scatter(keys, values, new_keys, new_values, slots):
    keys.scatter_(2, slots, new_keys)
    values.scatter_(2, slots, new_values)


out = {}
model = bench_gpu.shaped_model("llama3-8b")
for name, write in (("scatter", plain_scatter), ("write_kv", in_place)):
    cache.write_kv = write
    torch._dynamo.reset()
    lm = cache.StaticLM(model, compile=True)
    for context in (384, 3800):
        started = time.time()
        t = bench_gpu.time_forward(lm, 1, 1, context)
        out[f"{name}_context{context}"] = {"forward_1_ms": t * 1e3, "capacity": lm.capacity,
                                           "seconds": time.time() - started}
        print(name, context, out[f"{name}_context{context}"], flush=True)
        json.dump(out, open(f"{OUT}/probe8_h200.json", "w"), indent=1)
    del lm
    torch.cuda.empty_cache()
