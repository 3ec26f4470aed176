"""Ran at commit 9e4c7b7 (2026-11-30), as benchmarks/probes/probe3.py (results committed with it); it
imports modules by their paths at that commit — check it out there to run it again.
Where does a Qwen2.5-1.5B-shaped decode forward spend its time? (kernel profile, H200)"""
import os, json, time, torch
from torch.profiler import profile, ProfilerActivity
from flashspec import bench_gpu
from flashspec.cache import StaticLM

out = {}
model = bench_gpu.shaped_model("qwen2.5-1.5b")
for compile in (False, True):
    lm = StaticLM(model, compile=compile)
    lm.reset(1, 768)
    tok = torch.randint(0, 1000, (1, 1), device="cuda"); start = torch.full((1,), 300, device="cuda")
    t0 = time.time()
    for _ in range(3):
        lm.forward(tok, start)
    torch.cuda.synchronize(); out[f"warm_{compile}"] = time.time() - t0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            lm.forward(tok, start)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70)
    print(f"=== compile={compile}", table, flush=True)
    out[f"table_{compile}"] = table
    evs = [e for e in prof.key_averages()]
    out[f"kernels_per_forward_{compile}"] = sum(e.count for e in evs if e.device_type.name == "CUDA") / 5
    print("kernels per forward", out[f"kernels_per_forward_{compile}"], flush=True)
# GEMV alone at the layer's shapes (bf16, M = 1), graph-free, events
x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
for n, k in ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16); xx = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(10): torch.nn.functional.linear(xx, w)
    ts = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); torch.nn.functional.linear(xx, w); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000)
    ts.sort(); us = ts[25]
    print(f"gemv {n}x{k}: {us:.1f} us, {2*n*k/us/1e6:.2f} TB/s", flush=True)
    out[f"gemv_{n}x{k}_us"] = us
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/probe3.json", "w"), indent=1)
