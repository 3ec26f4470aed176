#!/usr/bin/env bash
# Issue 20 on the H200: drafters made from Qwen2.5-Coder-1.5B-Instruct, trained, measured and
# compared in one run. Each stage is a separate command that writes its own files, so that one
# failure (or the device time running out) loses that stage only; the stages come in order of
# what the issue needs most:
#   0. the GGUF pair as bfloat16 safetensors folders (each later process loads in seconds), with
#      every CUDA test running beside the conversion;
#   1. self-distilled data: chat-formatted requests cut from each domain's training text,
#      answered by the target (`flashspec distill`; kept in OUTDIR/distilled.tar.xz);
#   2. the general compact feature drafter (the product: unrolled passes and the feature loss,
#      SPEC.md §11.6), alone on the GPU: trained further from the committed one (BASE) for
#      GENERAL_MINUTES, or from scratch with BASE=none; then, several processes sharing the GPU,
#      its per-domain low-rank deltas and a shallow drafter; then the shallow drafter's per-domain
#      deltas beside the acceptance bench (which times nothing that is reported);
#   3. acceptance per drafter × γ × domain × style (`flashspec bench acceptance`);
#   4. the step anatomy of the feature and shallow drafters (`flashspec bench gpu`);
#   5. end to end, batch 8 and 1, greedy and T = 0.7, 256 new tokens (`flashspec bench e2e`);
#   6. with COMPARE=1: the session-13 comparisons at equal steps (one pass without the feature
#      loss, corpus text only, full width) against the same design trained as long.
# Expects /tmp/models/{target,draft}.gguf (joined from `split -b` pieces (size: BENCHMARKS.md "How the H200 runs were made")), the gguf wheel in
# .whl/ and the corpus in device_carry/corpus (see BENCHMARKS.md "How the H200 runs were made").
# Usage: bash benchmarks/selfdraft_h200.sh OUTDIR   (prints "== done" at the end; "== trained"
# when the checkpoints to keep are in OUTDIR/keep.tar)
# GENERAL_MINUTES, DELTA_MINUTES, COMPARE_STEPS, DISTILL_COUNT, ACC_PROMPTS and B1_PROMPTS shrink it;
# GAMMAS=2,4 runs the end-to-end arms at those draft lengths (default 4);
# TRAIN=0 measures the committed feature drafters as they are (only the shallow ones train);
# SHALLOW=0 leaves the shallow drafters out (no training, no rows); ANATOMY=0 and E2E=0 skip stages 4
# and 5 (with TRAIN=0 SHALLOW=0 ACCEPTANCE=0 ANATOMY=0 E2E=0 it only converts and runs the tests,
# for serve_h200.sh and never_slower_h200.sh); ACCEPTANCE=0 skips stage 3
# (the committed drafters' acceptance was measured in an earlier run: it does not depend on speed);
# GPU_TESTS=EXPR runs only the CUDA tests pytest's -k EXPR selects;
# DISTILLED=FILE unpacks an earlier run's distilled.tar.xz instead of distilling again (with
# TRAIN=0 SHALLOW=0 nothing trains, and nothing is distilled).
set -uo pipefail
out=${1:?usage: selfdraft_h200.sh OUTDIR}
begun=$(date +%s)
mkdir -p "$out/ckpt" /tmp/data
source benchmarks/h200_prepare.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
run() { local name=$1; shift; stamp "$name"; "$@" > "$out/$name.log" 2>&1; local rc=$?; stamp "$name exit $rc"; return $rc; }
together() { local pids=(); for job in "$@"; do eval "run $job" & pids+=($!); done; wait "${pids[@]}"; }
fs() { python3 -m flashspec.cli "$@"; }
convert() {  # one model, GGUF -> bf16 safetensors folder (both at once: the machine has 16 cores)
python3 - "$1" <<'EOF'
import sys, torch
from flashspec.models import load_model, load_tokenizer
name = sys.argv[1]
model = load_model(f"/tmp/models/{name}.gguf", "cpu", torch.bfloat16)
model.hf_quantizer = None  # dequantized already: save plain bfloat16 tensors
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(f"/tmp/hf/{name}")
load_tokenizer(f"/tmp/models/{name}.gguf").save_pretrained(f"/tmp/hf/{name}")
EOF
}

stamp "gpu tests (every CUDA test, verify reuse, and the unrolled-training test on this transformers)"
timeout 420 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_gpu.py tests/test_shallow_reuse.py \
    "tests/test_feature_drafter.py::test_unrolled_passes_compute_what_the_drafter_computes_at_each_draft_depth" \
    ${GPU_TESTS:+-k "$GPU_TESTS"} > "$out/gpu_tests.log" 2>&1 &
tests=$!
stamp "convert"
convert draft > "$out/convert_draft.log" 2>&1 &
drafting=$!
convert target > "$out/convert.log" 2>&1
stamp "convert target exit $?"
wait $drafting; stamp "convert draft exit $?"
T=/tmp/hf/target
C=device_carry/corpus
ck=$out/ckpt
file() { case $1 in chat) echo "$C/dialogue.txt.xz" ;; *) echo "$C/$1.txt.xz" ;; esac; }
have() { local list=(); for d in "$@"; do [ -f "$ck/${d#*:}/drafter.json" ] && list+=(--draft "${d%%:*}:$ck/${d#*:}"); done; echo "${list[@]}"; }

if [ -n "${DISTILLED:-}" ]; then  # a carried distilled.tar.xz of an earlier run: the same data, no GPU time
  tar xJf "$DISTILLED" -C /tmp/data; stamp "distilled data from $DISTILLED"
elif [ "${TRAIN:-1}" = 0 ] && [ "${SHALLOW:-1}" = 0 ]; then
  stamp "nothing trains: no distilled data"
else
  for d in code prose chat; do
    run "distill_$d" fs distill --target $T --corpus $C --domain $d --style chat --count ${DISTILL_COUNT:-768} \
        --batch 256 --max-new-tokens 256 --no-progress --out /tmp/data/distilled-$d.txt
  done
  (cd /tmp/data && tar cJf "$out/distilled.tar.xz" distilled-*.txt) &  # a later session can carry it
fi
wait $tests; stamp "gpu tests exit $?"

raw="--data $C/code.txt.xz --data $C/prose.txt.xz --data $C/dialogue.txt.xz"
dist="--data /tmp/data/distilled-code.txt --data /tmp/data/distilled-prose.txt --data /tmp/data/distilled-chat.txt"
train="train-drafter --target $T --batch 16 --seq-len 512 --estimate-every 100"
compact="--width 512 --heads 4 --draft-vocab 32768"
lr="--lr-layers 5e-4 --lr-head 5e-4"
BASE=${BASE:-flashspec/checkpoints/qwen2.5-coder-1.5b-instruct/general}
G=${GENERAL_MINUTES:-4}
# The product, alone on the GPU: its seconds are its training cost (a drafter trained further
# records the earlier runs too: `flashspec bench training` adds them up).
COMMITTED=flashspec/checkpoints/qwen2.5-coder-1.5b-instruct
if [ "${TRAIN:-1}" = 0 ]; then  # measure the committed feature drafters as they are
  mkdir -p $ck && cp -r $COMMITTED/general $COMMITTED/code $COMMITTED/prose $COMMITTED/chat $ck/
elif [ "$BASE" = none ]; then
  run train_general fs $train $raw $dist $compact $lr --steps 6000 --max-minutes $G --out $ck/general
else
  run train_general fs $train $raw $dist --base $BASE --lr-layers 3e-4 --lr-head 3e-4 --steps 6000 \
      --max-minutes $G --out $ck/general || cp -r $BASE $ck/general  # else the committed one, as it is
fi
# Four processes sharing the GPU: the per-domain deltas (the checkpoints to keep) and a shallow drafter.
M=${DELTA_MINUTES:-2}
jobs=()
for d in code prose chat; do
  [ "${TRAIN:-1}" = 0 ] && break
  jobs+=("train_$d fs $train --data $(file $d) --data /tmp/data/distilled-$d.txt --base $ck/general --rank 32 \
          --lr-layers 1e-3 --lr-head 1e-3 --steps 3000 --max-minutes $M --out $ck/$d")
done
[ "${SHALLOW:-1}" = 1 ] && jobs+=("train_shallow fs $train --kind shallow $raw $dist --layers 1 --head-width 512 $lr \
        --steps 3000 --max-minutes $M --out $ck/shallow")
[ ${#jobs[@]} -gt 0 ] && together "${jobs[@]}"
(cd $out && tar cf keep.tar ckpt/general ckpt/code ckpt/prose ckpt/chat 2>/dev/null)
stamp "trained"

# The shallow drafter's per-domain deltas, beside the acceptance bench of everything else (it
# reports acceptance only, which sharing the GPU does not change).
main=$(have feature:general feature:code feature:prose feature:chat shallow:shallow)
acc="bench acceptance --target $T --corpus $C --gammas 2,4,8 --styles text,chat --batch 12 --max-new-tokens 64"
acc="$acc --prompts-per-domain ${ACC_PROMPTS:-12} --device cuda --dtype bfloat16 --no-warm-up --no-progress"
jobs=("acceptance fs $acc --draft /tmp/hf/draft --draft ngram --draft early-exit:21 $main --out $out/acceptance")
if [ -f "$ck/shallow/drafter.json" ]; then
  for d in code prose chat; do
    jobs+=("train_shallow_$d fs $train --kind shallow --data $(file $d) --data /tmp/data/distilled-$d.txt \
            --base $ck/shallow --rank 32 --lr-layers 1e-3 --lr-head 1e-3 --steps 3000 --max-minutes 1.2 \
            --out $ck/shallow-$d")
  done
fi
if [ "${ACCEPTANCE:-1}" = 1 ]; then
  together "${jobs[@]}"
  extra=$(have shallow:shallow-code shallow:shallow-prose shallow:shallow-chat)
  [ -n "$extra" ] && run acceptance_shallow fs $acc $extra --out $out/acceptance_shallow
fi

# Step anatomy (alone: these are timings): the forwards as graph replays against a measured step.
[ "${ANATOMY:-1}" = 0 ] && [ "${E2E:-1}" = 0 ] && { stamp "done"; exit 0; }
gpu="bench gpu --target $T --corpus $C --shaped= --no-kernels --no-maps --no-hf --prompts-per-domain 2"
[ -f "$ck/general/drafter.json" ] && run gpu_feature fs $gpu --draft feature:$ck/general --out $out/gpu_feature
[ -f "$ck/shallow/drafter.json" ] && run gpu_shallow fs $gpu --draft shallow:$ck/shallow --out $out/gpu_shallow

e2e="bench e2e --target $T --corpus $C --device cuda --dtype bfloat16 --compile --systems flashspec,flashspec-fixed
     --gammas ${GAMMAS:-4} --regimes long --style chat --no-progress"
feat=$(have feature:general feature:code feature:prose feature:chat)
# Batch 8 first (session 15 ran out before it; batch 1 of the same code is in selfdraft_h200_s15/).
few="--draft /tmp/hf/draft $(have feature:general)"
for t in 0 0.7; do
  [ "${E2E:-1}" = 0 ] && break
  run "e2e_b8_t$t" fs $e2e $few --batch-sizes 8 --prompts-per-domain 8 --temperature $t --out $out/e2e_b8_t$t
done
[ "${E2E:-1}" = 0 ] || run e2e_b1_t0 fs $e2e --draft /tmp/hf/draft $main --batch-sizes 1 --prompts-per-domain ${B1_PROMPTS:-3} \
    --temperature 0 --out $out/e2e_b1_t0
[ "${E2E:-1}" = 0 ] || run e2e_b1_t0.7 fs $e2e --draft /tmp/hf/draft $feat --batch-sizes 1 --prompts-per-domain ${B1_PROMPTS:-3} \
    --temperature 0.7 --out $out/e2e_b1_t0.7

if [ "${COMPARE:-0}" = 1 ]; then  # session 13's comparisons (BENCHMARKS.md "What each choice is worth")
  S=${COMPARE_STEPS:-300}
  short="--steps $S"
  together "train_cmp_design fs $train $raw $dist $compact $lr $short --out $ck/cmp-design" \
           "train_cmp_onepass fs $train $raw $dist $compact $lr --unroll 1 --feature-weight 0 $short --out $ck/cmp-onepass" \
           "train_cmp_rawonly fs $train $raw $compact $lr $short --out $ck/cmp-rawonly" \
           "train_cmp_fullwidth fs $train $raw $dist --draft-vocab 32768 $lr $short --out $ck/cmp-fullwidth"
  stamp "compared"
fi
stamp "done"
