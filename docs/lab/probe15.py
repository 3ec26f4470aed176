"""Ran at commit 222b034 (2026-12-01), as benchmarks/probes/probe15.py (results committed in 649bbaf);
it imports modules by their paths at that commit — check it out there to run it again.
Probe 15 (H200): programmatic dependent launch (flashspec.pdl) in the decode forward.
(1) Races: the compiled forward's logits (1.5B shape, random weights, every map through
decode_linear, widths 1 and 5), replayed 20 times from a CUDA graph with PDL and the weight
prefetch on, must be bit-identical to the same forward with PDL off.
(2) Forward time (graph replay, median of 50, 384 tokens of context) by variant — which maps one
token row sends through decode_linear, PDL on or off, the L2 prefetch on or off — alternating,
two rounds; both shapes.
(3) A kernel timeline of one 1-token forward of the 1.5B shape, PDL off and on (all maps).
The prefetch was removed afterwards (probe 16, NOTES.md), so at later
commits the prefetch switch it sets has no effect.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe15.py
Table for NOTES.md:      PYTHONPATH=. python benchmarks/probes/probe15.py --report benchmarks/probes/probe15_h200.json"""
import json, os, statistics, sys, time

import torch

OUT = os.environ.get("OUT", "/tmp")
ALL = ("qkv", "o", "gate_up", "down")
# label: (decode_maps, decode_maps_wide, PDL, prefetch)
VARIANTS = {
    "o+down": (("o", "down"), ("o",), False, False),
    "o+down pdl": (("o", "down"), ("o",), True, True),
    "all": (ALL, ("o",), False, False),
    "all pdl, no prefetch": (ALL, ("o",), True, False),
    "all pdl": (ALL, ("o",), True, True),
    "qkv+o+down pdl": (("qkv", "o", "down"), ("o",), True, True),
    "all pdl, wide all": (ALL, ALL, True, True),
}
SHAPES = {"qwen2.5-1.5b": list(VARIANTS), "llama3-8b": ["o+down", "o+down pdl", "all pdl", "qkv+o+down pdl"]}


def setup(lm, label: str) -> None:
    from flashspec import pdl

    maps, wide, on, prefetch = VARIANTS[label]
    lm.decode_maps, lm.decode_maps_wide = maps, wide
    pdl.ENABLED, pdl.PREFETCH = on, prefetch


def logits(lm, width: int, replays: int) -> list[torch.Tensor]:
    from flashspec.graphs import Graphs

    lm.reset(1, 768)
    gen = torch.Generator().manual_seed(width)
    tokens = torch.randint(0, 1000, (1, width), generator=gen).cuda()
    start = torch.full((1,), 384, device="cuda")
    graphs = Graphs(enabled=True)
    outs = []
    for _ in range(replays + 2):
        outs.append(graphs.run("f", lambda: lm.forward(tokens, start)).clone())
    return outs[2:]


def races(lm) -> dict:
    out = {}
    for width in (1, 5):
        setup(lm, "all pdl, wide all")
        on = logits(lm, width, 20)
        setup(lm, "all")
        lm.decode_maps_wide = ALL
        off = logits(lm, width, 1)[0]
        out[str(width)] = sum(int(not torch.equal(x, off)) for x in on)
        print("width", width, "replays differing from PDL off:", out[str(width)], "of 20", flush=True)
    return out


def timeline(lm, label: str) -> list:
    from torch.profiler import ProfilerActivity, profile

    from flashspec.graphs import Graphs

    setup(lm, label)
    lm.reset(1, 768)
    tokens = torch.randint(0, 1000, (1, 1), device="cuda")
    start = torch.full((1,), 384, device="cuda")
    graphs = Graphs(enabled=True)
    for _ in range(3):
        graphs.run("f", lambda: lm.forward(tokens, start))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graphs.run("f", lambda: lm.forward(tokens, start))
            torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    # The last replay: the kernels after the later of the two largest gaps (the synchronisations).
    gaps = [kernels[i + 1][0] - kernels[i][0] for i in range(len(kernels) - 1)]
    cut = max(sorted(range(len(gaps)), key=gaps.__getitem__)[-2:])
    last = kernels[cut + 1:]
    t0 = last[0][0]
    return [[name[:60], round(s - t0, 2), round(e - s, 2)] for s, e, name in last]


def main() -> None:
    from flashspec import bench_gpu, pdl
    from flashspec.cache import StaticLM

    out = {"pdl_supported": None}
    begin = time.time()

    def save():
        out["elapsed_s"] = round(time.time() - begin, 1)
        json.dump(out, open(f"{OUT}/probe15_h200.json", "w"), indent=1)

    for shape, labels in SHAPES.items():
        lm = StaticLM(bench_gpu.shaped_model(shape), compile=True)
        out["pdl_supported"] = pdl.enabled(torch.device("cuda"))
        if shape == "qwen2.5-1.5b":
            out["races"] = races(lm)
            save()
        for round_ in (1, 2):
            for label in labels:
                setup(lm, label)
                times = {str(w): bench_gpu.time_forward(lm, 1, w, 384) * 1e3 for w in (1, 5)}
                out.setdefault(shape, {}).setdefault(label, []).append(times)
                print(shape, round_, label, {w: round(t, 4) for w, t in times.items()},
                      round(time.time() - begin), "s", flush=True)
                save()
        if shape == "qwen2.5-1.5b":
            for label in ("all", "all pdl"):
                out.setdefault("timeline", {})[label] = timeline(lm, label)
                save()
        del lm
        torch.cuda.empty_cache()
    print("probe15 done", flush=True)


def report(path: str) -> str:
    data = json.load(open(path))
    lines = [f"PDL supported: {data['pdl_supported']}; races (replays of 20 differing from PDL off): "
             f"{data.get('races')}", "",
             "| shape | variant | 1-token forward, ms (rounds) | 5-token forward, ms (rounds) | vs o+down (1 / 5, last round) |",
             "|---|---|---|---|---|"]
    for shape in SHAPES:
        if shape not in data:
            continue
        base = data[shape]["o+down"][-1]
        for label, rounds in data[shape].items():
            cells = [" / ".join(f"{r[w]:.3f}" for r in rounds) for w in ("1", "5")]
            change = " / ".join(f"{rounds[-1][w] / base[w] - 1:+.1%}" for w in ("1", "5"))
            lines.append(f"| {shape} | {label} | {cells[0]} | {cells[1]} | {change} |")
    for label, kernels in data.get("timeline", {}).items():
        busy = sum(k[2] for k in kernels)
        span = kernels[-1][1] + kernels[-1][2]
        lines.append(f"\nTimeline `{label}`: {len(kernels)} kernels, span {span:.0f} µs, kernel time {busy:.0f} µs "
                     f"(sums overlapping kernels twice)")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    else:
        main()
