"""Ran at commit 8fc9f72 (2026-12-01), as benchmarks/probes/probe14.py (results committed in d8afdcd);
it imports modules by their paths at that commit — check it out there to run it again.
Probe 14 (H200): target-only decoding end to end with StaticLM.decode_maps = {o, down} (the
default) and {qkv, o, down}, side by side, alternating, two rounds; Qwen2.5-1.5B and Llama-3-8B
shapes (random weights), batch 1, compile=True, 3 prompts × 256 new tokens. The official run's
maps table found {qkv, o, down} 5 % faster per one-row forward on the real 1.5B and even on the
8B shape; this measures tokens/s.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe14.py"""
import json, os, statistics, time

import torch

OUT = os.environ.get("OUT", "/tmp")
VARIANTS = {"o+down": {"o", "down"}, "qkv+o+down": {"qkv", "o", "down"}}


def main() -> None:
    from flashspec import SpeculativeEngine, bench_gpu

    out = {}
    begin = time.time()
    for shape in ("qwen2.5-1.5b", "llama3-8b"):
        engine = SpeculativeEngine(bench_gpu.shaped_model(shape), [], compile=True)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 1000, (256,), generator=gen).tolist() for _ in range(3)]
        for round_ in (1, 2):
            for label, maps in VARIANTS.items():
                engine._target_lm.decode_maps = maps
                engine._graphs.clear()
                engine.generate([prompts[0]], max_new_tokens=16, eos_token_id=[])  # compile, capture
                rates = []
                for p in prompts:
                    torch.cuda.synchronize()
                    rates.append(engine.generate([p], max_new_tokens=256, eos_token_id=[]).stats.tokens_per_second)
                out[f"{shape}|round{round_}|{label}"] = rates
                out["elapsed_s"] = time.time() - begin
                json.dump(out, open(f"{OUT}/probe14_h200.json", "w"), indent=1)
                print(shape, round_, label, [round(r, 1) for r in rates], round(time.time() - begin), "s", flush=True)
        del engine
        torch.cuda.empty_cache()
    print("probe14 done", flush=True)


def report(path: str) -> str:
    data = json.load(open(path))
    lines = ["| shape | round | " + " | ".join(f"{v} tok/s (median of 3)" for v in VARIANTS) + " | ratio |",
             "|---|---|" + "---|" * len(VARIANTS) + "---|"]
    for shape in ("qwen2.5-1.5b", "llama3-8b"):
        for round_ in (1, 2):
            cells = [statistics.median(data[f"{shape}|round{round_}|{v}"]) for v in VARIANTS
                     if f"{shape}|round{round_}|{v}" in data]
            if len(cells) == len(VARIANTS):
                lines.append(f"| {shape} | {round_} | " + " | ".join(f"{c:.1f}" for c in cells)
                             + f" | {cells[1] / cells[0]:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    else:
        main()
