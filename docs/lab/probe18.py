"""Ran at commit ce5172a (2026-12-01) with an uncommitted flashspec/verify_triton.py, as
benchmarks/probes/probe18.py (results committed in 42c3f4d); it imports modules by their paths then
— check out a43c317, where both kernel versions it loads sit beside it, to run it again.
Probe 18 (H200): the verify kernels after folding the row partials into the decide kernel and
moving p_n's masses out of the residual kernel (4 kernels for sampling, 2 for greedy) against
the five-kernel version of commit ce5172a (`verify_triton_ce5172a.py`, a verbatim copy, now deleted:
`git show ce5172a:flashspec/verify_triton.py`, or the copy, `git show 42c3f4d:benchmarks/probes/verify_triton_ce5172a.py`), side by
side at probe 17's points: graph-replay µs, per-kernel profile of the new version, and tokens
against the PyTorch reference for both.
The version it times is `verify_triton_probe18.py` (a verbatim copy of the working tree then, never
committed as flashspec/verify_triton.py; now deleted: `git show a43c317:benchmarks/probes/verify_triton_probe18.py`): the
residual/draw change was kept (commit 42c3f4d), the fused decide kernel was not (slower, see NOTES).
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe18.py
Table for NOTES.md:      PYTHONPATH=. python benchmarks/probes/probe18.py --report benchmarks/probes/probe18_h200.json"""
import importlib.util, json, math, os, sys, time
from collections import defaultdict

import torch

from flashspec import bench_kernels as bk
from flashspec.verify import verify

OUT = os.environ.get("OUT", "/tmp")
POINTS = [(v, b, g, m) for v in (32000, 151936) for (b, g) in ((1, 4), (256, 1), (64, 4), (64, 8), (256, 4), (256, 8))
          for m in ("greedy", "temperature")]


def _load(name):
    path = os.path.join(os.path.dirname(__file__), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"flashspec._{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    old, new = _load("verify_triton_ce5172a"), _load("verify_triton_probe18")
    out = {"copy_bw": bk.measure_copy_bandwidth(), "points": {}}
    gen = torch.Generator(device="cuda").manual_seed(2)
    begin = time.time()
    for vocab, batch, gamma, mode in POINTS:
        params = bk.MODE_PARAMS[mode]
        first = bk._make_set(batch, gamma, vocab, params, "cuda", gen)
        set_bytes = sum(t.numel() * t.element_size() for t in first if t is not None)
        n_sets = int(min(64, max(2, math.ceil(2 * bk.L2_BYTES / set_bytes))))
        sets = [first] + [bk._make_set(batch, gamma, vocab, params, "cuda", gen) for _ in range(n_sets - 1)]
        ref = verify(*first[:3], params, first[3], backend="reference")
        row = {"bytes": bk._minimal_bytes(batch, gamma, vocab, mode)}
        for label, fn in (("old", old.verify_triton), ("new", new.verify_triton)):
            n, tokens = fn(*first[:3], params, first[3])
            row[f"{label}_match"] = bool(torch.equal(n, ref.num_accepted) and torch.equal(tokens, ref.tokens))
        for rnd in range(2):
            for label, fn in (("old", old.verify_triton), ("new", new.verify_triton)):
                calls = [lambda s=s, fn=fn: fn(*s[:3], params, s[3]) for s in sets]
                row.setdefault(f"{label}_us", []).append(round(bk._graph_timed(calls) * 1e6, 2))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(2 * n_sets):
                s = sets[i % n_sets]
                new.verify_triton(*s[:3], params, s[3])
            torch.cuda.synchronize()
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] += e.device_time_total / (2 * n_sets)
        row["new_kernels"] = {k: round(v, 2) for k, v in per.items()}
        key = f"{vocab}|{batch}|{gamma}|{mode}"
        out["points"][key] = row
        print(key, row, flush=True)
        out["elapsed_s"] = round(time.time() - begin, 1)
        json.dump(out, open(f"{OUT}/probe18_h200.json", "w"), indent=1)
        del sets, first
        torch.cuda.empty_cache()
    print("probe18 done", flush=True)


def report(path: str) -> str:
    data = json.load(open(path))
    bw = data["copy_bw"]
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s", "",
             "| V | B | γ | mode | 5 kernels µs | 4/2 kernels µs | change | of copy bw (new) | partials | decide | residual | draw | match old/new |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in data["points"].items():
        o, n = min(r["old_us"]), min(r["new_us"])
        k = r["new_kernels"]
        cell = lambda name: f"{k[name]:.1f}" if name in k else "—"  # noqa: E731
        lines.append(f"| {' | '.join(key.split('|'))} | {' / '.join(f'{x:.1f}' for x in r['old_us'])} | "
                     f"{' / '.join(f'{x:.1f}' for x in r['new_us'])} | {n / o - 1:+.0%} | {r['bytes'] / (n * 1e-6) / bw:.0%} | "
                     f"{cell('_partials_kernel')} | {cell('_decide_kernel')} | {cell('_residual_kernel')} | {cell('_draw_kernel')} | "
                     f"{'yes' if r['old_match'] else 'no'}/{'yes' if r['new_match'] else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    else:
        main()
