#!/usr/bin/env bash
# Tensor parallelism on one host (SPEC.md §9): `flashspec bench tp` in 1, 2 and, where the host has 4 GPUs,
# 4 processes (float32 greedy equality with one process, χ² of the sampled law, throughput of a
# Llama-3-8B-shaped target with random weights), then the markdown summary. BENCHMARKS.md,
# "Tensor parallelism".
#
# Usage: benchmarks/tp.sh OUT [extra `flashspec bench tp` options, e.g. --no-compile]
#   writes OUT/tp1.json, OUT/tp2.json (OUT/tp4.json) and OUT/tp.md
# Environment: TP_GPUS (default: every visible GPU; TP_GPUS=2 with --smoke is a CPU dry run on gloo).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUT [bench tp options]" >&2; exit 2; }
python=${PYTHON:-python3}
dest=$1; shift
# NVLink multicast stays off, in NCCL, PyTorch and NVSHMEM, for every process torchrun starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=${TP_GPUS:-$("$python" -c 'import torch; print(torch.cuda.device_count())')}
mkdir -p "$dest"
for n in 1 2 4; do
  [ "$n" -le "$gpus" ] || continue
  # torchrun, spelled as a module so that it is the same Python's.
  "$python" -m torch.distributed.run --standalone --nproc-per-node "$n" -m flashspec bench tp --out "$dest" "$@"
done
"$python" -m flashspec bench tp --summarize "$dest"
