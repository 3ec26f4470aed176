# Session 30's three device calls (an H100 each time: the device tool lent no H200), in order.
# 1. pdl_probe/ — tree 173d925 (bit-exact kernels still launched with PDL), no model files:
nvidia-smi --query-gpu=name --format=csv,noheader; CASES=forward,maps bash benchmarks/exact_bf16_h200.sh $OUT
# 2. the whole run (this folder's top level) — tree 57c59d5 (bit-exact maps and attention launched without
#    PDL): the demo pair's 32 pieces copied to /tmp/pieces one call each (models/pair.NN, `split -b 48m` of
#    target.gguf + draft.gguf), then
bash device_carry/launch.sh 420   # = join_and_start.sh here: joins, checks sha256, starts launch.sh (s30.sh)
bash /tmp/poll.sh 560             # = poll.sh here
# 3. forward_compiled/ — tree 2d2afca (the forward stage compiled, as the end-to-end cases run the target):
export FORWARD_SHAPES=qwen2.5-1.5b FORWARD_PDL_SETTINGS=1; CASES=forward bash benchmarks/exact_bf16_h200.sh $OUT
