#!/usr/bin/env bash
# Train on several nodes through torchrun's rendezvous. Prints the command for every node, or runs this
# node's command with --run.
#
#   scripts/dist.sh --nnodes 2 --nproc 8 --master-addr 10.0.0.1 [--master-port 29500] CONFIG [train.py options]
#       prints one torchrun line per node (copy each to its node)
#   scripts/dist.sh --nnodes 2 --nproc 8 --master-addr 10.0.0.1 --node-rank 1 --run CONFIG [train.py options]
#       runs node 1's line here
#
# Every node needs the same code, config and dataset path; the master address must be reachable from all.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
nnodes="" nproc="" master_addr="" master_port=29500 node_rank="" run=0
while [ $# -gt 0 ]; do
    case $1 in
        --nnodes) nnodes=$2; shift 2 ;;
        --nproc) nproc=$2; shift 2 ;;
        --master-addr) master_addr=$2; shift 2 ;;
        --master-port) master_port=$2; shift 2 ;;
        --node-rank) node_rank=$2; shift 2 ;;
        --run) run=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --*) echo "dist.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ -z "$nnodes" ] || [ -z "$nproc" ] || [ -z "$master_addr" ] || [ $# -lt 1 ]; then
    echo "dist.sh: --nnodes, --nproc, --master-addr and CONFIG are required (see --help)" >&2
    exit 2
fi
for v in "$nnodes" "$nproc" "$master_port" ${node_rank:+"$node_rank"}; do
    [[ $v =~ ^[0-9]+$ ]] || { echo "dist.sh: expected a whole number, got '$v'" >&2; exit 2; }
done
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
line() {  # the torchrun command of node $1, then train.py's arguments
    local r=$1
    shift
    printf '%q ' "$python" -m torch.distributed.run --nnodes="$nnodes" --node_rank="$r" \
        --nproc_per_node="$nproc" --master_addr="$master_addr" --master_port="$master_port" train.py "$@"
}
if [ "$run" -eq 1 ]; then
    [ -n "$node_rank" ] || { echo "dist.sh: --run needs --node-rank" >&2; exit 2; }
    [ "$node_rank" -lt "$nnodes" ] || { echo "dist.sh: --node-rank $node_rank must be < --nnodes $nnodes" >&2; exit 2; }
    exec "$python" -m torch.distributed.run --nnodes="$nnodes" --node_rank="$node_rank" --nproc_per_node="$nproc" \
        --master_addr="$master_addr" --master_port="$master_port" train.py "$@"
fi
for ((r = 0; r < nnodes; r++)); do
    if [ -n "$node_rank" ] && [ "$r" != "$node_rank" ]; then continue; fi
    echo "# node $r"
    echo "$(line "$r" "$@")"
done
