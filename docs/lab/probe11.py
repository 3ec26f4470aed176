"""Never run (no results file, no NOTES.md section; probe 12 took its place): written at commit ac0f6bd
(2026-12-01), last changed at df5c050 (2026-12-01), as benchmarks/probes/probe11.py; it imports
modules by their paths at that commit — check it out there to run it.
Probe 11 (H200): decode_linear with CUDA-core tiles beside the tensor-core ones, and which
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe10  # noqa: E402
from probe10 import SHAPES  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
RESULT = f"{OUT}/probe11_h200.json"
VARIANTS = {"none": set(), "o": {"o"}, "o+down": {"o", "down"}, "all": {"qkv", "o", "gate_up", "down"}}


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


def child(spec: dict) -> dict:
    return probe10.child(spec, script=__file__)


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
    return "\n".join(lines + [""] + probe10.kernel_table(data["kernels"]))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    elif len(sys.argv) > 1:
        spec = json.loads(sys.argv[1])
        part = spec["part"]
        if part == "kernels":
            result = probe10.kernels_part(row_counts=(1, 5))
        elif part == "forward":
            result = forward_part(spec["shape"])
        else:
            result = probe10.invariance_part({name: VARIANTS[name] for name in ("none", "all")})
        print(json.dumps(result))
    else:
        main()
