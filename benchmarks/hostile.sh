#!/usr/bin/env bash
# Hostile and malformed requests against `flashspec serve` (`flashspec bench hostile`): a 20 MB prompt, a
# 10,000-character stop string, deep JSON, lone surrogates, unsupported fields, a wrong model, no API key,
# headers sent a byte a second, SIGTERM and a second SIGTERM; each case's HTTP status, and `/health`'s
# slowest answer and a concurrent stream's longest gap while it runs. The server runs as its own process
# with its default limits. BENCHMARKS.md, "The server".
#
# Usage: benchmarks/hostile.sh OUT      (writes OUT/hostile.{md,json})
# Environment: TOKENIZER [../shared/tokenizers/qwen2.5]; TARGET [none: a random-weight Qwen2 of 2 layers over
#   the tokenizer's vocabulary, written to a temporary folder].
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT" >&2; exit 2; }
python=${PYTHON:-python3}
dest=$1
tokenizer=${TOKENIZER:-../shared/tokenizers/qwen2.5}
[ -d "$tokenizer" ] || { echo "no tokenizer at $tokenizer (set TOKENIZER)" >&2; exit 1; }
target_args=(); [ -n "${TARGET:-}" ] && target_args=(--target "$TARGET")
mkdir -p "$dest"
"$python" -m flashspec bench hostile --tokenizer "$tokenizer" "${target_args[@]}" --out "$dest"
