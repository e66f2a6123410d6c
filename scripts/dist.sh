#!/usr/bin/env bash
# Train on several nodes through torchrun's c10d rendezvous (hosted on the master address). Prints the
# command for every node, or runs this node's command with --run. --max-restarts N lets torchrun restart
# the group after a failure; the trainer then resumes from the newest complete checkpoint by itself.
#
#   scripts/dist.sh --nnodes 2 --nproc 8 --master-addr 10.0.0.1 [--master-port 29500] [--max-restarts 3] CONFIG [...]
#       prints one torchrun line per node (copy each to its node)
#   scripts/dist.sh --nnodes 2 --nproc 8 --master-addr 10.0.0.1 --node-rank 1 --run CONFIG [train.py options]
#       runs node 1's line here
#
# Every node needs the same code, config and dataset path; the master address must be reachable from all.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
nnodes="" nproc="" master_addr="" master_port=29500 node_rank="" run=0 max_restarts=0
while [ $# -gt 0 ]; do
    case $1 in
        --nnodes) nnodes=$2; shift 2 ;;
        --nproc) nproc=$2; shift 2 ;;
        --master-addr) master_addr=$2; shift 2 ;;
        --master-port) master_port=$2; shift 2 ;;
        --node-rank) node_rank=$2; shift 2 ;;
        --max-restarts) max_restarts=$2; shift 2 ;;
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
for v in "$nnodes" "$nproc" "$master_port" "$max_restarts" ${node_rank:+"$node_rank"}; do
    [[ $v =~ ^[0-9]+$ ]] || { echo "dist.sh: expected a whole number, got '$v'" >&2; exit 2; }
done
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
    [ -n "$node_rank" ] || { echo "dist.sh: --run needs --node-rank" >&2; exit 2; }
    [ "$node_rank" -lt "$nnodes" ] || { echo "dist.sh: --node-rank $node_rank must be < --nnodes $nnodes" >&2; exit 2; }
    eval "exec $(launcher "$node_rank") train.py $(printf '%q ' "$@")"
fi
for ((r = 0; r < nnodes; r++)); do
    if [ -n "$node_rank" ] && [ "$r" != "$node_rank" ]; then continue; fi
    echo "# node $r"
    echo "$(launcher "$r")train.py $(printf '%q ' "$@")"
done
