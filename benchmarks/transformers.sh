#!/usr/bin/env bash
# FlashSpec beside transformers: `generate()` (dynamic and static cache), assisted generation with the same
# model drafter, prompt lookup, and FlashSpec's systems on the same held-out prompts, greedy
# (`flashspec bench e2e`). BENCHMARKS.md, "Speed at batch 1".
#
# Usage: benchmarks/transformers.sh TARGET DRAFTER... OUT
#   writes OUT/b1/ (batch 1), and on CUDA OUT/b8/ (batch 8) and OUT/shaped_8b/ (random weights of the
#   Llama-3-8B shape and a Llama-3.2-1B-shaped drafter: step costs only; TARGET and DRAFTER unused there)
# Environment (defaults in brackets): DEVICE [cuda if present, else cpu], CORPUS [../shared/corpus],
#   REGIME [long on CUDA, short on the CPU], PROMPTS per domain [20], HF_PROMPTS [3 on CUDA: transformers'
#   systems run on the first N prompts of each domain only; ratios are paired on the prompts both ran],
#   GAMMAS [2,4], SYSTEMS [every system of `bench e2e`], B8 and SHAPED [1 on CUDA, 0 on the CPU].
set -euo pipefail
source "$(dirname "$0")/inputs.sh"
if [ "$device" = cpu ]; then gpu=0; extra=(); else gpu=1; extra=(--compile --hf-prompts-per-domain "${HF_PROMPTS:-3}"); fi
regime=${REGIME:-$([ $gpu = 1 ] && echo long || echo short)}
systems=(); [ -n "${SYSTEMS:-}" ] && systems=(--systems "$SYSTEMS")
run() { "$python" -m flashspec bench e2e --device "$device" --dtype bfloat16 --regimes "$regime" --no-progress "$@"; }
mkdir -p "$dest"
run --target "$target" "${draft_args[@]}" --corpus "$corpus" "${extra[@]}" "${systems[@]}" --gammas "${GAMMAS:-2,4}" \
    --batch-sizes 1 --prompts-per-domain "${PROMPTS:-20}" --out "$dest/b1"
if [ "${B8:-$gpu}" = 1 ]; then
  run --target "$target" "${draft_args[@]}" --corpus "$corpus" --compile --gammas 4 --batch-sizes 8 \
      --prompts-per-domain 8 --systems hf,flashspec,flashspec-fixed,flashspec-auto --out "$dest/b8"
fi
if [ "${SHAPED:-$gpu}" = 1 ]; then
  run --shaped --compile --gammas 4 --batch-sizes 1 --prompts-per-domain 3 --hf-prompts-per-domain 1 \
      --systems hf,flashspec,flashspec-fixed --out "$dest/shaped_8b"
fi
