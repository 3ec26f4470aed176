"""Ran at commit 24f4e24 (2026-12-01), as benchmarks/probes/probe5.py (results committed in 3e3f469);
it imports modules by their paths at that commit — check it out there to run it again.
Where the speculative step's time outside the model forwards goes (H200): Qwen2.5-1.5B-shaped
target, 0.5B-shaped drafter (random weights; step costs do not depend on values), compile on,
γ = 4, 256-token prompt, 256 new tokens. Per-step times from the engine's step log (mean vs
median: the first step of a request re-feeds the whole prompt to the drafter), the forwards
alone, and a profiler table of one request."""
import json, os, statistics, torch
from flashspec import bench_gpu
from flashspec.engine import SpeculativeEngine

out_dir = os.environ.get("OUT", "/tmp")
target = bench_gpu.shaped_model("qwen2.5-1.5b")
drafter = bench_gpu.shaped_model("qwen2.5-0.5b", seed=1)
prompt = torch.randint(0, 151936, (256,), generator=torch.Generator().manual_seed(0)).tolist()
result = {}
for name, drafters in (("target_only", []), ("speculative", [drafter])):
    engine = SpeculativeEngine(target, drafters, compile=True)
    for _ in range(2):
        engine.generate([prompt], max_new_tokens=256, num_draft_tokens=4, eos_token_id=[])
    runs = [engine.generate([prompt], max_new_tokens=256, num_draft_tokens=4, eos_token_id=[]) for _ in range(3)]
    steps = [r.seconds for o in runs for r in o.stats.step_log]
    firsts = [o.stats.step_log[0].seconds for o in runs]
    result[name] = {"mean_step_ms": 1e3 * statistics.mean(steps), "median_step_ms": 1e3 * statistics.median(steps),
                    "first_step_ms": [1e3 * f for f in firsts], "steps_per_request": len(runs[0].stats.step_log),
                    "decode_seconds": [o.stats.decode_seconds for o in runs],
                    "sum_step_seconds": [sum(r.seconds for r in o.stats.step_log) for o in runs]}
    print(name, json.dumps(result[name]), flush=True)
    if drafters:
        lm_t, lm_d = engine._target_lm, engine.drafters[0]._lm
        result["forwards_ms"] = {k: 1e3 * v for k, v in {
            "target_1": bench_gpu.time_forward(lm_t, 1, 1, 384), "target_5": bench_gpu.time_forward(lm_t, 1, 5, 384),
            "drafter_1": bench_gpu.time_forward(lm_d, 1, 1, 384), "drafter_2": bench_gpu.time_forward(lm_d, 1, 2, 384)}.items()}
        print(result["forwards_ms"], flush=True)
        engine.generate([prompt], max_new_tokens=256, num_draft_tokens=4, eos_token_id=[])  # re-capture after time_forward
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            engine.generate([prompt], max_new_tokens=64, num_draft_tokens=4, eos_token_id=[])
            torch.cuda.synchronize()
        with open(f"{out_dir}/probe5_profile.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
            f.write("\n\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
json.dump(result, open(f"{out_dir}/probe5.json", "w"), indent=1)
