# Sourced by the benchmark scripts that take `TARGET DRAFTER... OUT`: reads those arguments and the
# environment's PYTHON, CORPUS and DEVICE, and checks the inputs exist. Sets python, target, drafters,
# draft_args (--draft D for each), dest, corpus and device.
[ $# -ge 3 ] || { echo "usage: $0 TARGET DRAFTER... OUT" >&2; exit 2; }
python=${PYTHON:-python3}
target=$1; shift
dest=${!#}
drafters=("${@:1:$#-1}")
corpus=${CORPUS:-../shared/corpus}
case $target in /*|./*|../*|*.gguf) [ -e "$target" ] || { echo "no target at $target" >&2; exit 1; } ;; esac
[ -d "$corpus" ] || { echo "no corpus at $corpus (set CORPUS)" >&2; exit 1; }
device=${DEVICE:-$("$python" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
draft_args=(); for d in "${drafters[@]}"; do draft_args+=(--draft "$d"); done
