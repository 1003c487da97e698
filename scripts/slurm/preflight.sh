#!/bin/bash
# Checks one node before training starts. The torchrun templates run it once on every node of the
# allocation (`srun --ntasks-per-node=1 bash scripts/slurm/preflight.sh`) and start no rank when
# any node fails, so a bad node costs seconds instead of a failed 480-rank start-up.
#
# Reads (the templates export them):
#   GPUS_PER_NODE   GPUs this node must have; 0 = CPU-only run, no GPU check
#   GPU_COUNT_CMD   command that prints the number of GPUs the ranks will see; empty or unset:
#                   torch's count (also catches a CPU-only torch build or a driver torch cannot use)
#   CPU_BIND        numa | cores | none; numa needs the numactl program (torchrun --numa-binding)
#   OUT_DIR         optional: must be a writable directory here ...
#   OUT_DIR_MARKER  ... holding this file, written by the batch shell on the first node: proves
#                   that OUT_DIR is the same shared file system on every node
#
# Prints one line per problem, `moetrain preflight: <node>: <problem>`, and exits 1 if there is any.

set -uo pipefail

node=$(hostname -s)
problems=0
problem() {
    echo "moetrain preflight: $node: $*" >&2
    problems=$((problems + 1))
}

GPUS_PER_NODE=${GPUS_PER_NODE:?GPUS_PER_NODE must be set}
torch_gpu_count='python -c "import torch; print(torch.cuda.device_count())"'
GPU_COUNT_CMD=${GPU_COUNT_CMD:-$torch_gpu_count}
CPU_BIND=${CPU_BIND:-none}

if [[ ! $GPUS_PER_NODE =~ ^(0|[1-9][0-9]*)$ ]]; then  # no leading 0: bash reads 08 as octal
    problem "GPUS_PER_NODE must be an integer >= 0, got '$GPUS_PER_NODE'"
elif [[ $GPUS_PER_NODE -gt 0 ]]; then
    # `timeout`: a GPU stuck in the driver can hang the count; report it instead of hanging too.
    count=$(timeout 120 bash -c "$GPU_COUNT_CMD" 2>&1 | tail -n 1)
    if [[ ! $count =~ ^[0-9]+$ ]]; then
        problem "could not count GPUs with \`$GPU_COUNT_CMD\`: ${count:-no output}"
    elif [[ $count -lt $GPUS_PER_NODE ]]; then
        problem "$count GPU(s) visible, this job needs $GPUS_PER_NODE per node (GPUS_PER_NODE):" \
            "ask SLURM for them (--gpus-per-node), or set GPUS_PER_NODE=0 for a CPU-only run"
    fi
fi

if [[ $CPU_BIND == numa ]] && ! command -v numactl >/dev/null; then
    problem "CPU_BIND=numa (torchrun --numa-binding) needs the numactl program, which is not" \
        "installed (Debian/Ubuntu: apt install numactl; RHEL: dnf install numactl);" \
        "or set CPU_BIND=cores (bind by core order, no NUMA topology) or CPU_BIND=none"
fi

if [[ -n ${OUT_DIR:-} ]]; then
    if [[ ! -d $OUT_DIR || ! -w $OUT_DIR ]]; then
        problem "OUT_DIR=$OUT_DIR is not a writable directory on this node"
    elif [[ -n ${OUT_DIR_MARKER:-} && ! -e $OUT_DIR/$OUT_DIR_MARKER ]]; then
        problem "OUT_DIR=$OUT_DIR is not the file system the first node writes to" \
            "($OUT_DIR_MARKER is missing here): put OUT_DIR on a file system every node shares"
    fi
fi

if [[ $problems -gt 0 ]]; then
    exit 1
fi
echo "moetrain preflight: $node: ok (GPUs: ${count:-not checked}, CPU_BIND=$CPU_BIND)"
