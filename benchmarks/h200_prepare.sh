# Sourced by the H200 session scripts: installs the carried gguf wheel, checks the model files
# joined from `split -b` pieces (size: BENCHMARKS.md "How the H200 runs were made") (/tmp/models/{target,draft}.gguf) and prints the GPU.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
sha256sum -c - <<SUMS || exit 1
cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  /tmp/models/target.gguf
1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  /tmp/models/draft.gguf
SUMS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
