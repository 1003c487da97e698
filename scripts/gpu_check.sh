#!/usr/bin/env bash
# One command that proves a GPU machine (`make gpu-check`): builds moetrain against the machine's own
# torch, runs the GPU tests, the GPU benchmarks and `moetrain train` smokes, and writes one JSON and
# one log. 545 s on one H100 on 2026-11-27 in its previous form (the tests cut at 200 s, every step
# one after another, two 21 s checkpoints); now the smokes run beside the tests, the calibration runs
# write no checkpoint and the layer benchmarks draw their weights once: about 190 s plus the tests,
# by that run's step times (not yet run on a GPU in this form). Needs torch with CUDA, nvcc (CUDA_HOME
# or PATH), setuptools >= 77, ninja and pybind11 in the Python it runs; pytest, pyyaml and numpy for
# the tests; pillow and sacrebleu for the M6 smokes. Nothing is downloaded.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default runs/gpu_check/<UTC time>)
#   PYTHON=python3.12 scripts/gpu_check.sh
#
# Steps (each timed and stopped after STEP_LIMIT_S seconds, default 300; a failed step is recorded
# and the next one runs). Steps that check only correctness run side by side (their logs follow
# when they end); timed steps run alone:
#   build            pip install --no-build-isolation --no-deps -e . (CUDA kernels for this machine's GPU;
#                    TORCH_CUDA_ARCH_LIST, when set, picks others)
#   import           the pre-built extension loads with its CUDA kernels
#   the smokes, started in the background (2 host threads each):
#   train_lm         moetrain train configs/tiny_lm.yaml on cuda
#   train_lm_local   the same with experts_init local (experts allocated on the GPU after sharding)
#   train_m6_bf16    moetrain train models/m6_moe/tiny.yaml, bf16 autocast
#   train_m6_fp16    the same under fp16 autocast with loss scaling
#   train_m6_offload bf16 weights with optim.name offload (fp32 masters and Adam on the host)
#   tests            tests/gpu/test_cuda_kernels.py (every kernel, the layer on CUDA vs the CPU and fp64),
#                    tests/unit/layers/test_compile.py, the offloaded optimizer's CUDA staging against the
#                    CPU (tests/unit/machinery/test_offload_optimizer.py); then the smokes are waited for
#   bench_layer_e8   benchmarks/moe_layer.py --device cuda --dtype bf16 (T=16384, d 4096, d_ff 14336,
#                    8 experts, top-2: ours over the dense floor, the plain and the torchtitan-style
#                    MoE, kernel bandwidth, host synchronizations per call)
#   bench_layer_e64  the same at 64 fine-grained experts (d 2048, d_ff 1408, top-6)
#   bench_compile    benchmarks/compile.py --device cuda (torch.compile fullgraph vs eager)
#   bench_offload    benchmarks/offload_step.py --device cuda (OffloadOptimizer.step vs host roofline)
#   calibrate_none   the planner against a measured run: a 0.57B-parameter LM (configs/tiny_lm.yaml at
#                    d_model 1024, 8 layers, 8 experts of d_ff 4096, dropless; bf16 autocast; 32 x 512
#                    tokens a step; 12 steps; no checkpoint), then `moetrain plan --calibrate` on it
#                    (calibrate_none_plan, beside the next run): planned vs measured step time, peak
#                    allocated memory and the allocator's fragmentation
#   calibrate_full   the same with full recompute (recompute_budget_mb=0)
# OUT_DIR/gpu_check.json: the machine, every step's status, seconds and start, every benchmark's JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: $python has no torch with a usable CUDA GPU; nothing to check" >&2
    exit 2
fi
out=${1:-runs/gpu_check/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/gpu_check.log
steps=$out/steps.tsv
: >"$steps"
exec > >(tee -a "$log") 2>&1
if [[ -z ${CUDA_HOME:-} && -x /usr/local/cuda/bin/nvcc ]]; then
    export CUDA_HOME=/usr/local/cuda
elif [[ -z ${CUDA_HOME:-} ]] && command -v nvcc >/dev/null; then  # nvcc may be a wrapper script: ask it
    CUDA_HOME=$(nvcc -v --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
    CUDA_HOME=$(readlink -f "${CUDA_HOME:-$(dirname "$(command -v nvcc)")/..}")
    export CUDA_HOME
fi

run_step() {  # run_step NAME COMMAND...: times it, records "NAME<TAB>rc<TAB>seconds<TAB>start" in steps.tsv
    local name=$1
    shift
    printf '\n== %s: %s\n' "$name" "$*"
    local start=$SECONDS
    timeout --kill-after=10 "${STEP_LIMIT_S:-300}" "$@"  # a hung step is recorded (exit 124), not waited on
    local rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$start" >>"$steps"
    printf '== %s: exit %s in %s s\n' "$name" "$rc" "$((SECONDS - start))"
}

# Steps that only check correctness run side by side (one GPU, 16 host cores); timed steps run alone.
background=()  # "NAME PID" of the steps started by start_step
start_step() {  # start_step NAME COMMAND...: run_step in the background, its output to logs/NAME.log
    local name=$1
    mkdir -p "$out/logs"
    printf '\n== %s: started beside the next steps (its output follows when it ends)\n' "$name"
    run_step "$@" >"$out/logs/$name.log" 2>&1 &
    background+=("$name $!")
}
finish_steps() {  # waits for the background steps; their logs join this one in the order they started
    local entry
    for entry in ${background[@]+"${background[@]}"}; do  # (bash < 4.4: an empty array is unset)
        wait "${entry#* }"
        cat "$out/logs/${entry%% *}.log"
    done
    background=()
}

train_command() {  # train_command NAME CONFIG OVERRIDES...: sets train_cmd to that `moetrain train` call
    local name=$1 config=$2
    shift 2
    train_cmd=("$python" -m moetrain.cli train --config "$config")
    for override in "device=cuda" "out_dir=$out/$name" "$@"; do train_cmd+=(--set "$override"); done
}
moetrain_train() {  # moetrain_train NAME CONFIG OVERRIDES...: a training run, timed alone
    train_command "$@"
    run_step "$1" "${train_cmd[@]}"
}
smoke() {  # smoke NAME CONFIG OVERRIDES...: a training run started beside the tests (2 host threads)
    train_command "$@" threads=2
    start_step "$1" "${train_cmd[@]}"
}

# The kernels are built for the GPU at hand only (half the compile time of the presets' list; CI
# compile-checks every preset GPU): TORCH_CUDA_ARCH_LIST is torch's own setting, so a user's wins.
if [[ -z ${TORCH_CUDA_ARCH_LIST:-} ]]; then
    TORCH_CUDA_ARCH_LIST=$("$python" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    export TORCH_CUDA_ARCH_LIST
fi
run_step build env MAX_JOBS="${MAX_JOBS:-16}" "$python" -m pip install --disable-pip-version-check --quiet \
    --no-build-isolation --no-deps -e .
run_step import "$python" -c "
import torch, moetrain._ext as ext
print(torch.__version__, torch.cuda.get_device_name(), 'extension', ext.EXTENSION, 'CUDA kernels', ext.HAS_CUDA_KERNELS)
assert ext.EXTENSION == 'prebuilt' and ext.HAS_CUDA_KERNELS
"
# With pytest-xdist, TEST_WORKERS (default 4) processes share the GPU. Each test's name and result
# is logged as it ends (-v), a test stops after TEST_TIMEOUT_S (pytest-timeout, which prints where
# it hung), so the summary of failures (-rfE) and durations comes before the step's own limit.
workers=()
"$python" -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-4}")
smoke train_lm configs/tiny_lm.yaml steps=30 checkpoint_every=30
smoke train_lm_local configs/tiny_lm.yaml steps=30 experts_init=local
smoke train_m6_bf16 models/m6_moe/tiny.yaml precision=bf16 steps=30
smoke train_m6_fp16 models/m6_moe/tiny.yaml precision=fp16 steps=30
smoke train_m6_offload models/m6_moe/tiny.yaml precision=bf16 param_dtype=bf16 optim.name=offload steps=30
run_step tests "$python" -m pytest -v -p no:cacheprovider -rfE --durations=15 -o "timeout=${TEST_TIMEOUT_S:-90}" \
    ${workers[@]+"${workers[@]}"} tests/gpu/test_cuda_kernels.py tests/unit/layers/test_compile.py \
    tests/unit/machinery/test_offload_optimizer.py::test_cuda_bf16_model_matches_the_cpu_model \
    tests/unit/machinery/test_offload_optimizer.py::test_cuda_staging_of_large_groups_with_different_layouts_matches_the_cpu \
    tests/unit/machinery/test_offload_optimizer.py::test_cuda_delayed_update_reads_its_gradients_before_an_in_place_zero_grad
finish_steps
run_step bench_layer_e8 "$python" benchmarks/moe_layer.py --device cuda --dtype bf16 --json "$out/moe_layer_e8.json"
run_step bench_layer_e64 "$python" benchmarks/moe_layer.py --device cuda --dtype bf16 --tokens 16384 \
    --d-model 2048 --d-ff 1408 --experts 64 --top-k 6 --json "$out/moe_layer_e64.json"
run_step bench_compile "$python" benchmarks/compile.py --device cuda --json "$out/compile.json"
run_step bench_offload "$python" benchmarks/offload_step.py --device cuda --json "$out/offload_step.json"

# The plan is made for this GPU: its planner preset when there is one, else the H100's with this GPU's memory.
cluster=$("$python" -c "
import torch
name, gib = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / 2**30
preset = next((p for key, p in (('H100', 'h100-80gb'), ('A100', 'a100-80gb'), ('V100', 'v100-32gb')) if key in name), None)
print(f'--cluster {preset}' if preset else f'--cluster h100-80gb --gpu-memory-gib {gib:.1f}')
")
# calibrate NAME OVERRIDES...: the calibration model trained on this GPU, then its plan against it (beside
# the next steps: the planner uses the host only). Dropless, so the expert rows are the plan's T*k routed
# slots whatever the young router does (with a capacity it dropped 37-69% of them on 2026-11-27).
calibrate() {
    local name=$1
    shift
    moetrain_train "$name" configs/tiny_lm.yaml model.d_model=1024 model.num_layers=8 model.num_heads=16 \
        model.max_seq_len=512 model.moe.d_ff=4096 model.moe.num_experts=8 model.moe.capacity_factor=0 \
        data.micro_batch_size=32 data.seq_len=512 precision=bf16 steps=12 log_every=4 checkpoint_at_end=false "$@"
    # shellcheck disable=SC2086  # $cluster is several flags
    start_step "${name}_plan" bash -c 'json=$1; shift; "$@" >"$json" && cat "$json"' _ "$out/$name.json" \
        "$python" -m moetrain.cli plan --calibrate "$out/$name" $cluster --nodes 1 --gpus-per-node 1 --json
}
calibrate calibrate_none
calibrate calibrate_full recompute_budget_mb=0
finish_steps

"$python" - "$out" "$SECONDS" <<'EOF'
import json, pathlib, platform, subprocess, sys
import torch
out = pathlib.Path(sys.argv[1])
steps = []
for line in (out / "steps.tsv").read_text().splitlines():  # in the order they ended
    name, rc, seconds, start = line.split("\t")
    steps.append({"step": name, "ok": rc == "0", "exit": int(rc), "seconds": int(seconds), "started_s": int(start)})
steps.sort(key=lambda step: step["started_s"])
benchmarks = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "gpu_check.json"}
try:  # a copy of the tree without git, or without .git, has no commit to name
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    commit = ""
report = {
    "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "python": platform.python_version(), "commit": commit or None},
    "ok": all(step["ok"] for step in steps),
    "seconds": int(sys.argv[2]),
    "steps": steps,
    "benchmarks": benchmarks,
}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
for step in steps:
    print(f"{'ok  ' if step['ok'] else 'FAIL'} {step['step']:<20} {step['seconds']:>5} s (at {step['started_s']} s)")
print(f"gpu_check: {report['seconds']} s; {out / 'gpu_check.json'}, log {out / 'gpu_check.log'}")
sys.exit(0 if report["ok"] else 1)
EOF
