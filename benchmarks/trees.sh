#!/usr/bin/env bash
# Draft trees against chains at equal drafters (SPEC.md §7, "Draft trees in the decode loop"): tokens per step
# (τ) and decode tokens/s of each drafter alone as a fixed chain arm and of one tree per step holding every
# drafter's chain (`tree@γ`), on HumanEval and MT-bench (both turns), on the same requests and seeds.
#
# Usage: benchmarks/trees.sh TARGET DRAFTER... OUT
#   writes OUT/{humaneval,mt-bench}-t{T}/acceptance.{md,json,png}
# Environment (defaults in brackets): DEVICE [cuda if present, else cpu], CORPUS [../shared/corpus],
#   WORKLOADS ["humaneval mt-bench"], TEMPERATURES ["0 0.7"], GAMMAS ["3,5"], PER_CATEGORY [10 MT-bench
#   questions per category; 164 HumanEval problems], NEW_TOKENS [256], BATCH [1], DTYPE [bfloat16],
#   MTBENCH / HUMANEVAL [fetched], EXPAND [none; e.g. "feature-general=4,16": that drafter's part of each
#   tree is a top-k expansion, SPEC.md §7]. Tree steps replay CUDA graphs as chain steps do, but their forward
#   is never compiled (SPEC.md §3), so no arm is compiled here.
set -euo pipefail
source "$(dirname "$0")/inputs.sh"
files=(); [ -n "${MTBENCH:-}" ] && files+=(--mtbench-file "$MTBENCH")
for e in ${EXPAND:-}; do files+=(--expand "$e"); done
[ -n "${HUMANEVAL:-}" ] && files+=(--humaneval-file "$HUMANEVAL")
mkdir -p "$dest"
for workload in ${WORKLOADS:-humaneval mt-bench}; do
  per=${PER_CATEGORY:-}; [ -n "$per" ] || { [ "$workload" = humaneval ] && per=164 || per=10; }
  for t in ${TEMPERATURES:-0 0.7}; do
    "$python" -m flashspec bench acceptance --target "$target" "${draft_args[@]}" --device "$device" \
        --dtype "${DTYPE:-bfloat16}" --tree --styles chat --gammas "${GAMMAS:-3,5}" --temperature "$t" \
        --max-new-tokens "${NEW_TOKENS:-256}" --batch "${BATCH:-1}" --corpus "$corpus" --workload "$workload" \
        "${files[@]}" --prompts-per-domain "$per" --no-progress --out "$dest/$workload-t$t"
  done
done
