"""Ran at commit 4ab20dd (2026-12-01), as benchmarks/probes/probe13.py (results committed in 8fc9f72;
--report added in d8afdcd); it imports modules by their paths at that commit — check it out there
(d8afdcd for --report) to run it again.
Probe 13 (H200): a pre-flight for the official run, plus one side-by-side measurement.
(1) decode_linear autotuned per row class on the Qwen2.5-1.5B and Llama-3-8B shapes' matrices
(1 and 5 rows) against its reference, and the configuration the autotuner chose for each;
(2) target-only greedy decoding of the 1.5B shape (random weights, compile=True, batch 1) with
the step's bookkeeping compiled (the default with compile=True) and eager, alternating, two rounds:
tokens/s and the step time outside the forward.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe13.py
Table for NOTES.md:      PYTHONPATH=. python benchmarks/probes/probe13.py --report benchmarks/probes/probe13_h200.json"""
import json, os, statistics, sys, time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe12  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")


def kernels() -> dict:
    from flashspec.decode_linear import _tuned, decode_linear, decode_linear_reference

    out = {}
    for shape in probe12.SHAPES:
        for name, (n, k, opts) in probe12.maps(shape).items():
            for rows in (1, 5):
                p = probe12.Problem(n, k, opts, rows, copies=1)
                y = decode_linear(p.x, p.weights[0], p.bias, p.norm, 1e-6, p.residual, p.gated)
                ref = decode_linear_reference(p.x, p.weights[0], p.bias, p.norm, 1e-6, p.residual, p.gated)
                rel = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                out[f"{shape}|{name}|{rows}"] = rel
                print(shape, name, rows, f"rel error {rel:.2e}", flush=True)
    out["configs"] = {str(key): str(cfg) for key, cfg in _tuned.cache.items()}
    return out


def bookkeeping(rounds: int = 2, new_tokens: int = 192) -> dict:
    from flashspec import SpeculativeEngine, bench_gpu
    from flashspec.engine import commit_step

    model = bench_gpu.shaped_model("qwen2.5-1.5b")
    engine = SpeculativeEngine(model, [], compile=True)
    compiled = engine._commit_step
    prompts = [torch.randint(0, 1000, (n,)).tolist() for n in (300, 380, 340)]
    forward = None
    out = {}
    for round_ in range(1, rounds + 1):
        for label, fn in (("compiled", compiled), ("eager", commit_step)):
            engine._commit_step = fn
            engine._graphs.clear()
            engine.generate([prompts[0]], max_new_tokens=16, eos_token_id=[])  # capture
            rates, steps = [], []
            for p in prompts:
                torch.cuda.synchronize()
                result = engine.generate([p], max_new_tokens=new_tokens, eos_token_id=[])
                rates.append(result.stats.tokens_per_second)
                steps.append(statistics.median(r.seconds for r in result.stats.step_log[4:]))
            if forward is None:
                forward = bench_gpu.time_forward(engine._target_lm, 1, 1, 340)
            out[f"round{round_}|{label}"] = {"tokens_per_s": rates, "median_step_s": steps,
                                             "outside_forward": [1 - forward / s for s in steps]}
            print(round_, label, [round(r, 1) for r in rates], [f"{1 - forward / s:.1%}" for s in steps], flush=True)
    out["forward_s"] = forward
    return out


def report(path: str) -> str:
    """The bookkeeping table of NOTES.md from the raw JSON."""
    data = json.load(open(path))["bookkeeping"]
    forward = data["forward_s"] * 1e3
    lines = [f"| round | bookkeeping | median step (ms) | outside the forward ({forward:.3f} ms) |", "|---|---|---|---|"]
    for key, value in data.items():
        if "|" not in key:
            continue
        round_, label = key.split("|")
        steps, outside = value["median_step_s"], value["outside_forward"]
        lines.append(f"| {round_[5:]} | {label} | {min(steps) * 1e3:.3f}–{max(steps) * 1e3:.3f} | "
                     f"{min(outside):.1%}–{max(outside):.1%} |")
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--report":
    print(report(sys.argv[2]))
elif __name__ == "__main__":
    begin = time.time()
    result = {"kernels": kernels()}
    result["kernels_s"] = time.time() - begin
    result["bookkeeping"] = bookkeeping()
    result["total_s"] = time.time() - begin
    json.dump(result, open(f"{OUT}/probe13_h200.json", "w"), indent=1)
    print("probe13 done", round(result["total_s"]), "s", flush=True)
