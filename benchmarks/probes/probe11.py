"""Probe 11 (H200): decode_linear with CUDA-core tiles beside the tensor-core ones, and which
maps StaticLM should send through it.
(1) GPU tests of the kernel and of StaticLM's decode maps; (2) each linear map of the
Qwen2.5-1.5B and Llama-3-8B shapes alone, decode_linear (autotuned over both inner products)
against cuBLAS's F.linear, at 1 and 5 token rows, with the configuration the autotuner chose;
(3) side by side in one process per shape, the compiled decode forward (graph replay, widths 1
and 5) with StaticLM.decode_maps = none, {o}, {o, down}, all four — two rounds, so drift between
variants shows; (4) width invariance with no maps and with all four.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe11.py
Table for BENCHMARKS.md:  PYTHONPATH=. python benchmarks/probes/probe11.py --report benchmarks/probes/probe11_h200.json"""
import json, os, subprocess, sys, time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe10 import SHAPES, _graph_time  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
RESULT = f"{OUT}/probe11_h200.json"
VARIANTS = {"none": set(), "o": {"o"}, "o+down": {"o", "down"}, "all": {"qkv", "o", "gate_up", "down"}}


def kernels_part() -> dict:
    import torch.nn.functional as F

    from flashspec import bench_gpu
    from flashspec.decode_linear import _tuned, decode_linear

    out = {}
    for shape in SHAPES:
        config = bench_gpu.shaped_model(shape, device="meta").config
        hidden, inter = config.hidden_size, config.intermediate_size
        head = hidden // config.num_attention_heads
        bias = config.model_type == "qwen2"
        maps = {
            "qkv+norm": (hidden + 2 * config.num_key_value_heads * head, hidden, dict(norm=True, bias=bias)),
            "o+residual": (hidden, hidden, dict(residual=True)),
            "gate_up+norm+silu": (2 * inter, hidden, dict(norm=True, gated=True)),
            "down+residual": (hidden, inter, dict(residual=True)),
        }
        for name, (n, k, opts) in maps.items():
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if opts.get("bias") else None
            g = torch.ones(k, device="cuda", dtype=torch.bfloat16) if opts.get("norm") else None
            for rows in (1, 5):
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


def forward_part(shape: str) -> dict:
    from flashspec import bench_gpu
    from flashspec.cache import StaticLM

    lm = StaticLM(bench_gpu.shaped_model(shape), compile=True)
    out = {}
    started = time.time()
    for round_ in (1, 2):
        for name, maps in VARIANTS.items():
            lm.decode_maps = maps
            for width in (1, 5):
                out[f"round{round_}|{name}|{width}"] = bench_gpu.time_forward(lm, 1, width, 384) * 1e3
        out[f"round{round_}_done_s"] = time.time() - started
    return out


def invariance_part() -> dict:
    """Logits of 5 tokens fed in one forward vs one forward per token (eager, 1.5B shape)."""
    from flashspec import bench_gpu
    from flashspec.cache import StaticLM

    model = bench_gpu.shaped_model("qwen2.5-1.5b")
    out = {}
    for name in ("none", "all"):
        lm = StaticLM(model)
        lm.decode_maps = VARIANTS[name]
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


def child(spec: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    out = {}

    def save():
        json.dump(out, open(RESULT, "w"), indent=1)

    begin = time.time()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_decode_linear.py"],
                           capture_output=True, text=True)
    out["tests"] = {"rc": tests.returncode, "tail": tests.stdout[-3000:], "seconds": time.time() - begin}
    print(out["tests"]["tail"][-600:], flush=True)
    save()
    out["kernels"] = child({"part": "kernels"})
    save()
    for shape in SHAPES:
        out[f"forward|{shape}"] = child({"part": "forward", "shape": shape})
        print(shape, out[f"forward|{shape}"], flush=True)
        save()
    out["invariance"] = child({"part": "invariance"})
    print("invariance", out["invariance"], flush=True)
    save()
    print("probe11 done", flush=True)


def report(path: str) -> str:
    data = json.load(open(path))
    lines = ["| shape | width | " + " | ".join(f"maps: {v} (round 1 / 2)" for v in VARIANTS) + " |",
             "|---|---|" + "---|" * len(VARIANTS)]
    for shape in SHAPES:
        f = data[f"forward|{shape}"]
        for width in (1, 5):
            cells = [f"{f[f'round1|{v}|{width}']:.3f} / {f[f'round2|{v}|{width}']:.3f} ms" for v in VARIANTS]
            lines.append(f"| {shape} | {width} | " + " | ".join(cells) + " |")
    lines += ["", "| shape | map | rows | cuBLAS F.linear alone | decode_linear | TB/s |", "|---|---|---|---|---|---|"]
    for key, value in data["kernels"].items():
        if key != "configs":
            shape, name, rows = key.split("|")
            lines.append(f"| {shape} | {name} | {rows} | {value['cublas_linear_us']:.1f} µs | "
                         f"{value['fused_us']:.1f} µs | {value['fused_TBps']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    elif len(sys.argv) > 1:
        spec = json.loads(sys.argv[1])
        part = spec["part"]
        result = (kernels_part() if part == "kernels" else forward_part(spec["shape"]) if part == "forward"
                  else invariance_part())
        print(json.dumps(result))
    else:
        main()
