#!/usr/bin/env bash
# Drafters trained on the target's own answers to real conversations, as ablations at equal GPU time
# (BENCHMARKS.md, "Drafters and their training"): `flashspec distill` answers ShareGPT conversations turn
# by turn (and corpus prompts) into token shards; `train-drafter` trains, for the same minutes each, a
# last-layer feature drafter and a fused-feature one (EAGLE-3's taps), both on the loss mask of the
# target's answers; `bench acceptance` gives tokens per step on MT-bench and HumanEval for them, the
# committed general drafter and n-gram, chain γ ∈ {3, 5, 7}; `bench training` tabulates their cost.
# Run it again with RESUME=1 to train both further on their schedules (the data folder is kept).
# DATA trains on distilled folders already made instead of distilling, e.g. the one kept in the repository:
#   STAGES="train eval" DATA=benchmarks/results/drafter-training/h100/data benchmarks/drafter-training.sh TARGET OUT
#
# Usage: benchmarks/drafter-training.sh TARGET OUT
#   writes OUT/data/ (shards, manifest.json; not with DATA), OUT/ckpt/DESIGN/ for each of DESIGNS,
#   OUT/acceptance-{mt-bench,humaneval}/, OUT/training.{md,json}
# Environment (defaults in brackets):
#   STAGES ["data train eval"; with DATA "train eval"]  the parts to run
#   DATA [OUT/data]                distilled folders to train on, separated by spaces (each passed as --data);
#                                  with DATA the data stage does not run (naming it in STAGES is an error)
#   SHAREGPT [fetched]             the ShareGPT JSON; CORPUS [../shared/corpus]
#   MTBENCH, HUMANEVAL             [$FLASHSPEC_MTBENCH, $FLASHSPEC_HUMANEVAL, else fetched]
#   CONVERSATIONS [4000]           ShareGPT conversations; CORPUS_COUNT [512] corpus prompts per domain
#   NEW_TOKENS [256]               tokens per answer; MAX_CONTEXT [2048] tokens before an answer
#   DISTILL_BATCH [64]             answers decoded together
#   DISTILL_MINUTES [no limit]     distilling stops between shards after this long; the next run continues it
#   DESIGNS ["last fused"]         the drafters trained: last (the last layer), fused (EAGLE-3's taps, --unroll 7),
#                                  fused-rN (fused with a rank-N fuse, --fuse-rank N); RESUME [0]: 1 trains each
#                                  further on its schedule
#   FUSE_RANK [full rank]          the fused design's --fuse-rank: its fuse map as a rank-R product
#                                  (taps·hidden → R → hidden), a smaller checkpoint (SPEC.md §11.8)
#   MINUTES [8]                    per drafter and run; STEPS_PER_RUN [6000]: one run's slice, ended by MINUTES
#   TOTAL_STEPS [30000]            the schedule over every run; BATCH [16] and SEQ_LEN [512] of training
#   BASELINES                      [the committed general drafter and ngram]: measured beside
#   TRAINING_BASELINE              [the committed general drafter]: tabulated beside
#   TEMPERATURES ["0 1"], EVAL_GAMMAS ["3,5,7"], ACCEPTANCE [token; "token,block" measures both]
#   MT_PER_CATEGORY [10: all 80 MT-bench questions, both turns], PROBLEMS [164 HumanEval problems]
#   EVAL_TOKENS [256]              new tokens per benchmark request (answers end at EOS)
#   EVAL_BATCH [16]                requests decoded together (tokens per step do not depend on it)
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 TARGET OUT" >&2; exit 2; }
python=${PYTHON:-python3}
target=$1 dest=$2
corpus=${CORPUS:-../shared/corpus}
committed=flashspec/checkpoints/qwen2.5-coder-1.5b-instruct
fs() { "$python" -m flashspec "$@"; }
sharegpt=(); [ -n "${SHAREGPT:-}" ] && sharegpt=(--sharegpt-file "$SHAREGPT")
mtbench=(); [ -n "${MTBENCH:-}" ] && mtbench=(--mtbench-file "$MTBENCH")
humaneval=(); [ -n "${HUMANEVAL:-}" ] && humaneval=(--humaneval-file "$HUMANEVAL")

data=(); for folder in ${DATA:-}; do data+=(--data "$folder"); done
stages=${STAGES:-$([ ${#data[@]} -gt 0 ] && echo "train eval" || echo "data train eval")}
stage() { [[ " $stages " == *" $1 "* ]]; }
designs=(${DESIGNS:-last fused})
if [ ${#data[@]} -gt 0 ]; then
  stage data && { echo "DATA names folders to train on: leave data out of STAGES" >&2; exit 2; }
  for folder in ${DATA}; do
    [ -f "$folder/manifest.json" ] || { echo "DATA: $folder is not a distilled folder (no manifest.json)" >&2; exit 2; }
  done
else
  data=(--data "$dest/data")
fi
for design in "${designs[@]}"; do
  [[ $design =~ ^(last|fused|fused-r[1-9][0-9]*)$ ]] || { echo "DESIGNS: unknown design $design" >&2; exit 2; }
done
mkdir -p "$dest/ckpt"

# The data: made once, continued where a stopped run left it.
stage data && fs distill --target "$target" --source mixed "${sharegpt[@]}" --conversations "${CONVERSATIONS:-4000}" \
    --max-turns 4 --corpus "$corpus" --domain all --count "${CORPUS_COUNT:-512}" --batch "${DISTILL_BATCH:-64}" \
    --max-new-tokens "${NEW_TOKENS:-256}" --max-context "${MAX_CONTEXT:-2048}" --no-progress \
    ${DISTILL_MINUTES:+--max-minutes "$DISTILL_MINUTES"} --out "$dest/data"

# The designs, the same minutes each, on the same data and schedule.
train=(train-drafter --target "$target" "${data[@]}" --batch "${BATCH:-16}" --seq-len "${SEQ_LEN:-512}"
       --estimate-every 200
       --lr-layers 3e-4 --lr-head 3e-4 --steps "${STEPS_PER_RUN:-6000}" --max-minutes "${MINUTES:-8}")
for design in "${designs[@]}"; do
  stage train || break
  taps=()
  case $design in
    fused) taps=(--taps --unroll 7 ${FUSE_RANK:+--fuse-rank "$FUSE_RANK"}) ;;
    fused-r*) taps=(--taps --unroll 7 --fuse-rank "${design#fused-r}") ;;
  esac
  if [ "${RESUME:-0}" = 1 ] && [ -d "$dest/ckpt/$design" ]; then
    fs "${train[@]}" "${taps[@]}" --total-steps "${TOTAL_STEPS:-30000}" --resume "$dest/ckpt/$design" \
        --out "$dest/ckpt/$design.next"
    rm -rf "$dest/ckpt/$design" && mv "$dest/ckpt/$design.next" "$dest/ckpt/$design"
  else
    fs "${train[@]}" --total-steps "${TOTAL_STEPS:-30000}" --width 512 --heads 4 --draft-vocab 32768 "${taps[@]}" \
        --out "$dest/ckpt/$design"
  fi
done

# Tokens per step on the field's benchmarks (greedy and sampled), every drafter × γ.
# Answers end at the target's EOS (the benchmarks' convention); tokens per step, not speed: no compile.
drafts=(); for design in "${designs[@]}"; do drafts+=(--draft "feature:$dest/ckpt/$design"); done
for d in ${BASELINES:-feature:$committed/general ngram}; do drafts+=(--draft "$d"); done
eval=(--gammas "${EVAL_GAMMAS:-3,5,7}" --acceptance "${ACCEPTANCE:-token}" --styles chat
      --max-new-tokens "${EVAL_TOKENS:-256}" --batch "${EVAL_BATCH:-16}")
stage eval || exit 0
for t in ${TEMPERATURES:-0 1}; do
  fs bench acceptance --target "$target" "${drafts[@]}" "${eval[@]}" --temperature "$t" --workload mt-bench \
      "${mtbench[@]}" --prompts-per-domain "${MT_PER_CATEGORY:-10}" --out "$dest/acceptance-mt-bench-t$t"
  fs bench acceptance --target "$target" "${drafts[@]}" "${eval[@]}" --temperature "$t" --workload humaneval \
      "${humaneval[@]}" --prompts-per-domain "${PROBLEMS:-164}" --out "$dest/acceptance-humaneval-t$t"
done
trained=(); for design in "${designs[@]}"; do trained+=("$dest/ckpt/$design"); done
fs bench training "${trained[@]}" ${TRAINING_BASELINE-$committed/general} --out "$dest/training"
