#!/usr/bin/env bash
# Issue 22 on the H200: bit-exact mode (SPEC.md §14) beside the default kernels, in one run per case.
# `flashspec bench e2e` with FlashSpec target-only and every fixed arm, each in both modes
# (--systems flashspec,flashspec-fixed,flashspec-exact,flashspec-fixed-exact), greedy:
#   drift — the report's greedy check: each default-mode arm against default target-only (today's
#           rate) and each bit-exact arm against bit-exact target-only (the mode's promise: all equal);
#   cost  — tokens/s of target-only and of each arm in each mode, batch 1 and 8 (ratios in one run).
# Cases: the demo pair on chat-formatted held-out requests (batch 1 and 8) and on held-out corpus
# text (batch 1), 8 prompts per domain (24); then the cost of one target forward in each mode
# (CUDA-graph replays, random weights of the Qwen2.5-1.5B and Llama-3-8B shapes, 1 or 5 tokens for
# 1 or 8 sequences after 512 cached positions, programmatic dependent launch on and off, each
# kernel's share of one eager one-token forward and the kernel timeline of one-token graph replays:
# OUTDIR/exact_forward.json; compiled as the end-to-end cases run the target, FORWARD_COMPILE=0 not;
# FORWARD_SHAPES and FORWARD_PDL_SETTINGS=1 (PDL on only) shrink it) and of each linear map
# of the Qwen2.5-1.5B shape alone at 1, 5, 8 and 40 rows, cold weights (OUTDIR/exact_maps.json);
# last the Llama-3-8B shape with random weights end to end (--shaped, batch 1).
# Expects the pair as bf16 folders in /tmp/hf/{target,draft}: run
#   TRAIN=0 SHALLOW=0 ACCEPTANCE=0 ANATOMY=0 E2E=0 bash benchmarks/selfdraft_h200.sh OUTDIR
# first (it converts the GGUF pair and runs the CUDA tests, the bit-exact ones among them).
# Usage: bash benchmarks/exact_bf16_h200.sh OUTDIR   (writes OUTDIR/exact_*/); PROMPTS (per domain,
# default 8) shrinks it; CASES (comma-separated, default chat_b1,chat_b8,text_b1,forward,maps,shaped_8b)
# picks cases: CASES=forward,maps,shaped_8b needs no model files.
set -uo pipefail
out=${1:?usage: exact_bf16_h200.sh OUTDIR}
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
ck=flashspec/checkpoints/qwen2.5-coder-1.5b-instruct
pair=(--target /tmp/hf/target --draft /tmp/hf/draft --draft ngram --draft "feature:$ck/general"
      --corpus device_carry/corpus --device cuda --dtype bfloat16 --compile --gammas 4 --regimes long --no-progress)
systems=flashspec,flashspec-fixed,flashspec-exact,flashspec-fixed-exact
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
want() { [[ ",${CASES:-chat_b1,chat_b8,text_b1,forward,maps,shaped_8b}," == *",$1,"* ]]; }
case_() {
  local name=$1; shift
  want "${name#exact_}" || return 0
  stamp "$name"
  timeout ${CASE_TIMEOUT:-540} python3 -m flashspec.cli bench e2e "$@" --systems $systems --out "$out/$name" \
      > "$out/$name.log" 2>&1
  stamp "$name exit $?"
}
case_ exact_chat_b1 "${pair[@]}" --style chat --batch-sizes 1 --prompts-per-domain ${PROMPTS:-8}
case_ exact_chat_b8 "${pair[@]}" --style chat --batch-sizes 8 --prompts-per-domain 8
case_ exact_text_b1 "${pair[@]}" --batch-sizes 1 --prompts-per-domain ${PROMPTS:-8}
if want forward; then
stamp "forward cost"  # one target forward replayed from a CUDA graph, both modes, widths and batches
timeout 300 python3 - "$out/exact_forward.json" > "$out/exact_forward.log" 2>&1 <<'PY'
import json, os, sys, torch
from flashspec.bench.gpu import shaped_model
from flashspec.bench.timing import forward_seconds
from flashspec.cache import StaticLM
from flashspec.graphs import Graphs
from flashspec.kernels import pdl
rows, profiles, replays = [], [], []
compiled = os.environ.get("FORWARD_COMPILE", "1") == "1"  # as `bench e2e --compile` runs the target
for shape in os.environ.get("FORWARD_SHAPES", "qwen2.5-1.5b,llama3-8b").split(","):
    model = shaped_model(shape)
    for exact in (False, True):
        lm = StaticLM(model, compile=compiled)
        lm.bit_exact = exact
        for use_pdl in (True, False)[:int(os.environ.get("FORWARD_PDL_SETTINGS", "2"))]:  # on (as the engine runs), off
            pdl.ENABLED = use_pdl      # read at every launch; each timing captures its own graph
            for batch, width in ((1, 1), (1, 5), (8, 1), (8, 5)):
                seconds = forward_seconds(lm, batch, width, context=512, iters=100)
                rows.append(dict(shape=shape, bit_exact=exact, pdl=use_pdl, batch=batch, width=width, seconds=seconds))
                print(rows[-1], flush=True)
            # the kernel timeline inside one-token graph replays: the time in kernels against the span
            graphs, tokens = Graphs(enabled=True), torch.zeros(1, 1, dtype=torch.long, device="cuda")
            start = torch.full((1,), 512, device="cuda")
            lm.reset(1, 520)
            step = lambda: graphs.run("forward", lambda: lm.forward(tokens, start))  # noqa: E731
            step(), step(), torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            ks = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in prof.events()
                        if e.device_type.name == "CUDA" and e.device_time_total > 0)
            busy, end, per = 0.0, None, {}
            for a, b, name in ks:  # union of kernel intervals; per-name device time
                busy += max(0.0, b - max(a, end if end is not None else a))
                end = b if end is None else max(end, b)
                per[name] = per.get(name, 0.0) + (b - a) / 5
            replays.append(dict(shape=shape, bit_exact=exact, pdl=use_pdl, kernels=len(ks) / 5,
                                span_us=(ks[-1][1] - ks[0][0]) / 5 if ks else None, busy_us=busy / 5,
                                kernel_us=sum(per.values()),
                                top=dict(sorted(per.items(), key=lambda kv: -kv[1])[:12])))
            print(replays[-1], flush=True)
        pdl.ENABLED = True
        # where a one-token forward's time goes: device time per kernel name, one eager forward
        tokens, start = torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.full((1,), 512, device="cuda")
        lm.reset(1, 520)
        lm.forward(tokens, start)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            lm.forward(tokens, start)
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.events():
            if e.device_type.name == "CUDA" and e.device_time_total > 0:
                kernels[e.name[:60]] = kernels.get(e.name[:60], 0.0) + e.device_time_total
        profiles.append(dict(shape=shape, bit_exact=exact, us=sum(kernels.values()),
                             kernels=dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10])))
        print(profiles[-1], flush=True)
    del model, lm
    torch.cuda.empty_cache()
for r in rows:  # against the default kernels with PDL on: what the engine runs by default
    base = next(b for b in rows if not b["bit_exact"] and b["pdl"] and all(b[k] == r[k] for k in ("shape", "batch", "width")))
    r["ratio_to_default"] = r["seconds"] / base["seconds"]
    print(f"{r['shape']} batch {r['batch']} width {r['width']} {'bit-exact' if r['bit_exact'] else 'default'} "
          f"PDL {'on' if r['pdl'] else 'off'}: / default (PDL on) = {r['ratio_to_default']:.3f}")
json.dump(dict(device=torch.cuda.get_device_name(), context=512, compiled=compiled, rows=rows, eager_profiles=profiles,
               replay_timelines=replays),
          open(sys.argv[1], "w"), indent=1)
PY
stamp "forward cost exit $?"
fi
if want maps; then
stamp "map cost"  # each linear map of the Qwen2.5-1.5B shape alone, graph replays, both modes, 1/5/8/40 rows
timeout 240 python3 - "$out/exact_maps.json" > "$out/exact_maps.log" 2>&1 <<'PY'
import json, sys, torch
import torch.nn.functional as F
from flashspec.bench.timing import graph_replay_seconds
from flashspec.kernels.decode_linear import MAX_ROWS, decode_linear
dev, bf16 = torch.device("cuda"), torch.bfloat16
maps = {"qkv": dict(n=2048, k=1536, norm=True, bias=True), "o": dict(n=1536, k=1536, residual=True),
        "gate_up": dict(n=8960, k=1536, norm=True, gated=True), "down": dict(n=1536, k=8960, residual=True),
        "head": dict(n=151936, k=1536, norm=True)}
rows_out = []
for name, m in maps.items():
    n, k, gated = m["n"], m["k"], m.get("gated", False)
    # as many copies as the model has layers (the head: 2), each read once per replay: the weights come
    # from memory, not from L2, as in a forward
    copies = 2 if name == "head" else 28
    ws = [torch.randn(2 * n if gated else n, k, device=dev, dtype=bf16) / k ** 0.5 for _ in range(copies)]
    bs = [torch.randn(w.shape[0], device=dev, dtype=bf16) if m.get("bias") else None for w in ws]
    g = torch.ones(k, device=dev, dtype=bf16) if m.get("norm") else None
    for rows in (1, 5, 8, 40):
        x = torch.randn(rows, k, device=dev, dtype=bf16)
        r = torch.randn(rows, n, device=dev, dtype=bf16) if m.get("residual") else None
        calls = lambda f: [lambda w=w, b=b: f(w, b) for w, b in zip(ws, bs)]  # noqa: E731
        exact = lambda w, b: decode_linear(x, w, b, g, 1e-6, r, gated, exact=True)  # noqa: E731
        # the default: decode_linear up to 16 rows, cuBLAS beyond (the norm and epilogue not counted)
        default = ((lambda w, b: decode_linear(x, w, b, g, 1e-6, r, gated)) if rows <= MAX_ROWS
                   else (lambda w, b: F.linear(x, w, b)))
        t_default = graph_replay_seconds(calls(default))
        t_exact = graph_replay_seconds(calls(exact))
        rows_out.append(dict(map=name, n=n, k=k, rows=rows, default_us=t_default * 1e6, exact_us=t_exact * 1e6,
                             ratio=t_exact / t_default))
        print(rows_out[-1], flush=True)
    del ws
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows_out), open(sys.argv[1], "w"), indent=1)
PY
stamp "map cost exit $?"
fi
case_ exact_shaped_8b --shaped --device cuda --dtype bfloat16 --compile --gammas 4 --regimes long --no-progress \
    --batch-sizes 1 --prompts-per-domain 3
stamp "done"
