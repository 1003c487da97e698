# The body of the torchrun templates (train_torchrun.sbatch, m6_1t_480gpu.sbatch): checks, the
# preflight step on every node, then one torchrun per node. They source it from the repository
# root after setting their parameters:   source scripts/slurm/launch_torchrun.sh "$@"
# ("$@": trainer arguments, appended after those below).
#
# Set by the template: CONFIG, TRAIN_CMD, SHUTDOWN_TIMEOUT, SIGNAL_LEAD_S (the seconds of its
# #SBATCH --signal=TERM@...); optional OUT_DIR and DIST_TIMEOUT_S (passed to the trainer as
# --set out_dir=... / --set dist_timeout_s=... when not empty).
# Read from the environment, with these defaults:
#   GPUS_PER_NODE   GPUs each node must have: what SLURM granted (--gpus-per-node, --gres), 8 where
#                   the cluster does not manage GPUs. 0: CPU-only run (no GPU check, gloo)
#   RANKS_PER_NODE  torchrun ranks per node: GPUS_PER_NODE, or 1 on CPU-only runs
#   CPU_BIND        numa: torchrun --numa-binding=exclusive, each rank on its own cores of its GPU's
#                   NUMA node (needs numactl); the default with GPUs
#                   cores: scripts/slurm/bind_rank.py, rank i of n on the i-th of n blocks of the
#                   node's cores in NUMA-node order; the default without GPUs
#                   none: no binding
#   GPU_COUNT_CMD   how the preflight counts a node's GPUs (default: torch's count)
#   PORT            rendezvous port on the first node: 20000 + job id % 20000
#   OMP_NUM_THREADS CPU threads per rank: the node's CPUs / RANKS_PER_NODE (torchrun would set 1)
#   LAUNCH_CMD      the launcher, given torchrun's arguments: python -m moetrain.launch (torchrun
#                   with a one-line end on SIGTERM instead of a traceback)

fail() {
    echo "moetrain: $*" >&2
    exit 2
}

SLURM_HELPERS=scripts/slurm
[[ -f $SLURM_HELPERS/preflight.sh && -f $SLURM_HELPERS/bind_rank.py ]] ||
    fail "$SLURM_HELPERS/preflight.sh or bind_rank.py not found in $PWD: submit from the repository root"
[[ -f $CONFIG ]] || fail "config file '$CONFIG' not found (working directory: $PWD)"

GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-8}}}
GPUS_PER_NODE=${GPUS_PER_NODE##*:} # a typed request, "v100:8" -> 8
[[ $GPUS_PER_NODE =~ ^(0|[1-9][0-9]*)$ ]] || fail "GPUS_PER_NODE must be an integer >= 0, got '$GPUS_PER_NODE'"
RANKS_PER_NODE=${RANKS_PER_NODE:-$((GPUS_PER_NODE > 0 ? GPUS_PER_NODE : 1))}
[[ $RANKS_PER_NODE =~ ^[1-9][0-9]*$ ]] || fail "RANKS_PER_NODE must be an integer >= 1, got '$RANKS_PER_NODE'"
if [[ -z ${CPU_BIND:-} ]]; then
    CPU_BIND=$( ((GPUS_PER_NODE > 0)) && echo numa || echo cores)
fi
[[ $CPU_BIND =~ ^(numa|cores|none)$ ]] || fail "CPU_BIND must be one of numa, cores, none, got '$CPU_BIND'"
if [[ $CPU_BIND == numa && $GPUS_PER_NODE -eq 0 ]]; then
    fail "CPU_BIND=numa binds each rank near its GPU and needs GPUS_PER_NODE > 0; use CPU_BIND=cores"
fi
GPU_COUNT_CMD=${GPU_COUNT_CMD:-}
PORT=${PORT:-$((20000 + SLURM_JOB_ID % 20000))}
CPUS_PER_NODE=${SLURM_CPUS_ON_NODE:-$(nproc)}
CPUS_PER_RANK=$((CPUS_PER_NODE / RANKS_PER_NODE > 0 ? CPUS_PER_NODE / RANKS_PER_NODE : 1))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$CPUS_PER_RANK}
OUT_DIR=${OUT_DIR:-}
DIST_TIMEOUT_S=${DIST_TIMEOUT_S:-}
trainer_sets=()
if [[ -n $OUT_DIR ]]; then
    [[ $OUT_DIR == /* ]] || fail "OUT_DIR must be an absolute path (the same on every node), got '$OUT_DIR'"
    mkdir -p "$OUT_DIR" || fail "cannot create OUT_DIR=$OUT_DIR on $(hostname -s)"
    trainer_sets+=(--set "out_dir=$OUT_DIR")
fi
if [[ -n $DIST_TIMEOUT_S ]]; then
    trainer_sets+=(--set "dist_timeout_s=$DIST_TIMEOUT_S")
fi
if [[ -n ${TORCH_FR_DUMP_TEMP_FILE:-} ]]; then # torch's flight-recorder dumps: a path prefix
    mkdir -p "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")" ||
        fail "cannot create the directory of TORCH_FR_DUMP_TEMP_FILE=$TORCH_FR_DUMP_TEMP_FILE"
fi

# The first node of the allocation hosts the c10d rendezvous store.
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "moetrain: job $SLURM_JOB_ID (restart count ${SLURM_RESTART_COUNT:-0}), $SLURM_NNODES node(s) x" \
    "$RANKS_PER_NODE rank(s), GPUS_PER_NODE=$GPUS_PER_NODE, CPU_BIND=$CPU_BIND, rendezvous $HEAD:$PORT," \
    "config $CONFIG${OUT_DIR:+, OUT_DIR=$OUT_DIR}${DIST_TIMEOUT_S:+, dist_timeout_s=$DIST_TIMEOUT_S}," \
    "OMP_NUM_THREADS=$OMP_NUM_THREADS"
if [[ $GPUS_PER_NODE -eq 0 ]]; then
    echo "moetrain: GPUS_PER_NODE=0: CPU-only run, no GPU check"
fi

# A time limit that is not longer than the SIGTERM lead has SLURM signal the ranks at its first
# periodic check, seconds into the job: they checkpoint at their first step and stop (a short
# --time on a debug partition does this). Said once; sbatch --signal may have shortened the lead.
seconds_of_slurm_time() { # [days-][hours:]minutes:seconds -> seconds; nothing for UNLIMITED etc.
    local time=$1 days=0 total=0 part parts
    [[ $time =~ ^([0-9]+-)?[0-9]+(:[0-9]+){1,2}$ ]] || return 0
    if [[ $time == *-* ]]; then
        days=${time%%-*}
        time=${time#*-}
    fi
    IFS=: read -r -a parts <<<"$time"
    for part in "${parts[@]}"; do
        total=$((total * 60 + 10#$part))
    done
    echo $((10#$days * 86400 + total))
}
time_limit=$(squeue --noheader --jobs="$SLURM_JOB_ID" --format=%l 2>/dev/null || true)
time_limit_s=$(seconds_of_slurm_time "$time_limit")
if [[ -n $time_limit_s && -n ${SIGNAL_LEAD_S:-} && $time_limit_s -le $SIGNAL_LEAD_S ]]; then
    echo "moetrain: warning: this job's time limit ($time_limit) is not longer than the template's" \
        "SIGTERM lead (--signal=TERM@$SIGNAL_LEAD_S): SLURM will SIGTERM the ranks within a minute of" \
        "their start and they stop after one checkpoint; ask for a longer --time, or pass sbatch a" \
        "shorter --signal=TERM@<seconds>" >&2
fi

# SIGTERM to this batch shell (scancel, the end of a pre-emption's grace time) must not end the
# job while the ranks are still writing their checkpoint, so the shell only logs it and waits for
# srun in the background. It must not pass the signal on with `kill -TERM <srun pid>`: srun
# answers SIGTERM by SIGKILLing every task ("srun: forcing job termination"), which would lose
# the checkpoint. SLURM itself delivers SIGTERM to the tasks.
trap 'echo "moetrain: batch shell got SIGTERM; the ranks checkpoint, waiting for them"' TERM

# Runs a job step in the background and waits for it (a trapped signal interrupts `wait`: wait
# again while srun runs); returns srun's exit status.
run_step() {
    "$@" &
    local pid=$! status=0
    wait "$pid" || status=$?
    while kill -0 "$pid" 2>/dev/null; do
        status=0
        wait "$pid" || status=$?
    done
    return "$status"
}

# Preflight: one task per node checks its GPUs, numactl and OUT_DIR; no rank starts if one fails.
# The marker file proves that every node sees the OUT_DIR this node writes to.
export GPUS_PER_NODE CPU_BIND GPU_COUNT_CMD OUT_DIR
OUT_DIR_MARKER=
if [[ -n $OUT_DIR ]]; then
    OUT_DIR_MARKER=.preflight-$SLURM_JOB_ID
    trap 'rm -f "$OUT_DIR/$OUT_DIR_MARKER"' EXIT
    touch "$OUT_DIR/$OUT_DIR_MARKER"
fi
export OUT_DIR_MARKER
status=0
run_step srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=0 \
    bash "$SLURM_HELPERS/preflight.sh" || status=$?
if [[ -n $OUT_DIR_MARKER ]]; then
    rm -f "$OUT_DIR/$OUT_DIR_MARKER"
fi
[[ $status -eq 0 ]] || fail "preflight failed on the node(s) named above; no rank was started"

# One torchrun per node, through `python -m moetrain.launch` (torchrun itself, ending a SIGTERM with
# one line instead of a SignalException traceback); --cpus-per-task hands that task all of the
# node's CPUs (srun does not inherit the job's CPU count, and a step confined to 1 core would
# starve the ranks). --no-python: torchrun runs TRAIN_CMD as given (split on spaces) instead of
# prefixing `python`.
read -r -a train_cmd <<<"$TRAIN_CMD"
LAUNCH_CMD=${LAUNCH_CMD:-python -m moetrain.launch}  # torchrun's arguments follow; split on spaces
read -r -a launch_cmd <<<"$LAUNCH_CMD"
launch=(
    "${launch_cmd[@]}"
    --nnodes="$SLURM_NNODES"
    --nproc-per-node="$RANKS_PER_NODE"
    --rdzv-backend=c10d
    --rdzv-endpoint="$HEAD:$PORT"
    --rdzv-id="$SLURM_JOB_ID"
    --max-restarts=0
    --shutdown-timeout="$SHUTDOWN_TIMEOUT"
    --no-python
)
case $CPU_BIND in
    numa) launch+=(--numa-binding=exclusive) ;;
    cores) launch+=(python "$SLURM_HELPERS/bind_rank.py") ;;
    none) ;;
esac
status=0
run_step srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_NODE" \
    --kill-on-bad-exit=1 \
    "${launch[@]}" "${train_cmd[@]}" --config "$CONFIG" "${trainer_sets[@]}" "$@" || status=$?
echo "moetrain: srun exited with status $status"
exit "$status"
