#!/usr/bin/env bash
# CI's second leg (`make test-floor`, after `make test`): the floor of the supported torch range as
# GPU clusters run it, on the CPU machine.
#
#   1. a virtualenv with the CUDA build of the floor torch (default torch==2.11.0, what the CUDA
#      images ship; it runs on the CPU too) in build/floor/venv;
#   2. a copy of the working tree in build/floor/src (the checkout's own extension was built
#      against the Makefile's torch and stays untouched), built as users build it
#      (`pip install --no-build-isolation -e .`) with nvcc when one is found: the CUDA kernels are
#      compiled for every GPU the planner's presets name that this nvcc targets, and linked;
#   3. the import checked: the pre-built extension loads, with its CUDA kernels when nvcc was found;
#   4. the CPU-runnable tests of the kernels, the layer (torch.compile fullgraph included), the
#      optimizer, the engine, and the just-in-time build (marker `build`) under that torch.
#
# Usage: scripts/ci_torch_floor.sh [TORCH_REQUIREMENT]   (a second run rebuilds only what changed)
set -euo pipefail
cd "$(dirname "$0")/.."
torch_requirement=${1:-torch==2.11.0}
root=build/floor
venv=$root/venv
copy=$root/src
python=${PYTHON:-python3}

step() { printf '\n== torch floor: %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

step "virtualenv with $torch_requirement"
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
deps=("$torch_requirement" "setuptools>=77,<82" wheel ninja pybind11 pytest pytest-timeout pytest-xdist numpy pyyaml
      pillow "sacrebleu>=2.6")
stamp=$venv/.deps-$(printf '%s ' "${deps[@]}" | md5sum | cut -c1-12)
if [[ ! -f $stamp ]]; then
    "$venv/bin/python" -m pip install --disable-pip-version-check --quiet "${deps[@]}"
    touch "$stamp"
fi

step "copy of the working tree"
mkdir -p "$copy"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' file; do
    [[ -f $file ]] || continue  # deleted in the working tree
    if [[ ! -f $copy/$file ]] || ! cmp -s "$file" "$copy/$file"; then
        mkdir -p "$copy/$(dirname "$file")"
        cp "$file" "$copy/$file"
    fi
done

cuda_home=${CUDA_HOME:-}
if [[ -z $cuda_home && -x /usr/local/cuda/bin/nvcc ]]; then
    cuda_home=/usr/local/cuda
elif [[ -z $cuda_home ]] && command -v nvcc >/dev/null; then  # nvcc may be a wrapper script: ask it
    cuda_home=$(nvcc -v --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
    cuda_home=$(readlink -f "${cuda_home:-$(dirname "$(command -v nvcc)")/..}")
fi
step "build (CUDA_HOME=${cuda_home:-none})"
(cd "$copy" && CUDA_HOME=$cuda_home MAX_JOBS=${MAX_JOBS:-2} \
    "$OLDPWD/$venv/bin/python" -m pip install --disable-pip-version-check --quiet --no-build-isolation \
    --no-deps -e .)

step "import"
expect_cuda=$([[ -n $cuda_home ]] && echo True || echo False)
(cd "$copy" && "$OLDPWD/$venv/bin/python" -c "
import torch, moetrain._ext as ext
print('torch', torch.__version__, '| extension', ext.EXTENSION, '| CUDA kernels', ext.HAS_CUDA_KERNELS)
assert ext.EXTENSION == 'prebuilt', ext.EXTENSION
assert ext.HAS_CUDA_KERNELS == $expect_cuda, 'nvcc was found but the extension has no CUDA kernels'
")

step "tests"
tests=(tests/gpu/test_build.py tests/gpu/test_extension_jit.py tests/gpu/test_cuda_kernels.py
       tests/unit/kernels/test_kernel_ops.py tests/unit/kernels/test_permute_ops.py
       tests/unit/kernels/test_a2a_layout.py tests/unit/kernels/test_kernel_selection.py
       tests/unit/kernels/test_cpu_adam.py tests/unit/kernels/test_kernel_edges.py
       tests/unit/machinery/test_adam_and_calibrate_edges.py
       tests/unit/layers/test_compile.py tests/unit/layers/test_moe_layer.py
       tests/unit/machinery/test_offload_optimizer.py tests/unit/foundation/test_torch_compat.py
       tests/unit/engine/test_engine.py)
# as make test: the tests that time real work (marker serial: rank-speed calibration) run alone after
# the others, which run on 2 workers (beside another worker's test they measure its load)
(cd "$copy" && OMP_NUM_THREADS=1 "$OLDPWD/$venv/bin/python" -m pytest -q --durations=10 -n 2 --dist loadfile --no-loadscope-reorder \
    -m "(not slow or build) and not serial" "${tests[@]}")
(cd "$copy" && OMP_NUM_THREADS=2 "$OLDPWD/$venv/bin/python" -m pytest -q -m "serial and not slow" "${tests[@]}") \
    || [ $? -eq 5 ]  # 5: no such test among these files
