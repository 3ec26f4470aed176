#!/usr/bin/env bash
# The default configuration as a user meets it (`flashspec bench requests`): a freshly built engine, chat-formatted
# requests of varied domains and lengths one by one (or 8 at a time), twice, then every arm alone on the same
# requests. Per request: the first pass over the warm one, the default over the target alone and over the best fixed
# arm, the steps each arm ran, cold steps; the start-up time. SPEC.md §7 "Warm shapes", §8.
#
# Usage: benchmarks/requests.sh TARGET DRAFTER... OUT
#   writes OUT/b{BATCH}_t{T}/requests.{md,json} for each batch size and temperature
# Environment (defaults in brackets): DEVICE [cuda if present, else cpu], CORPUS [../shared/corpus],
#   BATCHES ["1 8"], TEMPERATURES ["0 0.7"], REQUESTS [24], SEED [0]. On CUDA the engine is built with compile=True.
#   WORKLOAD [the command's default, corpus]: passed as --workload as given; MTBENCH / HUMANEVAL [fetched]: the files.
#   TREE=1: also draft trees on the same warm engine (--tree): a fixed tree@γ of every drafter's chain and
#   "tree auto", whose allocation is chosen every step from full information (SPEC.md §7), against the best single
#   fixed configuration over the stream. EXPAND [none; e.g. "feature-general=4,16", space-separated, with TREE=1]:
#   that drafter's part of each tree is a top-k expansion (--expand).
set -euo pipefail
source "$(dirname "$0")/inputs.sh"
compile=(); [ "$device" = cpu ] || compile=(--compile)
extra=()
[ -n "${WORKLOAD:-}" ] && extra+=(--workload "$WORKLOAD")
[ -n "${MTBENCH:-}" ] && extra+=(--mtbench-file "$MTBENCH")
[ -n "${HUMANEVAL:-}" ] && extra+=(--humaneval-file "$HUMANEVAL")
[ "${TREE:-0}" = 1 ] && extra+=(--tree)
for e in ${EXPAND:-}; do extra+=(--expand "$e"); done
mkdir -p "$dest"
for batch in ${BATCHES:-1 8}; do
  for t in ${TEMPERATURES:-0 0.7}; do
    "$python" -m flashspec bench requests --target "$target" "${draft_args[@]}" --corpus "$corpus" --device "$device" \
        "${compile[@]}" --requests "${REQUESTS:-24}" --batch "$batch" --temperature "$t" --seed "${SEED:-0}" \
        "${extra[@]}" --no-progress --out "$dest/b${batch}_t$t"
  done
done
