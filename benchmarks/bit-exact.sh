#!/usr/bin/env bash
# Bit-exact mode (SPEC.md §14) beside the default kernels, greedy, on a CUDA GPU: target-only decoding and
# every fixed arm in both modes, side by side in one process (`flashspec bench e2e --systems
# flashspec,flashspec-fixed,flashspec-exact,flashspec-fixed-exact`). Each report's "Greedy outputs identical"
# line is the drift (default arms against default target-only, bit-exact arms against bit-exact
# target-only); its tokens/s table is the cost. BENCHMARKS.md, "Exactness".
#
# Usage: benchmarks/bit-exact.sh TARGET DRAFTER... OUT
#   cases: OUT/chat_b1, OUT/chat_b8 (chat-formatted held-out requests at batch 1 and 8), OUT/text_b1
#   (held-out corpus text), OUT/shaped_8b (random weights of the Llama-3-8B shape: TARGET and DRAFTER
#   unused), and OUT/forward.json: one target forward of the Qwen2.5-1.5B shape (random weights, 512
#   cached positions, compiled, replayed from a CUDA graph) in both modes at 1 or 8 sequences of 1 or 5
#   tokens, and the device time per kernel of one eager one-token forward.
# Environment (defaults in brackets): CORPUS [../shared/corpus], PROMPTS per domain [8],
#   CASES [chat_b1,chat_b8,text_b1,shaped_8b,forward].
set -euo pipefail
DEVICE=cuda  # the mode runs the Triton decode kernels on a CUDA GPU
source "$(dirname "$0")/inputs.sh"
want() { [[ ",${CASES:-chat_b1,chat_b8,text_b1,shaped_8b,forward}," == *",$1,"* ]]; }
both=(--device cuda --dtype bfloat16 --compile --gammas 4 --regimes long --no-progress
      --systems flashspec,flashspec-fixed,flashspec-exact,flashspec-fixed-exact)
pair=(--target "$target" "${draft_args[@]}" --corpus "$corpus" "${both[@]}")
prompts=${PROMPTS:-8}
mkdir -p "$dest"
e2e() { "$python" -m flashspec bench e2e "$@"; }
if want chat_b1; then e2e "${pair[@]}" --style chat --batch-sizes 1 --prompts-per-domain "$prompts" --out "$dest/chat_b1"; fi
if want chat_b8; then e2e "${pair[@]}" --style chat --batch-sizes 8 --prompts-per-domain 8 --out "$dest/chat_b8"; fi
if want text_b1; then e2e "${pair[@]}" --style text --batch-sizes 1 --prompts-per-domain "$prompts" --out "$dest/text_b1"; fi
if want shaped_8b; then e2e --shaped "${both[@]}" --batch-sizes 1 --prompts-per-domain 3 --out "$dest/shaped_8b"; fi
if want forward; then
"$python" - "$dest/forward.json" <<'PY'
import json, sys
import torch
from flashspec.bench.gpu import shaped_model
from flashspec.models.static import StaticLM
from flashspec.tuning.timing import forward_seconds

rows, profiles = [], []
model = shaped_model("qwen2.5-1.5b")
for exact in (False, True):
    lm = StaticLM(model, compile=True)  # as `bench e2e --compile` runs the target
    lm.bit_exact = exact
    for batch, width in ((1, 1), (1, 5), (8, 1), (8, 5)):  # replayed from a CUDA graph
        seconds = forward_seconds(lm, batch, width, context=512, iters=100)
        rows.append(dict(shape="qwen2.5-1.5b", bit_exact=exact, batch=batch, width=width, seconds=seconds))
        print(rows[-1], flush=True)
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
    profiles.append(dict(shape="qwen2.5-1.5b", bit_exact=exact, us=sum(kernels.values()),
                         kernels=dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10])))
    print(profiles[-1], flush=True)
for r in rows:
    base = next(b for b in rows if not b["bit_exact"] and (b["batch"], b["width"]) == (r["batch"], r["width"]))
    r["ratio_to_default"] = r["seconds"] / base["seconds"]
json.dump(dict(device=torch.cuda.get_device_name(), context=512, compiled=True, rows=rows, eager_profiles=profiles),
          open(sys.argv[1], "w"), indent=1)
PY
fi
