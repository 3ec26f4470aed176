"""Ran at commit eec2413 (2026-12-01), as benchmarks/probes/probe12.py (results committed in 4ab20dd);
it imports modules by their paths at that commit — check it out there to run it again.
Probe 12 (H200): every decode_linear tile configuration against cuBLAS, with the weights cold.

Each linear map of the Qwen2.5-1.5B and Llama-3-8B shapes (qkv + norm, o + residual,
gate/up + norm + SiLU·up, down + residual), at 1 and 5 token rows. Unlike probe 10, whose 20
calls re-read one weight matrix (the 1.5B's 4.7-27.5 MB matrices then sit in the 50 MB L2), a
call here reads the next of enough copies of the matrix to overflow the L2 (≥ 320 MB per round),
as the layers of a real forward do. Every configuration is timed on its own (a CUDA graph of one
round, median of 15 replays), beside cuBLAS's plain ``F.linear`` on the same copies: the
tensor-core tiles, and the CUDA-core tiles with and without ``PREFETCH`` (the next weight block
loaded one iteration ahead) over a wider range of tile shapes than the autotuner's list.
Compilation is done first, by parallel processes that fill Triton's on-disk cache.
The recorded run (probe12_h200.json) is of commit eec2413, whose kernel could also load the next
weight block one iteration ahead (``PREFETCH``, the ``cc+pf`` rows); it never won and was removed,
so the probe now times the other configurations only.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe12.py
Summary:                 PYTHONPATH=. python benchmarks/probes/probe12.py --report benchmarks/probes/probe12_h200.json"""
import json, os, statistics, subprocess, sys, time

import torch

OUT = os.environ.get("OUT", "/tmp")
RESULT = f"{OUT}/probe12_h200.json"
SHAPES = ("qwen2.5-1.5b", "llama3-8b")
ROWS = (1, 5)
ROUND_BYTES = 320 << 20  # bytes of weights read per timed round: well over the H200's 50 MB L2


def candidates() -> list[dict]:
    """Every configuration tried: name → kernel meta-parameters, warps, stages."""
    out = []
    for block_n, block_k in ((16, 256), (16, 512), (32, 256), (32, 512), (64, 256)):
        for warps in (4, 8):
            out.append(dict(USE_DOT=True, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=False, warps=warps, stages=3))
    tiles = ((1, 2048), (2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048), (8, 256), (8, 512), (8, 1024),
             (16, 256), (16, 512))
    for block_n, block_k in tiles:
        for warps in (4, 8):
            out.append(dict(USE_DOT=False, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=False, warps=warps,
                            stages=1))
    return out


def label(c: dict) -> str:
    kind = "tc" if c["USE_DOT"] else ("cc+pf" if c["PREFETCH"] else "cc")
    return f"{kind} {c['BLOCK_N']}x{c['BLOCK_K']} w{c['warps']}"


def maps(shape: str) -> dict:
    """name → (weight rows N, K, options) of one layer of ``shape``."""
    from flashspec import bench_gpu

    config = bench_gpu.shaped_model(shape, device="meta").config
    hidden, inter = config.hidden_size, config.intermediate_size
    head = hidden // config.num_attention_heads
    qkv_n = hidden + 2 * config.num_key_value_heads * head
    bias = config.model_type == "qwen2"
    return {
        "qkv+norm": (qkv_n, hidden, dict(norm=True, bias=bias)),
        "o+residual": (hidden, hidden, dict(residual=True)),
        "gate_up+norm+silu": (2 * inter, hidden, dict(norm=True, gated=True)),
        "down+residual": (hidden, inter, dict(residual=True)),
    }


class Problem:
    """The copies of one map's weights and its inputs, at ``rows`` token rows."""

    def __init__(self, n: int, k: int, opts: dict, rows: int, copies: int | None = None) -> None:
        dev, dt = os.environ.get("PROBE_DEVICE", "cuda"), torch.bfloat16
        self.n, self.k, self.opts = n, k, opts
        self.copies = copies or max(1, -(-ROUND_BYTES // (n * k * 2)))
        self.weights = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(self.copies)]
        self.bias = torch.randn(n, device=dev, dtype=dt) if opts.get("bias") else None
        self.norm = torch.ones(k, device=dev, dtype=dt) if opts.get("norm") else None
        self.gated = bool(opts.get("gated"))
        self.out_n = n // 2 if self.gated else n
        self.x = torch.randn(rows, k, device=dev, dtype=dt)
        self.residual = torch.randn(rows, self.out_n, device=dev, dtype=dt) if opts.get("residual") else None
        self.y = torch.empty(rows, self.out_n, device=dev, dtype=dt)

    def launch(self, c: dict, weight: torch.Tensor) -> None:
        """One decode_linear call with configuration ``c`` (what ``decode_linear._launch`` does,
        with the tile chosen here)."""
        from flashspec import decode_linear as dl

        x, out = self.x, self.y
        m = x.shape[0]
        args = (x, weight, self.bias if self.bias is not None else out, self.norm if self.norm is not None else x,
                self.residual if self.residual is not None else out, out, m, self.out_n, self.k, 1e-6,
                x.stride(0), weight.stride(0), dl._row_class(m))
        flags = dict(HAS_BIAS=self.bias is not None, NORM=self.norm is not None, RESIDUAL=self.residual is not None,
                     GATED=self.gated, UPCAST=False)
        meta = {key: c[key] for key in ("USE_DOT", "BLOCK_N", "BLOCK_K")}
        grid = (-(-self.out_n // c["BLOCK_N"]),)
        dl._decode_linear_kernel[grid](*args, **flags, **meta, num_warps=c["warps"], num_stages=c["stages"])

    def check(self, c: dict) -> float:
        """Largest |difference| from the reference, relative to the reference's largest value."""
        from flashspec.decode_linear import decode_linear_reference

        self.launch(c, self.weights[0])
        ref = decode_linear_reference(self.x, self.weights[0], self.bias, self.norm, 1e-6, self.residual, self.gated)
        return float((self.y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6))

    def time(self, call) -> float:
        """Median seconds per call of ``call(weight)`` over one round of every copy."""
        for w in self.weights[:2]:
            call(w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in self.weights:
                call(w)
        times = []
        for _ in range(15):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1000 / self.copies)
        return statistics.median(times)


def compile_part(worker: int, workers: int) -> dict:
    """Compile this worker's share of (shape, map, configuration) by launching each once."""
    jobs = [(s, name, i) for s in SHAPES for name in maps(s) for i in range(len(candidates()))]
    errors = {}
    for shape, name, i in jobs[worker::workers]:
        n, k, opts = maps(shape)[name]
        p = Problem(n, k, opts, 1, copies=1)
        try:
            p.launch(candidates()[i], p.weights[0])
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 (a configuration that does not compile is a result)
            errors[f"{shape}|{name}|{label(candidates()[i])}"] = repr(error)[-300:]
    return {"jobs": len(jobs[worker::workers]), "errors": errors}


def time_part() -> dict:
    import torch.nn.functional as F

    out = {}
    for shape in SHAPES:
        for name, (n, k, opts) in maps(shape).items():
            for rows in ROWS:
                p = Problem(n, k, opts, rows)
                key = f"{shape}|{name}|{rows}"
                entry = {"weight_bytes": n * k * 2, "copies": p.copies,
                         "cublas_us": p.time(lambda w: F.linear(p.x, w, p.bias)) * 1e6, "configs": {}}
                for c in candidates():
                    try:
                        error = p.check(c)
                        seconds = p.time(lambda w: p.launch(c, w))
                        entry["configs"][label(c)] = {"us": seconds * 1e6, "rel_error": error}
                    except Exception as err:  # noqa: BLE001
                        entry["configs"][label(c)] = {"error": repr(err)[-300:]}
                best = min((v["us"], lab) for lab, v in entry["configs"].items() if "us" in v)
                entry["best"] = {"label": best[1], "us": best[0]}
                out[key] = entry
                json.dump(out, open(RESULT + ".partial", "w"))
                print(key, f"cuBLAS {entry['cublas_us']:.1f} µs ({n * k * 2 / entry['cublas_us'] / 1e6:.2f} TB/s)",
                      f"best {best[1]} {best[0]:.1f} µs ({n * k * 2 / best[0] / 1e6:.2f} TB/s)", file=sys.stderr, flush=True)
                del p
                torch.cuda.empty_cache()
    return out


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 10)."""
    a = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1000)
    return 2 * a.numel() * 2 / statistics.median(times[2:])


def run_child(spec: dict, show_progress: bool = False) -> subprocess.Popen:
    """``spec``'s part in a process of its own (its last line of output is JSON); with
    ``show_progress`` its stderr goes to ours."""
    return subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=None if show_progress else subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate()
    if proc.returncode:
        return {"error": (stderr or "")[-3000:]}
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    out = {}
    begin = time.time()
    workers = int(os.environ.get("PROBE_COMPILERS", "14"))
    procs = [run_child({"part": "compile", "worker": w, "workers": workers}) for w in range(workers)]
    out["compile"] = [result_of(p) for p in procs]
    out["compile_s"] = time.time() - begin
    print("compiled in", round(out["compile_s"]), "s; errors:",
          sum(len(c.get("errors", {})) for c in out["compile"]), flush=True)
    out["copy_bandwidth"] = copy_bandwidth()
    out["timing"] = result_of(run_child({"part": "time"}, show_progress=True))
    out["total_s"] = time.time() - begin
    json.dump(out, open(RESULT, "w"), indent=1)
    print("probe12 done", round(out["total_s"]), "s", flush=True)


def report(path: str) -> str:
    """Per map and rows: cuBLAS, the best configuration of each kind, and the autotuner list's best."""
    data = json.load(open(path))
    bw = data["copy_bandwidth"]
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s",
             "| shape | map | rows | cuBLAS | best tensor-core | best CUDA-core | best CUDA-core + prefetch |",
             "|---|---|---|---|---|---|---|"]

    def cell(entry, prefix):
        found = [(v["us"], lab) for lab, v in entry["configs"].items()
                 if "us" in v and lab.split(" ")[0] == prefix]
        if not found:
            return "—"
        us, lab = min(found)
        return f"{us:.1f} µs {entry['weight_bytes'] / us / 1e6 / (bw / 1e12):.0%} ({lab.split(' ', 1)[1]})"

    for key, entry in data["timing"].items():
        if not isinstance(entry, dict) or "configs" not in entry:
            continue
        shape, name, rows = key.split("|")
        cub = entry["cublas_us"]
        lines.append(f"| {shape} | {name} | {rows} | {cub:.1f} µs {entry['weight_bytes'] / cub / 1e6 / (bw / 1e12):.0%} | "
                     f"{cell(entry, 'tc')} | {cell(entry, 'cc')} | {cell(entry, 'cc+pf')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    elif len(sys.argv) > 1:
        spec = json.loads(sys.argv[1])
        if spec["part"] == "compile":
            result = compile_part(spec["worker"], spec["workers"])
        else:
            result = time_part()
        print(json.dumps(result))
    else:
        main()
