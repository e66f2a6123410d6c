#!/usr/bin/env bash
# Train on several nodes through torchrun's c10d rendezvous (hosted on the master address). Prints the
# command for every node, or runs this node's command with --run. --max-restarts N lets torchrun restart
# the group after a failure; the trainer then resumes from the newest complete checkpoint by itself.
#
#   scripts/dist.sh --nnodes 2 --nproc 8 --master-addr 10.0.0.1 [--master-port 29500] [--max-restarts 3] CONFIG [...]
#       prints one torchrun line per node (copy each to its node)
#   scripts/dist.sh --nnodes 2 --nproc 8 --master-addr 10.0.0.1 --node-rank 1 --run CONFIG [train.py options]
#       runs node 1's line here (--node-rank alone prints only that node's line)
#
# Every node needs the same code, config and dataset path; the master address must be reachable from all.
# Python: $PYTHON when set, else .venv/bin/python when the repository has one, else python3 from PATH.
# Exit status: 2 for a usage error (one line on stderr naming it; the usage without arguments); with --run,
# torchrun's own.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/.."
# The help is the comment block above: every line from the second up to the first that is not a comment.
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$self"; }
die() { echo "dist.sh: $*" >&2; exit 2; }
[ $# -gt 0 ] || { usage >&2; exit 2; }
nnodes="" nproc="" master_addr="" master_port=29500 node_rank="" run=0 max_restarts=0
while [ $# -gt 0 ]; do
    case $1 in
        --nnodes|--nproc|--master-addr|--master-port|--node-rank|--max-restarts)
            [ $# -ge 2 ] || die "$1 needs a value (see --help)"
            case $1 in
                --nnodes) nnodes=$2 ;;
                --nproc) nproc=$2 ;;
                --master-addr) master_addr=$2 ;;
                --master-port) master_port=$2 ;;
                --node-rank) node_rank=$2 ;;
                --max-restarts) max_restarts=$2 ;;
            esac
            shift 2 ;;
        --run) run=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
if [ -z "$nnodes" ] || [ -z "$nproc" ] || [ -z "$master_addr" ] || [ $# -lt 1 ]; then
    die "--nnodes, --nproc, --master-addr and CONFIG are required (see --help)"
fi
for opt in nnodes nproc master_port max_restarts ${node_rank:+node_rank}; do
    [[ ${!opt} =~ ^[0-9]+$ ]] || die "--${opt//_/-} must be a whole number, got '${!opt}'"
done
[ "$nnodes" -ge 1 ] || die "--nnodes must be >= 1, got $nnodes"
[ "$nproc" -ge 1 ] || die "--nproc must be >= 1, got $nproc"
if [ -n "$node_rank" ] && [ "$node_rank" -ge "$nnodes" ]; then
    die "--node-rank $node_rank must be < --nnodes $nnodes (node ranks are 0..$((nnodes - 1)))"
fi
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
# The c10d rendezvous (not the static --master_addr/--master_port one) so that a restart after a failure
# forms a fresh group; every node names the same endpoint and job id.
launcher() {  # the torchrun command of node $1, up to train.py
    printf '%q ' "$python" -m torch.distributed.run --nnodes="$nnodes" --node_rank="$1" --nproc_per_node="$nproc" \
        --rdzv-backend=c10d --rdzv-endpoint="$master_addr:$master_port" --rdzv-id=facetrain \
        --max-restarts="$max_restarts"
}
if [ "$run" -eq 1 ]; then
    [ -n "$node_rank" ] || die "--run needs --node-rank"
    eval "exec $(launcher "$node_rank") train.py $(printf '%q ' "$@")"
fi
for ((r = 0; r < nnodes; r++)); do
    if [ -n "$node_rank" ] && [ "$r" != "$node_rank" ]; then continue; fi
    echo "# node $r"
    echo "$(launcher "$r")train.py $(printf '%q ' "$@")"
done
