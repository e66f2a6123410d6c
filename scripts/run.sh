#!/usr/bin/env bash
# Train on one node with N processes (one per GPU; on a CPU-only machine, N gloo ranks).
#
#   scripts/run.sh CONFIG [NPROC] [train.py options...]
#   scripts/run.sh configs/ms1mv3_r50 8
#   scripts/run.sh configs/debug_cpu 2 --set max_steps=20
#
# NPROC defaults to the number of visible GPUs (1 when there is none).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
config=$1
shift
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
    nproc=$1
    shift
else
    nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "${nproc:-0}" -ge 1 ] || nproc=1
fi
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
exec "$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc" train.py "$config" "$@"
