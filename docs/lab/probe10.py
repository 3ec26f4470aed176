"""Ran at commit a51f0c1 (2026-12-01), as benchmarks/probes/probe10.py (results committed with it); it
imports modules by their paths at that commit — check it out there to run it again.
Probe 10 (H200): the fused decode linear kernel (flashspec.decode_linear).
(1) GPU tests of the kernel and of StaticLM; (2) each linear map of the Qwen2.5-1.5B and
Llama-3-8B shapes alone: decode_linear (norm / SiLU·up / residual fused) against cuBLAS's plain
F.linear, at 1, 5 and 16 token rows, with the tile configuration the autotuner chose; (3) the
compiled decode forward (graph replay) with and without it, at widths 1, 5 and 16, plus a kernel
profile of the fused 1.5B forward; (4) width invariance: logits of 5 tokens fed at once vs one at
a time, with and without the fused maps.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe10.py
Table for BENCHMARKS.md:  PYTHONPATH=. python benchmarks/probes/probe10.py --report benchmarks/probes/probe10_h200.json
Each forward measurement runs in its own process.
The recorded run (probe10_h200.json) is of commit a51f0c1, where StaticLM's ``fuse_linear`` sent
all four maps of a layer through the kernel; since then only the output projection goes through
it (session 7's ``decode_maps = {"o"}``; now both ``decode_maps`` and ``decode_maps_wide`` are set
to it), so re-running part (3) measures that instead."""
import json, os, statistics, subprocess, sys, time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe9  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
RESULT = f"{OUT}/probe10_h200.json"
SHAPES = ("qwen2.5-1.5b", "llama3-8b")


def _graph_time(fn, iters=100, inner=20) -> float:
    """Median seconds of one ``fn()``, replaying a CUDA graph of ``inner`` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1000 / inner)
    return statistics.median(times)


def kernels_part(row_counts=(1, 5, 16)) -> dict:
    import torch.nn.functional as F

    from flashspec import bench_gpu
    from flashspec.decode_linear import _tuned, decode_linear

    out = {}
    for shape in SHAPES:
        config = bench_gpu.shaped_model(shape, device="meta").config
        hidden, inter = config.hidden_size, config.intermediate_size
        head = hidden // config.num_attention_heads
        qkv_n = hidden + 2 * config.num_key_value_heads * head
        bias = config.model_type == "qwen2"
        maps = {  # name: (N rows of the weight, K, options)
            "qkv+norm": (qkv_n, hidden, dict(norm=True, bias=bias)),
            "o+residual": (hidden, hidden, dict(residual=True)),
            "gate_up+norm+silu": (2 * inter, hidden, dict(norm=True, gated=True)),
            "down+residual": (hidden, inter, dict(residual=True)),
        }
        for name, (n, k, opts) in maps.items():
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if opts.get("bias") else None
            g = torch.ones(k, device="cuda", dtype=torch.bfloat16) if opts.get("norm") else None
            for rows in row_counts:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                out_n = n // 2 if opts.get("gated") else n
                r = torch.randn(rows, out_n, device="cuda", dtype=torch.bfloat16) if opts.get("residual") else None
                fused = _graph_time(lambda: decode_linear(x, weight, b, g, 1e-6, r, bool(opts.get("gated"))))
                plain = _graph_time(lambda: F.linear(x, weight, b))
                key = f"{shape}|{name}|{rows}"
                out[key] = {"fused_us": fused * 1e6, "cublas_linear_us": plain * 1e6, "weight_bytes": n * k * 2,
                            "fused_TBps": n * k * 2 / fused / 1e12, "cublas_TBps": n * k * 2 / plain / 1e12}
                print(key, {a: round(v, 2) for a, v in out[key].items()}, flush=True)
    out["configs"] = {str(key): str(cfg) for key, cfg in _tuned.cache.items()}
    return out


def forward_part(shape: str, fuse: bool, widths: list[int], profile: bool) -> dict:
    from flashspec import bench_gpu
    from flashspec.cache import StaticLM

    lm = StaticLM(bench_gpu.shaped_model(shape), compile=True)
    out = {"fusable": "o" in lm.decode_maps}
    lm.decode_maps = lm.decode_maps_wide = {"o"} if fuse else set()
    return {**out, **probe9.measure(lm, widths, profile)}


def invariance_part(variants=None) -> dict:
    """Logits of 5 tokens fed in one forward vs one forward per token (eager, 1.5B shape), for
    each ``name: decode_maps`` of ``variants``."""
    from flashspec import bench_gpu
    from flashspec.cache import StaticLM

    model = bench_gpu.shaped_model("qwen2.5-1.5b")
    out = {}
    for name, maps in (variants or {"fuse=0": set(), "fuse=1": {"o"}}).items():
        lm = StaticLM(model)
        lm.decode_maps = maps
        lm.reset(1, 768)
        gen = torch.Generator().manual_seed(0)
        lm.forward(torch.randint(0, 1000, (1, 300), generator=gen).cuda(), torch.zeros(1, dtype=torch.long, device="cuda"))
        tokens = torch.randint(0, 1000, (1, 5), generator=gen).cuda()
        wide = lm.forward(tokens, torch.full((1,), 300, device="cuda"))[0].float()
        single = torch.cat([lm.forward(tokens[:, j:j + 1], torch.full((1,), 300 + j, device="cuda"))[0]
                            for j in range(5)]).float()
        out[name] = {"rows_bit_equal": int((wide == single).all(-1).sum()),
                                    "max_abs_diff": float((wide - single).abs().max()),
                                    "argmax_equal": int((wide.argmax(-1) == single.argmax(-1)).sum())}
    return out


def child(spec: dict, env: dict | None = None, script: str = __file__) -> dict:
    """Run one part of ``script`` in a process of its own; its last line of output is JSON."""
    cmd = [sys.executable, script, json.dumps(spec)]
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
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_decode_linear.py",
         "tests/test_rope_kv.py", "tests/test_gpu.py"], capture_output=True, text=True)
    out["tests"] = {"rc": tests.returncode, "tail": tests.stdout[-3000:], "seconds": time.time() - begin}
    print(out["tests"]["tail"][-800:], flush=True)
    save()
    out["kernels"] = child({"part": "kernels"})
    save()
    out["invariance"] = child({"part": "invariance"})
    print("invariance", out["invariance"], flush=True)
    save()
    for shape in SHAPES:
        for fuse in (False, True):
            key = f"{shape}_linear={int(fuse)}"
            out[key] = child({"part": "forward", "shape": shape, "fuse": fuse, "widths": [1, 5, 16],
                              "profile": fuse})
            print(key, {k: v for k, v in out[key].items() if k != "profile"}, flush=True)
            save()
    print("probe10 done", flush=True)


def report(path: str) -> str:
    """The tables of BENCHMARKS.md from the raw JSON (roofline fractions use the copy bandwidth
    of the 2026-12-01 `gpu_h200.sh` run, 4.19 TB/s: probe 10 did not measure it)."""
    from flashspec import bench_gpu

    data = json.load(open(path))
    bandwidth = 4.19e12
    lines = ["| shape | width | cuBLAS + inductor | decode_linear | change | roofline (forward) | of roofline |",
             "|---|---|---|---|---|---|---|"]
    for shape in SHAPES:
        model = bench_gpu.shaped_model(shape, device="meta")
        roofline = (bench_gpu.weight_bytes_per_token(model) + bench_gpu.kv_bytes_per_token(model, 384)) / bandwidth
        for width in (1, 5, 16):
            a = data[f"{shape}_linear=0"][f"forward_{width}_ms"]
            b = data[f"{shape}_linear=1"][f"forward_{width}_ms"]
            lines.append(f"| {shape} | {width} | {a:.3f} ms | {b:.3f} ms | {b / a - 1:+.1%} | "
                         f"{roofline * 1e3:.3f} ms | {roofline * 1e3 / b:.1%} |")
    return "\n".join(lines + [""] + kernel_table(data["kernels"]))


def kernel_table(kernels: dict) -> list[str]:
    """The per-map table (cuBLAS against decode_linear) of a kernels part's results."""
    lines = ["| shape | map | rows | cuBLAS F.linear alone | decode_linear (fused) | TB/s fused |",
             "|---|---|---|---|---|---|"]
    for key, value in kernels.items():
        if key == "configs":
            continue
        shape, name, rows = key.split("|")
        lines.append(f"| {shape} | {name} | {rows} | {value['cublas_linear_us']:.1f} µs | {value['fused_us']:.1f} µs "
                     f"| {value['fused_TBps']:.2f} |")
    return lines


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    elif len(sys.argv) > 1:
        spec = json.loads(sys.argv[1])
        if spec["part"] == "forward":
            result = forward_part(spec["shape"], spec["fuse"], spec["widths"], spec["profile"])
        elif spec["part"] == "kernels":
            result = kernels_part()
        else:
            result = invariance_part()
        print(json.dumps(result))
    else:
        main()
