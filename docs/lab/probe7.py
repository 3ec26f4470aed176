"""Ran at commit 3181ee7 (2026-12-01), as benchmarks/probes/probe7.py (results committed with it; its
two-kernel verify was reverted in 9607e4b); it imports modules by their paths at that commit — check
it out there to run it again.
Probe 7 (H200): the two-kernel verify (last program to arrive) against probe 2's five kernels,
and where the Llama-3-8B-shaped decode forward spends its time (default inductor settings
against coordinate-descent tuning). Run from the repo root after the GPU tests:
    PYTHONPATH=. python benchmarks/probes/probe7.py
"""
import json, os, statistics, time

import torch
from torch.profiler import ProfilerActivity, profile

from flashspec import bench_gpu, bench_kernels

OUT = os.environ.get("OUT", "/tmp")
out = {}


def save():
    json.dump(out, open(f"{OUT}/probe7_h200.json", "w"), indent=1)


out["copy_bandwidth"] = bw = bench_kernels.measure_copy_bandwidth("cuda")
print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
rows = bench_kernels.bench_verify("cuda", batches=(1, 64, 256), gammas=(1, 4, 8), vocabs=(32000, 151936),
                                  modes=("greedy", "temperature"), progress=False)
out["kernels"] = rows
print(bench_kernels.format_table(rows, bw), flush=True)
save()

model = bench_gpu.shaped_model("llama3-8b")
for tuning in (False, True):
    torch._dynamo.reset()
    torch._inductor.config.coordinate_descent_tuning = tuning
    lm = bench_gpu.StaticLM(model, compile=True)
    started = time.time()
    t1 = bench_gpu.time_forward(lm, 1, 1, 384)
    t5 = bench_gpu.time_forward(lm, 1, 5, 384)
    key = f"llama3-8b_tuning={tuning}"
    out[key] = {"forward_1_ms": t1 * 1e3, "forward_5_ms": t5 * 1e3, "warm_s": time.time() - started}
    print(key, out[key], flush=True)
    if not tuning:
        lm.reset(1, 768)
        tok = torch.randint(0, 1000, (1, 1), device="cuda")
        start = torch.full((1,), 384, device="cuda")
        from flashspec.graphs import Graphs
        g = Graphs(enabled=True)
        for _ in range(3):
            g.run("f", lambda: lm.forward(tok, start))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.run("f", lambda: lm.forward(tok, start))
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
        print(table, flush=True)
        out["profile_8b"] = table
    save()
    del lm
    torch.cuda.empty_cache()
