"""Ran at commit ce5172a (2026-12-01), as benchmarks/probes/probe17.py, before the file itself was
committed (with its results, in 42c3f4d); it imports modules by their paths at that commit — check
out ce5172a and add the file (`git show 42c3f4d:benchmarks/probes/probe17.py >
benchmarks/probes/probe17.py`) to run it again.
Probe 17 (H200): where the verify kernels lose their bandwidth at the >= 256-row points that
miss 60 % of copy bandwidth (session 9's run: 14 points, mostly temperature).
(1) per-kernel CUDA time (torch.profiler) of the five kernels at those points, default tiles;
(2) the same points in graph replay (as `flashspec bench gpu` times them) under other tile
sizes: the chunk per program (CHUNK_MAX), warps per chunk program, rows per program (TILE),
warps of the draw kernel — set as module attributes, so nothing else changes;
(3) whether pytest-xdist is importable on the device (to run the GPU tests in parallel).
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe17.py
Table for NOTES.md:      PYTHONPATH=. python benchmarks/probes/probe17.py --report benchmarks/probes/probe17_h200.json"""
import importlib.util, json, math, os, sys, time
from collections import defaultdict

import torch

from flashspec import bench_kernels as bk, verify_triton as vt
from flashspec.verify import verify

OUT = os.environ.get("OUT", "/tmp")
POINTS = [(v, b, g, m) for v in (32000, 128256, 151936) for (b, g) in ((256, 1), (64, 4), (64, 8), (256, 4), (256, 8))
          for m in ("greedy", "temperature")]
CONFIGS = {  # label: module attributes of flashspec.verify_triton
    "default": {},
    "chunk 4k, 8 warps": {"CHUNK_WARPS": 8},
    "chunk 8k, 8 warps": {"CHUNK_MAX": 8192, "CHUNK_WARPS": 8},
    "chunk 16k, 8 warps": {"CHUNK_MAX": 16384, "CHUNK_WARPS": 8},
    "chunk 2k, 4 warps": {"CHUNK_MAX": 2048},
    "2 rows per program": {"TILE": 8192},
    "draw 4 warps": {"DRAW_WARPS": 4},
}
DEFAULTS = {name: getattr(vt, name) for cfg in CONFIGS.values() for name in cfg}


def _sets(vocab, batch, gamma, mode, gen):
    params = bk.MODE_PARAMS[mode]
    first = bk._make_set(batch, gamma, vocab, params, "cuda", gen)
    set_bytes = sum(t.numel() * t.element_size() for t in first if t is not None)
    n_sets = int(min(64, max(2, math.ceil(2 * bk.L2_BYTES / set_bytes))))
    return params, [first] + [bk._make_set(batch, gamma, vocab, params, "cuda", gen) for _ in range(n_sets - 1)]


def profile_kernels() -> dict:
    out = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for vocab, batch, gamma, mode in POINTS:
        params, sets = _sets(vocab, batch, gamma, mode, gen)
        for s in sets[:2]:
            verify(*s[:3], params, s[3], backend="triton")
        torch.cuda.synchronize()
        calls = 3 * len(sets)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                s = sets[i % len(sets)]
                verify(*s[:3], params, s[3], backend="triton")
            torch.cuda.synchronize()
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] += e.device_time_total / calls
        out[f"{vocab}|{batch}|{gamma}|{mode}"] = {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
        print(vocab, batch, gamma, mode, out[f"{vocab}|{batch}|{gamma}|{mode}"], flush=True)
        del sets
        torch.cuda.empty_cache()
    return out


def tiles() -> dict:
    out = {}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for vocab, batch, gamma, mode in POINTS:
        params, sets = _sets(vocab, batch, gamma, mode, gen)
        ref = verify(*sets[0][:3], params, sets[0][3], backend="reference")
        row = {"bytes": bk._minimal_bytes(batch, gamma, vocab, mode)}
        for label, cfg in CONFIGS.items():
            for name, value in DEFAULTS.items():
                setattr(vt, name, cfg.get(name, value))
            tri = verify(*sets[0][:3], params, sets[0][3], backend="triton")
            same = bool(torch.equal(ref.tokens, tri.tokens) and torch.equal(ref.num_accepted, tri.num_accepted))
            calls = [lambda s=s: verify(*s[:3], params, s[3], backend="triton") for s in sets]
            row[label] = {"us": round(bk._graph_timed(calls) * 1e6, 2), "match": same}
        for name, value in DEFAULTS.items():
            setattr(vt, name, value)
        out[f"{vocab}|{batch}|{gamma}|{mode}"] = row
        print(vocab, batch, gamma, mode, {k: v for k, v in row.items()}, flush=True)
        del sets
        torch.cuda.empty_cache()
    return out


def main() -> None:
    out = {"xdist": importlib.util.find_spec("xdist") is not None, "copy_bw": bk.measure_copy_bandwidth()}
    print("xdist:", out["xdist"], "copy bw", out["copy_bw"] / 1e12, flush=True)
    begin = time.time()
    for name, part in (("profile", profile_kernels), ("tiles", tiles)):
        out[name] = part()
        out["elapsed_s"] = round(time.time() - begin, 1)
        json.dump(out, open(f"{OUT}/probe17_h200.json", "w"), indent=1)
    print("probe17 done", flush=True)


def report(path: str) -> str:
    data = json.load(open(path))
    bw = data["copy_bw"]
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s; xdist on the device: {data['xdist']}", "",
             "Per-kernel CUDA µs per call (profiler, eager):", "",
             "| V | B | γ | mode | partials | rows | decide | residual | draw | other |", "|---|---|---|---|---|---|---|---|---|---|"]
    names = ("_partials_kernel", "_rows_kernel", "_decide_kernel", "_residual_kernel", "_draw_kernel")
    for key, per in data.get("profile", {}).items():
        cells = [f"{per.get(n, 0):.1f}" if n in per else "—" for n in names]
        other = sum(v for k, v in per.items() if k not in names)
        lines.append(f"| {' | '.join(key.split('|'))} | {' | '.join(cells)} | {other:.1f} |")
    t = data.get("tiles", {})
    if t:
        labels = [k for k in next(iter(t.values())) if k != "bytes"]
        lines += ["", "Graph-replay µs per call (of copy bandwidth):", "",
                  "| V | B | γ | mode | " + " | ".join(labels) + " |", "|---|---|---|---|" + "---|" * len(labels)]
        for key, row in t.items():
            cells = [f"{row[l]['us']:.1f} ({row['bytes'] / (row[l]['us'] * 1e-6) / bw:.0%}){'' if row[l]['match'] else ' ≠'}"
                     for l in labels]
            lines.append(f"| {' | '.join(key.split('|'))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    else:
        main()
