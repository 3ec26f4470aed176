"""Ran at commit 7edf5f4 (2026-12-01), as benchmarks/probes/probe19.py (results committed in a43c317);
it imports modules by their paths at that commit — check it out there to run it again.
Probe 19 (H200): the row-fold kernel (kernel 2) took 5–11 µs in probe 17's profile for what is a
few KB of partials: its tiles hold 32–512 rows × up to 64 partials (~4096 values) per program,
so a call has 1–36 programs. Here: rows per program (fold_rows) and warps, side by side in graph
replay, at the points that miss 60 % of copy bandwidth.
At that commit `_tiles` had fold_rows and `FOLD_WARPS` existed; right after, the winner became
`FOLD_ROWS = 4`, `FOLD_WARPS = 1` and `_tiles` lost its `fold_rows`, so at later commits the
rows override here has no effect.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe19.py
Table for NOTES.md:      PYTHONPATH=. python benchmarks/probes/probe19.py --report benchmarks/probes/probe19_h200.json"""
import json, math, os, sys, time

import torch

from flashspec import bench_kernels as bk, verify_triton as vt
from flashspec.verify import verify

OUT = os.environ.get("OUT", "/tmp")
POINTS = [(v, b, g, m) for v in (32000, 128256, 151936) for (b, g) in ((256, 1), (64, 4), (64, 8))
          for m in ("greedy", "temperature")]
VARIANTS = {"default": (None, 4), "4 rows, 1 warp": (4, 1), "8 rows, 2 warps": (8, 2), "16 rows, 4 warps": (16, 4),
            "32 rows, 4 warps": (32, 4)}
original = vt._tiles


def main() -> None:
    out = {"copy_bw": bk.measure_copy_bandwidth(), "points": {}}
    gen = torch.Generator(device="cuda").manual_seed(3)
    for vocab, batch, gamma, mode in POINTS:
        params = bk.MODE_PARAMS[mode]
        first = bk._make_set(batch, gamma, vocab, params, "cuda", gen)
        set_bytes = sum(t.numel() * t.element_size() for t in first if t is not None)
        n_sets = int(min(64, max(2, math.ceil(2 * bk.L2_BYTES / set_bytes))))
        sets = [first] + [bk._make_set(batch, gamma, vocab, params, "cuda", gen) for _ in range(n_sets - 1)]
        ref = verify(*first[:3], params, first[3], backend="reference")
        row = {"bytes": bk._minimal_bytes(batch, gamma, vocab, mode)}
        for label, (rows, warps) in VARIANTS.items():
            vt._tiles = (lambda v, rows=rows: {**original(v), **({} if rows is None else {"fold_rows": rows})})
            vt.FOLD_WARPS = warps
            n, tokens = vt.verify_triton(*first[:3], params, first[3])
            calls = [lambda s=s: vt.verify_triton(*s[:3], params, s[3]) for s in sets]
            row[label] = {"us": round(bk._graph_timed(calls) * 1e6, 2),
                          "match": bool(torch.equal(n, ref.num_accepted) and torch.equal(tokens, ref.tokens))}
        vt._tiles, vt.FOLD_WARPS = original, 4
        out["points"][f"{vocab}|{batch}|{gamma}|{mode}"] = row
        print(vocab, batch, gamma, mode, row, flush=True)
        json.dump(out, open(f"{OUT}/probe19_h200.json", "w"), indent=1)
        del sets, first
        torch.cuda.empty_cache()
    print("probe19 done", flush=True)


def report(path: str) -> str:
    data = json.load(open(path))
    bw = data["copy_bw"]
    labels = list(VARIANTS)
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s; graph-replay µs per call (of copy bandwidth)", "",
             "| V | B | γ | mode | " + " | ".join(labels) + " |", "|---|---|---|---|" + "---|" * len(labels)]
    for key, row in data["points"].items():
        cells = [f"{row[l]['us']:.1f} ({row['bytes'] / (row[l]['us'] * 1e-6) / bw:.0%}){'' if row[l]['match'] else ' ≠'}"
                 for l in labels]
        lines.append(f"| {' | '.join(key.split('|'))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    else:
        main()
