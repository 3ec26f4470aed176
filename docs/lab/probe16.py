"""Ran at commit 649bbaf (2026-12-01), as benchmarks/probes/probe16.py (results committed in 1a969bb);
it imports modules by their paths at that commit — check it out there to run it again.
Probe 16 (H200): (1) PDL without the L2 prefetch, side by side, three rounds (probe 15 had the
prefetch on in most PDL variants); (2) is a persistent decode kernel worth building? A Triton
kernel that runs the Qwen2.5-1.5B layers' four matrix-vector products (q/k/v 1536→2048, o
1536→1536, gate/up 1536→2×8960 with SiLU·up, down 8960→1536), 28 layers of distinct weights (so
nothing stays in L2), one program per SM or two, with a grid-wide barrier between products
(an atomic counter), optionally prefetching its next product's weight rows into L2 before each
barrier; against the same chain as one decode_linear launch per product in a CUDA graph, and the
barrier alone.
The prefetch switch it turns off (pdl.PREFETCH) was removed right after,
so at later commits that line has no effect.
Run from the repo root:  PYTHONPATH=. python benchmarks/probes/probe16.py
Table for NOTES.md:      PYTHONPATH=. python benchmarks/probes/probe16.py --report benchmarks/probes/probe16_h200.json"""
import json, os, statistics, sys, time

import torch
import triton
import triton.language as tl

OUT = os.environ.get("OUT", "/tmp")
LAYERS = 28
# (N, K, gated) of the four products of a Qwen2.5-1.5B layer, in order; each reads the previous output.
PRODUCTS = ((2048, 1536, False), (1536, 1536, False), (8960, 1536, True), (1536, 8960, False))
PDL_VARIANTS = {  # label: (decode_maps, PDL)
    "o+down": (("o", "down"), False),
    "o+down pdl": (("o", "down"), True),
    "qkv+o+down": (("qkv", "o", "down"), False),
    "qkv+o+down pdl": (("qkv", "o", "down"), True),
}


@triton.jit
def _grid_barrier(ctr_ptr, target):
    """Every program arrives (release), then waits until ``target`` arrivals (acquire)."""
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _barriers_kernel(ctr_ptr, n):
    for i in range(n):
        _grid_barrier(ctr_ptr, (i + 1) * tl.num_programs(0))


@triton.jit
def _prefetch(w_ptr, row0, rows, K, BLOCK_N: tl.constexpr):
    lines = tl.arange(0, 32) * 64
    for n0 in range(row0, row0 + rows, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        live_n = rn < row0 + rows
        for k0 in range(0, K, 32 * 64):
            kk = k0 + lines
            ptrs = tl.where(live_n[:, None] & (kk < K)[None, :], w_ptr + rn[:, None] * K + kk[None, :], w_ptr)
            tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv(w_ptr, x_ptr, y_ptr, row0, rows, N, K, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``row0 .. row0 + rows`` of ``W x`` (``silu(gate)·up`` with ``GATED``); ``x`` read
    through L2 only (other programs wrote it)."""
    rk = tl.arange(0, BLOCK_K)
    for n0 in range(row0, row0 + rows, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_live = rn < row0 + rows
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_live = kk < K
            x = tl.load(x_ptr + kk, mask=k_live, other=0.0, cache_modifier=".cg").to(tl.float32)
            mask = n_live[:, None] & k_live[None, :]
            w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=mask, other=0.0)
            acc += w.to(tl.float32) * x[None, :]
            if GATED:
                u = tl.load(w_ptr + (rn + N)[:, None] * K + kk[None, :], mask=mask, other=0.0)
                acc_up += u.to(tl.float32) * x[None, :]
        y = tl.sum(acc, 1)
        if GATED:
            g = y.to(tl.bfloat16).to(tl.float32)
            y = g / (1.0 + tl.exp(-g)) * tl.sum(acc_up, 1).to(tl.bfloat16).to(tl.float32)
        tl.store(y_ptr + rn, y.to(tl.bfloat16), mask=n_live)


@triton.jit
def _product(table_ptr, layer, j: tl.constexpr, pid, nprog, N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr,
             x_ptr, y_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    w = tl.load(table_ptr + layer * 4 + j).to(tl.pointer_type(tl.bfloat16))
    rows = tl.cdiv(N, nprog)
    _gemv(w, x_ptr, y_ptr, pid * rows, tl.minimum(rows, N - pid * rows), N, K, GATED, BLOCK_N, BLOCK_K)


@triton.jit
def _prefetch_product(table_ptr, layer, j: tl.constexpr, pid, nprog, N: tl.constexpr, K: tl.constexpr,
                      GATED: tl.constexpr, BLOCK_N: tl.constexpr):
    w = tl.load(table_ptr + layer * 4 + j).to(tl.pointer_type(tl.bfloat16))
    rows = tl.cdiv(N, nprog)
    _prefetch(w, pid * rows, tl.minimum(rows, N - pid * rows), K, BLOCK_N)
    if GATED:
        _prefetch(w + N * K, pid * rows, tl.minimum(rows, N - pid * rows), K, BLOCK_N)


@triton.jit
def _chain_kernel(table_ptr, x_ptr, a_ptr, b_ptr, h_ptr, ctr_ptr, layers,
                  PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``layers`` × (qkv: x→a, o: a[:1536]→b, gate/up: b→h, down: h→x), a barrier after each."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    step = 0
    for layer in range(layers):
        _product(table_ptr, layer, 0, pid, nprog, 2048, 1536, False, x_ptr, a_ptr, BLOCK_N, BLOCK_K)
        if PREFETCH:
            _prefetch_product(table_ptr, layer, 1, pid, nprog, 1536, 1536, False, BLOCK_N)
        step += 1
        _grid_barrier(ctr_ptr, step * nprog)
        _product(table_ptr, layer, 1, pid, nprog, 1536, 1536, False, a_ptr, b_ptr, BLOCK_N, BLOCK_K)
        if PREFETCH:
            _prefetch_product(table_ptr, layer, 2, pid, nprog, 8960, 1536, True, BLOCK_N)
        step += 1
        _grid_barrier(ctr_ptr, step * nprog)
        _product(table_ptr, layer, 2, pid, nprog, 8960, 1536, True, b_ptr, h_ptr, BLOCK_N, BLOCK_K)
        if PREFETCH:
            _prefetch_product(table_ptr, layer, 3, pid, nprog, 1536, 8960, False, BLOCK_N)
        step += 1
        _grid_barrier(ctr_ptr, step * nprog)
        _product(table_ptr, layer, 3, pid, nprog, 1536, 8960, False, h_ptr, x_ptr, BLOCK_N, BLOCK_K)
        if PREFETCH:
            if layer + 1 < layers:
                _prefetch_product(table_ptr, layer + 1, 0, pid, nprog, 2048, 1536, False, BLOCK_N)
        step += 1
        _grid_barrier(ctr_ptr, step * nprog)


def _cooperative() -> dict:
    from triton.backends.nvidia.compiler import CUDAOptions

    return {"launch_cooperative_grid": True} if "launch_cooperative_grid" in CUDAOptions.__dataclass_fields__ else {}


def _time(fn, iters: int = 20) -> float:
    """Median seconds of ``fn`` replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


def persistent() -> dict:
    from flashspec.decode_linear import decode_linear

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [[torch.randn(n * (2 if g else 1), k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
                for n, k, g in PRODUCTS] for _ in range(LAYERS)]
    table = torch.tensor([[w.data_ptr() for w in layer] for layer in weights], dtype=torch.int64, device="cuda")
    nbytes = sum(w.numel() * 2 for layer in weights for w in layer)
    x = torch.randn(1536, device="cuda", dtype=torch.bfloat16)
    a = torch.empty(2048, device="cuda", dtype=torch.bfloat16)
    b = torch.empty(1536, device="cuda", dtype=torch.bfloat16)
    h = torch.empty(8960, device="cuda", dtype=torch.bfloat16)
    ctr = torch.zeros(1, device="cuda", dtype=torch.int32)
    out = {"sms": sms, "bytes": nbytes, "cooperative": bool(_cooperative())}

    # Correctness of one layer against PyTorch (float32 products of the same bf16 values).
    x0 = x.clone()
    ctr.zero_()
    _chain_kernel[(128,)](table, x, a, b, h, ctr, 1, PREFETCH=True, BLOCK_N=4, BLOCK_K=512, num_warps=4,
                          **_cooperative())
    ra = (weights[0][0].float() @ x0.float()).to(torch.bfloat16)
    rb = (weights[0][1].float() @ ra[:1536].float()).to(torch.bfloat16)
    gu = (weights[0][2].float() @ rb.float()).to(torch.bfloat16).float()
    rh = (torch.nn.functional.silu(gu[:8960]) * gu[8960:]).to(torch.bfloat16)
    rx = (weights[0][3].float() @ rh.float()).to(torch.bfloat16)
    out["one_layer_max_rel_error"] = float((x.float() - rx.float()).abs().max() / rx.float().abs().max())
    print("one layer vs torch, max rel error", out["one_layer_max_rel_error"], flush=True)

    # The barrier alone.
    for programs in ((sms, 2 * sms) if out["cooperative"] else (sms,)):
        def run(programs=programs):
            ctr.zero_()
            _barriers_kernel[(programs,)](ctr, 1000, num_warps=4, **_cooperative())
        out[f"barrier_us|{programs}"] = _time(run, 10) / 1000 * 1e6
        print("barrier", programs, "programs:", round(out[f"barrier_us|{programs}"], 3), "µs", flush=True)

    # The chain as separate decode_linear launches.
    def separate():
        xx = x
        for layer in weights:
            aa = decode_linear(xx, layer[0])
            bb = decode_linear(aa[:1536], layer[1])
            hh = decode_linear(bb, layer[2], gated=True)
            xx = decode_linear(hh, layer[3])
        return xx
    out["separate_ms"] = _time(lambda: separate()) * 1e3
    print("separate decode_linear launches", round(out["separate_ms"], 3), "ms", flush=True)

    # Without a cooperative launch, only one program per SM is sure to be resident (no deadlock).
    for rnd in (1, 2):
        for programs in ((128, 256) if out["cooperative"] else (128,)):
            for block_n, block_k, warps in ((4, 512, 4), (2, 1024, 4), (4, 1024, 8)):
                for prefetch in (False, True):
                    def run(programs=programs, prefetch=prefetch, block_n=block_n, block_k=block_k, warps=warps):
                        ctr.zero_()
                        _chain_kernel[(programs,)](table, x, a, b, h, ctr, LAYERS, PREFETCH=prefetch, BLOCK_N=block_n,
                                                   BLOCK_K=block_k, num_warps=warps, **_cooperative())
                    key = f"persistent_ms|{programs}|{block_n}x{block_k}w{warps}|prefetch={int(prefetch)}"
                    try:
                        out.setdefault(key, []).append(_time(run) * 1e3)
                    except Exception as error:  # e.g. too many programs for a cooperative launch
                        out[key.replace("persistent_ms", "error")] = repr(error)[:200]
                        out.pop(key, None)
                        print(rnd, key, "failed:", repr(error)[:200], flush=True)
                        continue
                    print(rnd, key, round(out[key][-1], 3), flush=True)
    return out


def pdl_ab() -> dict:
    from flashspec import bench_gpu, pdl
    from flashspec.cache import StaticLM

    pdl.PREFETCH = False
    out = {}
    for shape in ("qwen2.5-1.5b", "llama3-8b"):
        lm = StaticLM(bench_gpu.shaped_model(shape), compile=True)
        for _ in range(3):
            for label, (maps, on) in PDL_VARIANTS.items():
                lm.decode_maps = maps
                pdl.ENABLED = on
                times = {str(w): bench_gpu.time_forward(lm, 1, w, 384) * 1e3 for w in (1, 5)}
                out.setdefault(shape, {}).setdefault(label, []).append(times)
                print(shape, label, {w: round(t, 4) for w, t in times.items()}, flush=True)
        del lm
        torch.cuda.empty_cache()
    return out


def main() -> None:
    out = {}
    begin = time.time()
    for name, part in (("pdl", pdl_ab), ("persistent", persistent)):
        out[name] = part()
        out["elapsed_s"] = round(time.time() - begin, 1)
        json.dump(out, open(f"{OUT}/probe16_h200.json", "w"), indent=1)
    print("probe16 done", flush=True)


def report(path: str) -> str:
    data = json.load(open(path))
    lines = []
    p = data.get("persistent", {})
    if p:
        floor = p["bytes"] / 4.21e12 * 1e3
        lines += [f"28 layers' four products: {p['bytes'] / 1e9:.2f} GB, {floor:.3f} ms at 4.21 TB/s; separate "
                  f"decode_linear launches {p['separate_ms']:.3f} ms; barrier "
                  + ", ".join(f"{v:.2f} µs ({k.split('|')[1]} programs)" for k, v in p.items() if k.startswith("barrier"))
                  + f"; one layer's max relative error {p['one_layer_max_rel_error']:.1e}", "",
                  "| programs | tile | prefetch | ms (rounds) | of copy bandwidth |", "|---|---|---|---|---|"]
        for key, times in p.items():
            if key.startswith("persistent_ms") and times:
                _, programs, tile, prefetch = key.split("|")
                lines.append(f"| {programs} | {tile} | {prefetch[-1]} | {' / '.join(f'{t:.3f}' for t in times)} | "
                             f"{floor / min(times):.0%} |")
    for shape, variants in data.get("pdl", {}).items():
        lines += ["", f"{shape}: | variant | 1-token ms (rounds) | 5-token ms (rounds) |", "|---|---|---|"]
        for label, rounds in variants.items():
            lines.append(f"| {label} | " + " | ".join(" / ".join(f"{r[w]:.3f}" for r in rounds) for w in ("1", "5")) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2]))
    else:
        main()
