#!/usr/bin/env bash
# Issue 20 on the H200: drafters made from Qwen2.5-Coder-1.5B-Instruct, trained, measured and
# compared in one run, each stage a separate command so that one failure loses one result.
#   0. the GGUF pair as bfloat16 safetensors folders (every later process loads in seconds);
#   1. self-distilled data: chat-formatted requests cut from each domain's training text,
#      answered by the target (`flashspec distill`);
#   2. training (`flashspec train-drafter`): the general compact feature drafter (the product),
#      per-domain low-rank deltas over it; then, with fewer steps, the same design with the full
#      vocabulary, a full-width one and one on corpus text only (compared with the general one at
#      equal steps through the logged estimates); a shallow drafter;
#   3. acceptance per drafter × γ × domain × style (`flashspec bench acceptance`);
#   4. end to end, batch 1 and 8, greedy and T = 0.7, 256 new tokens (`flashspec bench e2e`).
# Expects /tmp/models/{target,draft}.gguf (joined from `split -b 55m` pieces), the gguf wheel in
# .whl/ and the corpus in device_carry/corpus (see BENCHMARKS.md "How the H200 runs were made").
# Usage: bash benchmarks/selfdraft_h200.sh OUTDIR   (prints "== done" at the end)
set -uo pipefail
out=${1:?usage: selfdraft_h200.sh OUTDIR}
mkdir -p "$out/ckpt" /tmp/data
source benchmarks/h200_prepare.sh
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
run() { local name=$1; shift; stamp "$name"; "$@" > "$out/$name.log" 2>&1; stamp "$name exit $?"; }
fs() { python3 -m flashspec.cli "$@"; }

stamp "gpu tests (the drafters made from the target, natively; beside the CPU-bound conversion)"
python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_gpu.py -k "feature or shallow or compact or early" \
    > "$out/gpu_tests.log" 2>&1 &
tests=$!
stamp "convert"
python3 - <<'EOF' > "$out/convert.log" 2>&1
import torch
from flashspec.models import load_model, load_tokenizer
for name in ("target", "draft"):
    model = load_model(f"/tmp/models/{name}.gguf", "cpu", torch.bfloat16)
    model.hf_quantizer = None  # dequantized already: save plain bfloat16 tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(f"/tmp/hf/{name}")
    load_tokenizer(f"/tmp/models/{name}.gguf").save_pretrained(f"/tmp/hf/{name}")
EOF
stamp "convert exit $?"
wait $tests; stamp "gpu tests exit $?"
T=/tmp/hf/target
C=device_carry/corpus
ck=$out/ckpt
file() { case $1 in chat) echo "$C/dialogue.txt.xz" ;; *) echo "$C/$1.txt.xz" ;; esac; }

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
run train_general fs "${train[@]}" "${raw[@]}" "${dist[@]}" "${compact[@]}" "${lr[@]}" --steps ${STEPS:-1200} \
    --max-minutes 2.5 --out $ck/general
for d in code prose chat; do
  run "train_$d" fs "${train[@]}" --data "$(file $d)" --data /tmp/data/distilled-$d.txt --base $ck/general \
      --rank 16 "${lr[@]}" --steps ${DELTA_STEPS:-250} --max-minutes 0.5 --out $ck/$d
done
# the comparisons, each against the general drafter's own estimate at the same step
run train_fullvocab fs "${train[@]}" "${raw[@]}" "${dist[@]}" --width 512 --heads 4 "${lr[@]}" --steps $S \
    --max-minutes 0.75 --out $ck/general-fullvocab
run train_fullwidth fs "${train[@]}" "${raw[@]}" "${dist[@]}" --draft-vocab 32768 "${lr[@]}" --steps $S \
    --max-minutes 0.75 --out $ck/general-fullwidth
run train_rawonly fs "${train[@]}" "${raw[@]}" "${compact[@]}" "${lr[@]}" --steps $S --max-minutes 0.75 \
    --out $ck/general-rawonly
run train_shallow fs "${train[@]}" --kind shallow "${raw[@]}" "${dist[@]}" --layers 1 --head-width 512 "${lr[@]}" \
    --steps $S --max-minutes 0.75 --out $ck/shallow
stamp "trained"

drafters=(--draft /tmp/hf/draft --draft ngram --draft early-exit:21 --draft feature:$ck/general
          --draft feature:$ck/code --draft feature:$ck/prose --draft feature:$ck/chat
          --draft feature:$ck/general-fullvocab --draft feature:$ck/general-fullwidth --draft shallow:$ck/shallow)
run acceptance fs bench acceptance --target $T "${drafters[@]}" --corpus $C --gammas 2,4,8 --styles text,chat \
    --prompts-per-domain ${ACC_PROMPTS:-16} --batch 16 --max-new-tokens 64 --device cuda --dtype bfloat16 \
    --no-warm-up --no-progress --out $out/acceptance

e2e=(bench e2e --target $T --corpus $C --device cuda --dtype bfloat16 --compile --systems flashspec,flashspec-fixed
     --gammas 4 --regimes long --style chat --no-progress)
all=(--draft /tmp/hf/draft --draft feature:$ck/general --draft feature:$ck/code --draft feature:$ck/prose
     --draft feature:$ck/chat)
few=(--draft /tmp/hf/draft --draft feature:$ck/general)
for t in 0 0.7; do
  run "e2e_b1_t$t" fs "${e2e[@]}" "${all[@]}" --batch-sizes 1 --prompts-per-domain ${B1_PROMPTS:-3} \
      --temperature $t --out $out/e2e_b1_t$t
done
for t in 0 0.7; do
  run "e2e_b8_t$t" fs "${e2e[@]}" "${few[@]}" --batch-sizes 8 --prompts-per-domain 8 --temperature $t \
      --out $out/e2e_b8_t$t
done
stamp "done"
