#!/usr/bin/env bash
# Never slower than the target alone: FlashSpec's default configuration (selector "auto": Thompson sampling
# over every drafter × γ and the target-only arm, behind the never-slower guard, SPEC.md §8) beside the
# target alone and every fixed arm, request by request, on chat-formatted held-out requests, batch 1
# (`flashspec bench e2e --systems flashspec,flashspec-fixed,flashspec-auto`). BENCHMARKS.md, "Never slower
# than the target alone".
#
# Usage: benchmarks/never-slower.sh TARGET DRAFTER... OUT
#   writes OUT/t{T}/e2e.{md,json} for each temperature T; e2e.md ends with the "Never slower" table
# Environment (defaults in brackets): DEVICE [cuda if present, else cpu], CORPUS [../shared/corpus],
#   TEMPERATURES ["0 0.7"], PROMPTS per domain [8], GAMMAS [4], SEED [0: which held-out snippets],
#   AUTO_SLACKS (e.g. "default,0.02": one default-configuration system per guard δ, side by side),
#   AUTO_SELECTORS (e.g. "default,request": one per selector behind the guard).
set -euo pipefail
source "$(dirname "$0")/inputs.sh"
compile=(); [ "$device" = cpu ] || compile=(--compile)
auto=()
[ -n "${AUTO_SLACKS:-}" ] && auto+=(--auto-slacks "$AUTO_SLACKS")
[ -n "${AUTO_SELECTORS:-}" ] && auto+=(--auto-selectors "$AUTO_SELECTORS")
mkdir -p "$dest"
for t in ${TEMPERATURES:-0 0.7}; do
  "$python" -m flashspec bench e2e --target "$target" "${draft_args[@]}" --corpus "$corpus" \
      --device "$device" --dtype bfloat16 "${compile[@]}" --systems flashspec,flashspec-fixed,flashspec-auto \
      --gammas "${GAMMAS:-4}" --regimes long --style chat --batch-sizes 1 --prompts-per-domain "${PROMPTS:-8}" \
      --temperature "$t" --seed "${SEED:-0}" "${auto[@]}" --no-progress --out "$dest/t$t"
done
