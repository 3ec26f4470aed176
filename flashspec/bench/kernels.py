"""GPU benchmarks of the verification step: the Triton kernels against the PyTorch reference.

:func:`measure_copy_bandwidth` gives the device's practical memory ceiling (a large
device-to-device copy); :func:`bench_verify` times ``verify`` on both backends over a grid of
batch sizes, γ, vocabularies and modes, checks that both agree on each input, and reports the
Triton path's achieved bandwidth against that ceiling; :func:`format_table` renders the rows as
markdown. The timers are :mod:`flashspec.tuning.timing`'s. Importing this module needs neither
CUDA nor Triton (Triton is imported by ``verify`` when the Triton backend runs).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..sampling import SamplingParams, probabilities, sample
from ..tuning.timing import alternating, event_seconds, graph_replay_seconds
from ..verify import verify

__all__ = ["bench_verify", "format_table", "measure_copy_bandwidth", "parity_stress"]

L2_BYTES = 60e6  # H100/H200 L2 is 50-60 MB: inputs rotate through more than twice that
MODE_PARAMS = {
    "greedy": SamplingParams(do_sample=False),
    "temperature": SamplingParams(do_sample=True, temperature=0.7),
    "top_p": SamplingParams(do_sample=True, temperature=0.7, top_p=0.9),
}


def measure_copy_bandwidth(device: str | torch.device = "cuda", nbytes: int = 1 << 30, repeats: int = 30) -> float:
    """Device-to-device copy bandwidth in bytes/s: bytes read plus bytes written by one large
    ``copy_``, median of ``repeats`` CUDA-event-timed copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    with torch.cuda.device(src.device):
        for _ in range(3):
            dst.copy_(src)
        seconds = event_seconds(lambda _: dst.copy_(src), 1, repeats)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def _make_set(batch: int, gamma: int, vocab: int, params: SamplingParams, device: torch.device, gen: torch.Generator):
    """One input set: bf16 logits, drafts, fp32 q (sampling modes) and float64 uniforms."""
    logits = (torch.randn(batch, gamma + 1, vocab, device=device, generator=gen) * 3).to(torch.bfloat16)
    uniforms = torch.rand(batch, gamma + 1, dtype=torch.float64, device=device, generator=gen)
    if params.do_sample:
        drafter = logits[:, :gamma].float() + torch.randn(batch, gamma, vocab, device=device, generator=gen)
        q = probabilities(drafter, params)
        u = torch.rand(batch, gamma, dtype=torch.float64, device=device, generator=gen)
        drafts = sample(q, u)
    else:
        q = None
        drafts = torch.randint(0, vocab, (batch, gamma), device=device, generator=gen)
        agree = torch.randint(0, gamma + 1, (batch, 1), device=device, generator=gen)
        columns = torch.arange(gamma, device=device)[None, :]
        drafts = torch.where(columns < agree, logits[:, :gamma].float().argmax(-1), drafts)
    return logits, drafts, q, uniforms


def _minimal_bytes(batch: int, gamma: int, vocab: int, mode: str) -> int:
    """Bytes the Triton path must move (top_p: excluding the PyTorch top-p preprocessing).

    Logits read once; for sampling row n of the logits and of q read once more per sequence
    plus at most one 4096-wide chunk of each; partial buffers, drafts, uniforms, q at the drafts
    and the outputs.
    """
    from_logits = batch * (gamma + 1) * vocab * 2  # bf16
    chunk = min(4096, 1 << max(vocab - 1, 0).bit_length())
    chunks = -(-vocab // chunk)
    rows = batch * (gamma + 1)
    small = rows * chunks * 8 * 2 + batch * gamma * 8 + batch * (gamma + 1) * 8 + batch * 8
    if mode == "greedy":
        return from_logits + small
    row_bytes = (vocab + min(vocab, chunk)) * (2 + 4)  # logits row + q row
    small += batch * (gamma + 1) * 8 + batch * gamma * 4 + batch * chunks * 12 * 2 + batch * 8 * 2
    return from_logits + batch * row_bytes + small


def bench_verify(
    device: str | torch.device = "cuda",
    batches: tuple[int, ...] = (1, 4, 16, 64, 256),
    gammas: tuple[int, ...] = (1, 4, 8),
    vocabs: tuple[int, ...] = (32000, 128256, 151936),
    modes: tuple[str, ...] = ("greedy", "temperature", "top_p"),
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Time ``verify`` with the reference and the Triton backend at every grid point.

    Each point uses bf16 logits (``randn * 3``), drafts and, for sampling, an fp32 draft law
    (temperature 0.7; top_p: top-p 0.9 at temperature 0.7) and explicit uniforms. Both backends
    first run on the same input and must agree (``match``). Timing rotates through enough input
    sets to exceed twice the L2 cache, so small shapes are not timed from cache; medians of
    CUDA-event-timed rounds after warm-up; the two backends' eager rounds alternate.
    """
    from tqdm.auto import tqdm

    device = torch.device(device)
    points = [(v, g, b, m) for v in vocabs for g in gammas for b in batches for m in modes]
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for vocab, gamma, batch, mode in tqdm(points, desc="verify kernels", disable=not progress):
        params = MODE_PARAMS[mode]
        first = _make_set(batch, gamma, vocab, params, device, gen)
        set_bytes = sum(t.numel() * t.element_size() for t in first if t is not None)
        n_sets = int(min(256, max(2, math.ceil(2 * L2_BYTES / set_bytes))))
        sets = [first] + [_make_set(batch, gamma, vocab, params, device, gen) for _ in range(n_sets - 1)]

        logits, drafts, q, uniforms = first
        ref = verify(logits, drafts, q, params, uniforms, backend="reference")
        tri = verify(logits, drafts, q, params, uniforms, backend="triton")
        match = bool(torch.equal(ref.tokens, tri.tokens) and torch.equal(ref.num_accepted, tri.num_accepted))
        differ = [] if match else _disagreements(logits, drafts, q, params, uniforms, ref, tri)
        margins = [m for _, m in differ if m is not None]

        def run(backend: str) -> Callable[[int], Any]:
            return lambda i: verify(*sets[i % n_sets][:3], params, sets[i % n_sets][3], backend=backend)

        reference_s, triton_s = alternating([run("reference"), run("triton")])
        graph_s: dict[str, float | None] = {}
        for backend in ("reference", "triton"):
            calls = [lambda s=s, b=backend: verify(*s[:3], params, s[3], backend=b) for s in sets]
            try:
                graph_s[backend] = graph_replay_seconds(calls)
            except Exception as error:  # noqa: BLE001 - report, do not stop the benchmark
                graph_s[backend] = None
                print(f"graph capture failed for {backend} at V={vocab} B={batch} γ={gamma} {mode}: {error}")
        nbytes = _minimal_bytes(batch, gamma, vocab, mode)
        kernel_s = graph_s["triton"] or triton_s
        rows.append({
            "vocab": vocab, "batch": batch, "gamma": gamma, "mode": mode, "match": match,
            "mismatched_sequences": len(differ), "max_mismatch_margin": max(margins) if margins else None,
            "mean_accepted": float(tri.num_accepted.float().mean()),
            "reference_us": reference_s * 1e6, "triton_us": triton_s * 1e6,
            "speedup": reference_s / triton_s,
            "reference_graph_us": None if graph_s["reference"] is None else graph_s["reference"] * 1e6,
            "triton_graph_us": None if graph_s["triton"] is None else graph_s["triton"] * 1e6,
            "graph_speedup": (graph_s["reference"] / graph_s["triton"]) if all(graph_s.values()) else None,
            "bytes": nbytes, "triton_bytes_per_second": nbytes / kernel_s, "input_sets": n_sets,
        })
        del sets, first, logits, drafts, q, uniforms, ref, tri
        torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict[str, Any]], copy_bw: float) -> str:
    """Markdown table of :func:`bench_verify` rows; bandwidth as a fraction of ``copy_bw``."""
    lines = [
        "| V | B | γ | mode | match | reference µs | Triton µs | speedup | graph: reference µs "
        "| graph: Triton µs | graph speedup | MB moved | TB/s | of copy bw |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x, spec: "—" if x is None else format(x, spec)  # noqa: E731
    for r in rows:
        bw = r["triton_bytes_per_second"]
        match = "yes" if r["match"] else f"{r.get('mismatched_sequences', '?')}/{r['batch']}"
        if not r["match"] and r.get("max_mismatch_margin") is not None:
            match += f" (≤{r['max_mismatch_margin']:.0e})"
        lines.append(
            f"| {r['vocab']} | {r['batch']} | {r['gamma']} | {r['mode']} | {match} "
            f"| {r['reference_us']:.1f} | {r['triton_us']:.1f} | {r['speedup']:.1f}× "
            f"| {fmt(r.get('reference_graph_us'), '.1f')} | {fmt(r.get('triton_graph_us'), '.1f')} "
            f"| {fmt(r.get('graph_speedup'), '.1f')}{'' if r.get('graph_speedup') is None else '×'} | {r['bytes'] / 1e6:.2f} | {bw / 1e12:.2f} | {bw / copy_bw:.0%} |"
        )
    lines.append("")
    lines.append(
        "match: both backends gave the same tokens for the same uniforms; otherwise the number of "
        "sequences that differ and the largest relative distance of such a decision from its "
        "boundary (float rounding: ~1e-7). "
        "Eager columns include Python launch costs; graph columns replay the calls from one CUDA "
        "graph (kernel time). MB moved: the Triton path's minimal traffic (logits read once; "
        "sampling adds row n of the logits and of q per sequence); TB/s divides it by the graph "
        "time. top_p also runs the PyTorch top-p preprocessing (sorts), which MB moved leaves out."
    )
    return "\n".join(lines)


def _disagreements(logits, drafts, q, params, uniforms, ref, tri) -> list[tuple[str, float | None]]:
    """Each sequence where the backends differ: ("accept" or "draw", relative distance of the
    reference's decision from its boundary; None for greedy). Diagnostic: reads back."""
    out: list[tuple[str, float | None]] = []
    gamma, vocab = drafts.shape[1], logits.shape[2]
    bad = ((ref.tokens != tri.tokens).any(1) | (ref.num_accepted != tri.num_accepted)).nonzero()
    for b in bad.flatten().tolist():
        n_ref, n_tri = int(ref.num_accepted[b]), int(tri.num_accepted[b])
        kind = "accept" if n_ref != n_tri else "draw"
        if not params.do_sample:
            out.append((kind, None))
            continue
        p = probabilities(logits[b], params)  # [k+1, V] float32
        if kind == "accept":
            i = min(n_ref, n_tri)
            d = int(drafts[b, i])
            q_d = 1.0 if q is None else float(q[b, i, d])
            p_d = float(p[i, d])
            out.append((kind, abs(float(uniforms[b, i]) * q_d - p_d) / max(p_d, 1e-300)))
            continue
        n = n_ref
        if n == gamma:
            q_n = torch.zeros_like(p[n])
        elif q is None:
            q_n = torch.nn.functional.one_hot(drafts[b, n], vocab).float()
        else:
            q_n = q[b, n].float()
        w = torch.clamp(p[n] - q_n, min=0.0)
        w = (w if float(w.sum()) > 0 else p[n]).double()
        cdf = torch.cumsum(w, 0)
        threshold = float(uniforms[b, gamma]) * float(cdf[-1])
        tokens = [int(ref.tokens[b, n]), int(tri.tokens[b, n])]
        edges = [float(cdf[t]) for t in tokens] + [float(cdf[t - 1]) for t in tokens if t > 0]
        out.append((kind, min(abs(e - threshold) for e in edges) / float(cdf[-1])))
    return out


def parity_stress(
    device: str | torch.device = "cuda",
    vocab: int = 128256,
    batch: int = 256,
    gamma: int = 4,
    mode: str = "temperature",
    rounds: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Compare the backends on ``rounds`` random inputs and measure how close each disagreement
    is to its decision boundary (a float-rounding flip has a relative margin near 1e-7).

    Returns counts of sequences, of disagreements in ``n`` (an accept test) and in the final
    token only (the draw), the margins and the largest one. Diagnostic: reads back.
    """
    params = MODE_PARAMS[mode]
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    report: dict[str, Any] = {"sequences": 0, "accept": 0, "draw": 0, "margins": []}
    for _ in range(rounds):
        logits, drafts, q, uniforms = _make_set(batch, gamma, vocab, params, device, gen)
        ref = verify(logits, drafts, q, params, uniforms, backend="reference")
        tri = verify(logits, drafts, q, params, uniforms, backend="triton")
        report["sequences"] += batch
        for kind, margin in _disagreements(logits, drafts, q, params, uniforms, ref, tri):
            report[kind] += 1
            report["margins"].append(margin)
    margins = [m for m in report["margins"] if m is not None]
    report["max_margin"] = max(margins) if margins else None
    return report
