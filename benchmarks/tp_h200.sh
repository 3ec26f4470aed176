#!/usr/bin/env bash
# Tensor-parallel runs on one host (SPEC.md §9, README "Several GPUs"): 1, 2 and, where the host
# has 4 GPUs, 4 processes of `python -m flashspec bench tp`, then a markdown summary.
#
#   benchmarks/tp_h200.sh [OUT_DIR] [extra `flashspec bench tp` options, e.g. --no-compile]
#
# Writes OUT_DIR/tp1.json, tp2.json (tp4.json) and tp.md. Run from the repository root.
set -euo pipefail
OUT=${1:-benchmarks/results/tp}
shift || true
PYTHON=${PYTHON:-python3}

# NVLink multicast stays off, in NCCL, PyTorch and NVSHMEM, for every process torchrun starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

GPUS=${TP_GPUS:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}  # TP_GPUS=2 with --smoke: CPU dry run
echo "GPUs: $GPUS; results in $OUT"
for n in 1 2 4; do
  if [ "$n" -gt "$GPUS" ]; then continue; fi
  # torchrun, spelled as a module so that it is the same Python's.
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$n" -m flashspec bench tp --out "$OUT" "$@"
done
"$PYTHON" -m flashspec bench tp --summarize "$OUT"
