#!/usr/bin/env bash
# Issue 20 on the H200: drafters made from Qwen2.5-Coder-1.5B-Instruct, trained, measured and
# compared in one run. Each stage is a separate command that writes its own files, so that one
# failure (or the device time running out) loses that stage only; the stages come in order of
# what the issue needs most:
#   0. the GGUF pair as bfloat16 safetensors folders (each later process loads in seconds), with
#      the CUDA tests of the drafters made from the target running beside the conversion;
#   1. self-distilled data: chat-formatted requests cut from each domain's training text,
#      answered by the target (`flashspec distill`);
#   2. the general compact feature drafter (the product) and per-domain low-rank deltas over it
#      (`flashspec train-drafter`);
#   3. acceptance per drafter × γ × domain × style (`flashspec bench acceptance`);
#   4. end to end, batch 1 and 8, greedy and T = 0.7, 256 new tokens (`flashspec bench e2e`);
#   5. the comparisons, each against the general drafter's own estimate at the same step: the
#      full vocabulary, full width, corpus text only, one pass without the feature loss (the
#      session-12 design), and a shallow drafter; then their acceptance.
# Expects /tmp/models/{target,draft}.gguf (joined from `split -b 55m` pieces), the gguf wheel in
# .whl/ and the corpus in device_carry/corpus (see BENCHMARKS.md "How the H200 runs were made").
# Usage: bash benchmarks/selfdraft_h200.sh OUTDIR   (prints "== done" at the end)
# STEPS, SHORT_STEPS, DELTA_STEPS, DISTILL_COUNT, ACC_PROMPTS and B1_PROMPTS shrink it.
set -uo pipefail
out=${1:?usage: selfdraft_h200.sh OUTDIR}
mkdir -p "$out/ckpt" /tmp/data
source benchmarks/h200_prepare.sh
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
run() { local name=$1; shift; stamp "$name"; "$@" > "$out/$name.log" 2>&1; stamp "$name exit $?"; }
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

stamp "gpu tests"
python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_gpu.py -k "feature or shallow or compact or early" \
    > "$out/gpu_tests.log" 2>&1 &
tests=$!
stamp "convert"
convert draft > "$out/convert_draft.log" 2>&1 &
drafting=$!
convert target > "$out/convert.log" 2>&1
stamp "convert target exit $?"
wait $drafting; stamp "convert draft exit $?"
wait $tests; stamp "gpu tests exit $?"
T=/tmp/hf/target
C=device_carry/corpus
ck=$out/ckpt
file() { case $1 in chat) echo "$C/dialogue.txt.xz" ;; *) echo "$C/$1.txt.xz" ;; esac; }
have() { local list=(); for d in "$@"; do [ -f "$ck/${d#*:}/drafter.json" ] && list+=(--draft "${d%%:*}:$ck/${d#*:}"); done; echo "${list[@]}"; }

for d in code prose chat; do
  run "distill_$d" fs distill --target $T --corpus $C --domain $d --style chat --count ${DISTILL_COUNT:-768} \
      --batch 256 --max-new-tokens 256 --no-progress --out /tmp/data/distilled-$d.txt
done

raw=(--data "$C/code.txt.xz" --data "$C/prose.txt.xz" --data "$C/dialogue.txt.xz")
dist=(--data /tmp/data/distilled-code.txt --data /tmp/data/distilled-prose.txt --data /tmp/data/distilled-chat.txt)
train=(train-drafter --target $T --batch 16 --seq-len 512 --estimate-every 100)
compact=(--width 512 --heads 4 --draft-vocab 32768)
lr=(--lr-layers 5e-4 --lr-head 5e-4)
S=${SHORT_STEPS:-400}
run train_general fs "${train[@]}" "${raw[@]}" "${dist[@]}" "${compact[@]}" "${lr[@]}" --steps ${STEPS:-1500} \
    --max-minutes 4 --out $ck/general
for d in code prose chat; do
  run "train_$d" fs "${train[@]}" --data "$(file $d)" --data /tmp/data/distilled-$d.txt --base $ck/general \
      --rank 32 --lr-layers 1e-3 --lr-head 1e-3 --steps ${DELTA_STEPS:-500} --max-minutes 1.25 --out $ck/$d
done
stamp "trained"

main=$(have feature:general feature:code feature:prose feature:chat)
run acceptance fs bench acceptance --target $T --draft /tmp/hf/draft --draft ngram --draft early-exit:21 $main \
    --corpus $C --gammas 2,4,8 --styles text,chat --prompts-per-domain ${ACC_PROMPTS:-16} --batch 16 \
    --max-new-tokens 64 --device cuda --dtype bfloat16 --no-warm-up --no-progress --out $out/acceptance

e2e=(bench e2e --target $T --corpus $C --device cuda --dtype bfloat16 --compile --systems flashspec,flashspec-fixed
     --gammas 4 --regimes long --style chat --no-progress)
few=(--draft /tmp/hf/draft $(have feature:general))
for t in 0 0.7; do
  run "e2e_b1_t$t" fs "${e2e[@]}" --draft /tmp/hf/draft $main --batch-sizes 1 --prompts-per-domain ${B1_PROMPTS:-3} \
      --temperature $t --out $out/e2e_b1_t$t
done
for t in 0 0.7; do
  run "e2e_b8_t$t" fs "${e2e[@]}" "${few[@]}" --batch-sizes 8 --prompts-per-domain 8 --temperature $t \
      --out $out/e2e_b8_t$t
done

run train_fullvocab fs "${train[@]}" "${raw[@]}" "${dist[@]}" --width 512 --heads 4 "${lr[@]}" --steps $S \
    --max-minutes 1 --out $ck/general-fullvocab
run train_fullwidth fs "${train[@]}" "${raw[@]}" "${dist[@]}" --draft-vocab 32768 "${lr[@]}" --steps $S \
    --max-minutes 1 --out $ck/general-fullwidth
run train_rawonly fs "${train[@]}" "${raw[@]}" "${compact[@]}" "${lr[@]}" --steps $S --max-minutes 1 \
    --out $ck/general-rawonly
run train_onepass fs "${train[@]}" "${raw[@]}" "${dist[@]}" "${compact[@]}" "${lr[@]}" --unroll 1 --feature-weight 0 \
    --steps $S --max-minutes 1 --out $ck/general-onepass
run train_shallow fs "${train[@]}" --kind shallow "${raw[@]}" "${dist[@]}" --layers 1 --head-width 512 "${lr[@]}" \
    --steps $S --max-minutes 1 --out $ck/shallow
comparisons=$(have feature:general-fullvocab feature:general-fullwidth feature:general-rawonly feature:general-onepass \
              shallow:shallow)
[ -n "$comparisons" ] && run acceptance_comparisons fs bench acceptance --target $T $comparisons \
    --corpus $C --gammas 2,4,8 --styles text,chat --prompts-per-domain ${ACC_PROMPTS:-16} --batch 16 \
    --max-new-tokens 64 --device cuda --dtype bfloat16 --no-warm-up --no-progress --out $out/acceptance_comparisons
stamp "done"
