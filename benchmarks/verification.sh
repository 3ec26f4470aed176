#!/usr/bin/env bash
# Token-wise against block verification (SPEC.md §2, "Block verification"): tokens per step (τ) and decode
# tokens/s of each rule side by side in one run, per drafter × γ, on MT-bench (both turns) and HumanEval.
# Greedy runs show that the rules agree there (identical τ by construction); sampled runs show what block
# verification adds in expectation. One engine per arm, every arm on the same requests and seeds.
#
# Usage: benchmarks/verification.sh TARGET DRAFTER... OUT
#   writes OUT/{mt-bench,humaneval}-t{T}/acceptance.{md,json,png}
# Environment (defaults in brackets): DEVICE [cuda if present, else cpu], CORPUS [../shared/corpus],
#   TEMPERATURES ["0 0.7 1"], GAMMAS ["3,5,7"], MT_PER_CATEGORY [10: all 80 questions], PROBLEMS [164],
#   NEW_TOKENS [256], BATCH [16], MTBENCH / HUMANEVAL [fetched], COMPILE [1 on CUDA: compiled decode forwards].
set -euo pipefail
source "$(dirname "$0")/inputs.sh"
compile=(); [ "$device" = cpu ] || [ "${COMPILE:-1}" = 0 ] || compile=(--compile)
mtbench=(); [ -n "${MTBENCH:-}" ] && mtbench=(--mtbench-file "$MTBENCH")
humaneval=(); [ -n "${HUMANEVAL:-}" ] && humaneval=(--humaneval-file "$HUMANEVAL")
mkdir -p "$dest"
common=(--target "$target" "${draft_args[@]}" --device "$device" "${compile[@]}" --acceptance token,block
        --styles chat --gammas "${GAMMAS:-3,5,7}" --max-new-tokens "${NEW_TOKENS:-256}" --batch "${BATCH:-16}"
        --corpus "$corpus" --no-progress)
for t in ${TEMPERATURES:-0 0.7 1}; do
  "$python" -m flashspec bench acceptance "${common[@]}" --temperature "$t" --workload mt-bench "${mtbench[@]}" \
      --prompts-per-domain "${MT_PER_CATEGORY:-10}" --out "$dest/mt-bench-t$t"
  "$python" -m flashspec bench acceptance "${common[@]}" --temperature "$t" --workload humaneval "${humaneval[@]}" \
      --prompts-per-domain "${PROBLEMS:-164}" --out "$dest/humaneval-t$t"
done
