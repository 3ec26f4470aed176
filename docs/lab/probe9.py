"""Ran at commit 51ecc2e (2026-12-01), as benchmarks/probes/probe9.py (results committed with it); it
imports modules by their paths at that commit — check it out there to run it again.
Probe 9 (H200): (1) the GPU tests after the fused rotary + cache-write kernel, and the engine's
χ² tests on CUDA with queue_ahead on; (2) the decode forward with and without that kernel and with
inductor's programmatic dependent launch (PDL), for the Qwen2.5-1.5B and Llama-3-8B shapes, plus
the 1.5B's forward cost at verify widths 5-16 (the n-gram drafter's γ); (3) time to first token:
prefills of prompt lengths not seen before, with cuDNN's SDPA allowed and not.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe9.py
Table for BENCHMARKS.md:  PYTHONPATH=. python benchmarks/probes/probe9.py --report benchmarks/probes/probe9_h200.json
Each measurement runs in its own process (PDL is an inductor setting read at compile time; the
cuDNN plan cache lives per process)."""
import json, os, subprocess, sys, time

import torch

OUT = os.environ.get("OUT", "/tmp")
RESULT = f"{OUT}/probe9_h200.json"


def forward_part(shape: str, fuse: bool, widths: list[int], profile: bool) -> dict:
    from flashspec import bench_gpu
    from flashspec.cache import StaticLM

    lm = StaticLM(bench_gpu.shaped_model(shape), compile=True)
    lm.fuse_rope = fuse
    return measure(lm, widths, profile)


def measure(lm, widths: list[int], profile: bool) -> dict:
    """Graph-replayed forward times at each width after 384 tokens, the warm-up's seconds, and
    (``profile``) a kernel table of five 1-token forwards. Probe 10 uses it too."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from flashspec import bench_gpu
    from flashspec.graphs import Graphs

    out = {}
    started = time.time()
    for width in widths:
        out[f"forward_{width}_ms"] = bench_gpu.time_forward(lm, 1, width, 384) * 1e3
    out["warm_s"] = time.time() - started
    if profile:
        lm.reset(1, 768)
        tok = torch.randint(0, 1000, (1, 1), device="cuda")
        start = torch.full((1,), 384, device="cuda")
        g = Graphs(enabled=True)
        for _ in range(3):
            g.run("f", lambda: lm.forward(tok, start))
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.run("f", lambda: lm.forward(tok, start))
            torch.cuda.synchronize()
        out["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                                   max_name_column_width=90)
    return out


def ttft_part(cudnn: bool) -> dict:
    from flashspec import bench_gpu
    from flashspec.cache import StaticLM
    from flashspec.engine import SpeculativeEngine

    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    model = bench_gpu.shaped_model("qwen2.5-1.5b")
    lm = StaticLM(model)
    lm.reset(1, 1024)

    def timed(fn):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - begin) * 1e3

    out = {"prefill_first_ms": {}, "prefill_again_ms": {}, "engine_first_ms": {}, "engine_again_ms": {}}
    zero = torch.zeros(1, dtype=torch.long, device="cuda")
    timed(lambda: lm.forward(torch.randint(0, 1000, (1, 64), device="cuda"), zero))  # CUDA context, cuBLAS
    for length in (101, 137, 171, 203, 244, 250):
        tokens = torch.randint(0, 1000, (1, length), device="cuda")
        out["prefill_first_ms"][length] = timed(lambda: lm.forward(tokens, zero))
        out["prefill_again_ms"][length] = timed(lambda: lm.forward(tokens, zero))
    engine = SpeculativeEngine(model, compile=False)
    engine.generate([list(range(5, 69))], max_new_tokens=2)
    for length in (103, 139, 173, 205, 246, 252):
        prompt = [list(range(5, 5 + length))]
        out["engine_first_ms"][length] = timed(lambda: engine.generate(prompt, max_new_tokens=1))
        out["engine_again_ms"][length] = timed(lambda: engine.generate(prompt, max_new_tokens=1))
    return out


def child(spec: dict, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    out = {}

    def save():
        json.dump(out, open(RESULT, "w"), indent=1)

    begin = time.time()
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_rope_kv.py", "tests/test_gpu.py",
         "tests/test_distribution.py", "-k", "cuda or rope or gpu or Gpu or graph or sync"],
        capture_output=True, text=True)
    out["tests"] = {"rc": tests.returncode, "tail": tests.stdout[-3000:], "seconds": time.time() - begin}
    print(out["tests"]["tail"][-600:], flush=True)
    save()
    runs = [
        ("qwen2.5-1.5b", False, False, [1], True),
        ("qwen2.5-1.5b", True, False, [1, 5, 9, 13, 16], True),
        ("qwen2.5-1.5b", True, True, [1], False),
        ("llama3-8b", False, False, [1], False),
        ("llama3-8b", True, False, [1], True),
        ("llama3-8b", True, True, [1], False),
    ]
    for shape, fuse, pdl, widths, prof in runs:
        key = f"{shape}_fuse={int(fuse)}_pdl={int(pdl)}"
        out[key] = child({"part": "forward", "shape": shape, "fuse": fuse, "widths": widths, "profile": prof},
                         {"TORCHINDUCTOR_ENABLE_PDL": "1" if pdl else "0"})
        print(key, {k: v for k, v in out[key].items() if k != "profile"}, flush=True)
        save()
    for cudnn in (True, False):
        key = f"ttft_cudnn={int(cudnn)}"
        out[key] = child({"part": "ttft", "cudnn": cudnn})
        print(key, out[key], flush=True)
        save()
    print("probe9 done", flush=True)


def report(path: str) -> str:
    """The forward table of BENCHMARKS.md from the raw JSON (fractions of the roofline use the
    copy bandwidth of the 2026-12-01 `gpu_h200.sh` run, 4.19 TB/s: probe 9 did not measure it)."""
    from flashspec import bench_gpu

    data = json.load(open(path))
    bandwidth = 4.19e12
    lines = ["| shape | model's rotation + write_kv | rope_write_kv | + inductor PDL | roofline (forward) | fused, of roofline |",
             "|---|---|---|---|---|---|"]
    for shape in ("qwen2.5-1.5b", "llama3-8b"):
        model = bench_gpu.shaped_model(shape, device="meta")
        roofline = (bench_gpu.weight_bytes_per_token(model) + bench_gpu.kv_bytes_per_token(model, 384)) / bandwidth
        t = [data[f"{shape}_fuse={f}_pdl={p}"]["forward_1_ms"] for f, p in ((0, 0), (1, 0), (1, 1))]
        lines.append(f"| {shape} | {t[0]:.3f} ms | {t[1]:.3f} ms ({t[1] / t[0] - 1:+.1%}) | {t[2]:.3f} ms "
                     f"({t[2] / t[1] - 1:+.1%}) | {roofline * 1e3:.3f} ms | {roofline * 1e3 / t[1]:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    elif len(sys.argv) > 1:
        spec = json.loads(sys.argv[1])
        if spec["part"] == "forward":
            result = forward_part(spec["shape"], spec["fuse"], spec["widths"], spec["profile"])
        else:
            result = ttft_part(spec["cudnn"])
        print(json.dumps(result))
    else:
        main()
