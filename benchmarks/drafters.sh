#!/usr/bin/env bash
# Drafters and their training on a CUDA GPU: optionally train the feature drafters (a general one and a
# low-rank delta per domain, on corpus text and self-distilled chat requests) and a shallow drafter; then
# tokens per step and acceptance for every drafter × γ × domain × prompt style (`flashspec bench acceptance`),
# and the training cost of the feature drafters read from their checkpoints (`flashspec bench training`).
# BENCHMARKS.md, "Drafters and their training".
#
# Usage: benchmarks/drafters.sh TARGET DRAFTER... OUT
#   DRAFTER  the drafters to measure, e.g. a 0.5B model, ngram, early-exit:21, feature:DIR, shallow:DIR
#   writes OUT/acceptance/, OUT/training.{md,json}; with TRAIN=1 also OUT/data/ and OUT/ckpt/
# Environment (defaults in brackets): CORPUS [../shared/corpus], TRAIN [0: measure the drafters as given;
#   1: train first, and measure the trained ones too], BASE [the committed general drafter: train it
#   further; "none": from scratch], GENERAL_MINUTES [4], DELTA_MINUTES [2], SHALLOW [1 with TRAIN=1],
#   CHECKPOINTS [the committed feature drafters, or the trained ones with TRAIN=1: the training table's rows].
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 TARGET DRAFTER... OUT" >&2; exit 2; }
python=${PYTHON:-python3}
target=$1; shift
dest=${!#}
drafters=("${@:1:$#-1}")
corpus=${CORPUS:-../shared/corpus}
committed=flashspec/checkpoints/qwen2.5-coder-1.5b-instruct
case $target in /*|./*|../*|*.gguf) [ -e "$target" ] || { echo "no target at $target" >&2; exit 1; } ;; esac
for f in code prose dialogue; do
  [ -f "$corpus/$f.txt.xz" ] || { echo "no $corpus/$f.txt.xz (set CORPUS)" >&2; exit 1; }
done
fs() { "$python" -m flashspec "$@"; }
text() { case $1 in chat) echo "$corpus/dialogue.txt.xz" ;; *) echo "$corpus/$1.txt.xz" ;; esac; }
mkdir -p "$dest"
checkpoints=("$committed/general" "$committed/code" "$committed/prose" "$committed/chat")

if [ "${TRAIN:-0}" = 1 ]; then
  data=$dest/data ck=$dest/ckpt
  mkdir -p "$data" "$ck"
  for d in code prose chat; do  # self-distilled data: chat requests cut from training text, the target's answers
    fs distill --target "$target" --corpus "$corpus" --domain $d --style chat --count 768 --batch 256 \
        --max-new-tokens 256 --no-progress --out "$data/distilled-$d.txt"
  done
  raw=(--data "$(text code)" --data "$(text prose)" --data "$(text chat)")
  dist=(--data "$data/distilled-code.txt" --data "$data/distilled-prose.txt" --data "$data/distilled-chat.txt")
  train=(train-drafter --target "$target" --batch 16 --seq-len 512 --estimate-every 100)
  base=${BASE:-$committed/general}
  if [ "$base" = none ]; then
    fs "${train[@]}" "${raw[@]}" "${dist[@]}" --width 512 --heads 4 --draft-vocab 32768 --lr-layers 5e-4 \
        --lr-head 5e-4 --steps 6000 --max-minutes "${GENERAL_MINUTES:-4}" --out "$ck/general"
  else
    fs "${train[@]}" "${raw[@]}" "${dist[@]}" --base "$base" --lr-layers 3e-4 --lr-head 3e-4 --steps 6000 \
        --max-minutes "${GENERAL_MINUTES:-4}" --out "$ck/general"
  fi
  for d in code prose chat; do
    fs "${train[@]}" --data "$(text $d)" --data "$data/distilled-$d.txt" --base "$ck/general" --rank 32 \
        --lr-layers 1e-3 --lr-head 1e-3 --steps 3000 --max-minutes "${DELTA_MINUTES:-2}" --out "$ck/$d"
  done
  checkpoints=("$ck/general" "$ck/code" "$ck/prose" "$ck/chat")
  for c in "${checkpoints[@]}"; do drafters+=("feature:$c"); done
  if [ "${SHALLOW:-1}" = 1 ]; then
    fs "${train[@]}" --kind shallow "${raw[@]}" "${dist[@]}" --layers 1 --head-width 512 --lr-layers 5e-4 \
        --lr-head 5e-4 --steps 3000 --max-minutes "${DELTA_MINUTES:-2}" --out "$ck/shallow"
    drafters+=("shallow:$ck/shallow")
  fi
fi
[ -n "${CHECKPOINTS:-}" ] && read -r -a checkpoints <<< "$CHECKPOINTS"

draft_args=(); for d in "${drafters[@]}"; do draft_args+=(--draft "$d"); done
fs bench acceptance --target "$target" "${draft_args[@]}" --corpus "$corpus" --gammas 2,4,8 --styles text,chat \
    --batch 12 --max-new-tokens 64 --prompts-per-domain 12 --device cuda --dtype bfloat16 --no-warm-up \
    --no-progress --out "$dest/acceptance"
fs bench training "${checkpoints[@]}" --out "$dest"
