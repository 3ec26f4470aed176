#!/usr/bin/env bash
# The commands a new user runs on a CPU, with their defaults, each against the target alone, and what
# each prints about its choice: `flashspec demo`, `flashspec demo --drafter model`, `flashspec generate
# --compare` with the 0.5B model drafter and n-gram, and one chat request through `flashspec serve`
# (README's serve line) beside the same request through a server of the target alone.
# BENCHMARKS.md, section 4, "As a user meets it".
#
# Usage: benchmarks/defaults-cpu.sh OUT      (writes OUT/{demo,demo-model,generate,serve}.txt)
# Environment: PYTHON [python3], PORT [8019], TOKENS [64] new tokens of the serve request,
#   PARTS ["demo demo-model generate serve"]: the parts to run (the others' files are kept).
set -euo pipefail
python=${PYTHON:-python3}
dest=${1:?usage: $0 OUT}
port=${PORT:-8019}
tokens=${TOKENS:-64}
mkdir -p "$dest"
{ lscpu | grep -E "Model name|^CPU\(s\)"; grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } \
    > "$dest/cpu.txt"
part() { [[ " ${PARTS:-demo demo-model generate serve} " == *" $1 "* ]]; }
if part demo; then "$python" -m flashspec demo 2>/dev/null | tee "$dest/demo.txt"; fi
if part demo-model; then "$python" -m flashspec demo --drafter model 2>/dev/null | tee "$dest/demo-model.txt"; fi
read -r target feature draft < <("$python" -c "from flashspec.demo import DEMO_DRAFT, demo_pair, fetch_demo_model
print(*demo_pair(), fetch_demo_model(DEMO_DRAFT))")
prompt=$("$python" -c "from flashspec.demo import DEMO_PROMPT; print(DEMO_PROMPT)")
if part generate; then
  "$python" -m flashspec generate --target "$target" --draft "$draft" --draft ngram --prompt "$prompt" --compare \
      2>/dev/null | tee "$dest/generate.txt"
fi

serve_once() {  # $1: label; the rest: serve's --draft arguments
  local label=$1; shift
  "$python" -m flashspec serve --target "$target" "$@" --port "$port" --model-name flashspec > "$dest/serve-$label.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    kill -0 "$pid" 2> /dev/null || { echo "the server ($label) exited; see $dest/serve-$label.log" >&2; exit 1; }
    sleep 2
  done
  PROMPT=$prompt "$python" - "$port" "$tokens" "$label" <<'PY'
import json, os, sys, time, urllib.request
port, tokens, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
body = {"model": "flashspec", "messages": [{"role": "user", "content": os.environ["PROMPT"]}], "max_tokens": tokens,
        "temperature": 0}
request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
started = time.perf_counter()
answer = json.load(urllib.request.urlopen(request, timeout=3600))
seconds = time.perf_counter() - started
n = answer["usage"]["completion_tokens"]
print(f"[serve, {label}] {n} tokens in {seconds:.2f} s = {n / seconds:.2f} tokens/s")
PY
  kill "$pid"; wait "$pid" 2> /dev/null || true
}
part serve || exit 0
{
  serve_once default --draft "$feature" --draft ngram
  serve_once target-alone
  grep -h -i -E "chose|choice|dtype|drafter|slots" "$dest"/serve-*.log | sed 's/^/  printed: /'
} | tee "$dest/serve.txt"
