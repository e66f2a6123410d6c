#!/usr/bin/env bash
# Train on one node with N processes (one per GPU; on a CPU-only machine, N gloo ranks).
#
#   scripts/run.sh CONFIG [NPROC] [train.py options...]
#   scripts/run.sh configs/ms1mv3_r50 8
#   scripts/run.sh configs/debug_cpu 2 --set max_steps=20
#
# NPROC defaults to the number of visible GPUs: the entries of CUDA_VISIBLE_DEVICES when it is set, else
# every GPU nvidia-smi lists (1 when there is none).
# Python: $PYTHON when set, else .venv/bin/python when the repository has one, else python3 from PATH.
# Exit status: 2 for a usage error (usage on stderr); otherwise torchrun's own.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/.."
# The help is the comment block above: every line from the second up to the first that is not a comment.
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$self"; }
case ${1:-} in
    "") usage >&2; exit 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "run.sh: unknown option $1; the first argument is the config (see --help)" >&2; exit 2 ;;
esac
config=$1
shift
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
    nproc=$1
    shift
    [ "$nproc" -ge 1 ] || { echo "run.sh: NPROC must be >= 1, got $nproc" >&2; exit 2; }
elif [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # torch sees only these GPUs: one rank per entry
    nproc=$(printf '%s\n' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c '[^[:space:]]' || true)
    [ "${nproc:-0}" -ge 1 ] || nproc=1
else
    nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "${nproc:-0}" -ge 1 ] || nproc=1
fi
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
exec "$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc" train.py "$config" "$@"
