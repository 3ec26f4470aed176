"""Ran at commit 7a009e6 (2026-11-30), as benchmarks/probes/probe.py (probe 1; results committed with
it); it imports modules by their paths at that commit — check it out there to run it again."""
import sys, time, json, torch
from flashspec import bench_gpu
x = torch.empty(2**30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
ts = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) / 1e3)
ts.sort(); bw = 2 * 2**30 / ts[len(ts) // 2]; del x, y
print("copy bw TB/s", bw / 1e12, flush=True)
res = {"bw": bw}
for compile in (False, True):
    for name, dname in (("llama3-8b", "llama3-1b"),):
        t0 = time.time()
        t = bench_gpu.shaped_model(name); d = bench_gpu.shaped_model(dname, seed=1)
        print("built", time.time() - t0, flush=True)
        gen = torch.Generator().manual_seed(0)
        prompts = {"random": [torch.randint(0, 128256, (256,), generator=gen).tolist()]}
        r = bench_gpu.bench_pair(name, t, d, prompts, bw, max_new_tokens=128, gamma=4, compile=compile)
        res[f"{name}-{compile}"] = r
        print(json.dumps({k: v for k, v in r.items() if k != "rows"}, indent=0), flush=True)
        print(bench_gpu.summarize({"copy_bandwidth_bytes_per_second": bw, "machine": {"gpu": "h200"}, "pairs": [r]}), flush=True)
        del t, d; torch.cuda.empty_cache()
import os
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/probe.json", "w"), indent=1, default=str)
