"""Ran at commit 7a009e6 (2026-11-30), as benchmarks/probes/probe2.py (results committed with it); it
imports modules by their paths at that commit — check it out there to run it again."""
import sys, time, json, os, torch
from flashspec import bench_gpu, bench_kernels
bw = bench_kernels.measure_copy_bandwidth("cuda")
print("copy bw TB/s", bw / 1e12, flush=True)
t0 = time.time()
rows = bench_kernels.bench_verify("cuda", batches=(1, 64, 256), gammas=(1, 8), vocabs=(151936,), progress=False)
print("kernel bench s", time.time() - t0, flush=True)
print(bench_kernels.format_table(rows, bw), flush=True)
res = {"bw": bw, "kernels": rows}
for compile in (True,):
    t0 = time.time()
    t = bench_gpu.shaped_model("qwen2.5-1.5b"); d = bench_gpu.shaped_model("qwen2.5-0.5b", seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = {"random": [torch.randint(0, 151936, (256,), generator=gen).tolist()]}
    r = bench_gpu.bench_pair("qwen1.5b-shaped", t, d, prompts, bw, max_new_tokens=256, gamma=4, compile=compile)
    res[f"q-{compile}"] = r
    print(bench_gpu.summarize({"copy_bandwidth_bytes_per_second": bw, "machine": {"gpu": "h200"}, "pairs": [r]}), flush=True)
    print("warmup", r["warmup_seconds"], "total", time.time() - t0, flush=True)
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/probe2.json", "w"), indent=1, default=str)
