"""Compiles each CUDA source (csrc/*.cu) with nvcc, when torch is CPU-only, for every GPU the
planner's presets name that this nvcc can target (``moetrain._build_spec.CUDA_ARCHS``: sm_80 and
sm_90 with CUDA 13, which dropped sm_60 and sm_70; a CUDA 12 nvcc covers those too).

A CPU-only torch cannot link the CUDA kernels into moetrain._C (setup.py leaves csrc/*.cu out), so
without this test a syntax or type error in them would go unnoticed until a GPU build. nvcc gets the
flags setup.py's CUDAExtension would give it (torch's include paths and nvcc defines, C++17,
``-DMOETRAIN_WITH_CUDA``) plus setup.py's ``-gencode`` flags and ``-Xptxas=-v``, whose report
proves that ptxas compiled device code for each GPU for every ``__global__`` kernel of the file.
Two defines stand in for what only a CUDA build of torch has: ``-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE``
(the CPU wheel lacks the generated ``c10/cuda/impl/cuda_cmake_macros.h``, which only sets
Windows export macros) and ``-DTORCH_EXTENSION_NAME`` (set by the extension build).

Skips when nvcc is not found, or when torch has CUDA (then the real build compiles the files and
tests/gpu/test_cuda_kernels.py runs them). Objects and ptxas reports are cached under the system temp
directory, keyed by a hash of the nvcc command, the nvcc version and every csrc/ source, so only an
edit recompiles (about a minute per file on 2 cores).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from moetrain._build_spec import CUDA_ARCHS, cuda_arch_flags, nvcc_archs
from tests.helpers.paths import ROOT

CSRC = ROOT / "csrc"
CUDA_SOURCES = sorted(CSRC.glob("*.cu"))
CACHE = Path(tempfile.gettempdir()) / "moetrain-nvcc-check"


def _find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


NVCC = _find_nvcc()
pytestmark = [
    pytest.mark.skipif(
        NVCC is None,
        reason="nvcc not found (set CUDA_HOME or put nvcc on PATH): csrc/*.cu were not compile-checked",
    ),
    pytest.mark.skipif(
        torch.version.cuda is not None,
        reason="torch has CUDA: setup.py builds csrc/*.cu into moetrain._C "
        "(see tests/gpu/test_cuda_kernels.py)",
    ),
]


def _nvcc_command(source: Path, obj: Path) -> list[str]:
    # nvcc adds its own CUDA include directory (nvcc.profile); torch's and Python's are ours to give.
    includes = [CSRC, *map(Path, cpp_extension.include_paths()), Path(sysconfig.get_paths()["include"])]
    nvcc_defines = [f for f in cpp_extension.COMMON_NVCC_FLAGS if f.startswith("-D")]
    return [
        NVCC,
        "-c",
        str(source),
        "-o",
        str(obj),
        "-std=c++17",
        "-O3",
        "--expt-relaxed-constexpr",
        *ARCH_FLAGS,
        "-Xptxas=-v",
        "-DMOETRAIN_WITH_CUDA",
        "-DTORCH_EXTENSION_NAME=_C",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
        *nvcc_defines,
        *(f"-I{path}" for path in includes),
    ]


def _compile(source: Path) -> tuple[int, str, Path]:
    """(return code, nvcc's combined output, object path), from the cache when nothing changed."""
    probe = _nvcc_command(source, Path("OBJ"))
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256("\0".join([*probe, version, torch.__version__]).encode())
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cu", ".cuh", ".h", ".cpp"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    entry = CACHE / f"{source.stem}-{digest.hexdigest()[:20]}"
    obj, log = entry.with_suffix(".o"), entry.with_suffix(".log")
    if obj.exists() and log.exists():
        return 0, log.read_text(), obj
    CACHE.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(_nvcc_command(source, obj), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    if result.returncode == 0:
        log.write_text(output)
    return result.returncode, output, obj


SUPPORTED_ARCHS = nvcc_archs(NVCC) if NVCC is not None and torch.version.cuda is None else []
ARCH_FLAGS = cuda_arch_flags(SUPPORTED_ARCHS)[0] if SUPPORTED_ARCHS else []
TARGETED = [arch for arch in CUDA_ARCHS if arch in SUPPORTED_ARCHS]


def test_cuda_sources_exist():
    assert {p.name for p in CUDA_SOURCES} >= {"permute_cuda.cu", "a2a_layout_cuda.cu"}


def test_every_gpu_of_the_planner_presets_has_an_arch():
    from moetrain.planner.hardware import GPU_PRESETS

    assert {spec.name.split("-")[0] for spec in GPU_PRESETS.values()} == set(CUDA_ARCHS.values())


@pytest.mark.parametrize("arch", list(CUDA_ARCHS))
def test_this_nvcc_targets_the_gpu_or_says_why_not(arch):
    if arch not in SUPPORTED_ARCHS:
        pytest.skip(f"this nvcc cannot compile for sm_{arch.replace('.', '')} ({CUDA_ARCHS[arch]})")
    assert arch in TARGETED


@pytest.mark.timeout(1200)  # one nvcc run per file for every targeted GPU, uncached: minutes on 2 cores
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles_device_code_for_every_targeted_gpu(source):
    code, output, obj = _compile(source)
    assert code == 0, f"nvcc failed on {source.name}:\n{output[-6000:]}"
    assert obj.stat().st_size > 0
    # Warnings from our own files (torch's headers warn under C++17; those are not ours).
    own = [line for line in output.splitlines() if "warning" in line and str(CSRC) in line]
    assert not own, "\n".join(own)
    # ptxas compiled every __global__ kernel of the file for each targeted GPU.
    kernels = re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)", source.read_text())
    assert kernels, f"no __global__ kernels found in {source.name}"
    assert TARGETED
    for arch in TARGETED:
        sm = f"sm_{arch.replace('.', '')}"
        compiled = set(re.findall(rf"Compiling entry function '(\w+)' for '{sm}'", output))
        for kernel in kernels:
            assert any(kernel in mangled for mangled in compiled), (
                f"{kernel} has no {sm} code; ptxas said:\n{output}"
            )


if __name__ == "__main__":  # pragma: no cover - prints the command, for compiling by hand
    print(" ".join(_nvcc_command(CUDA_SOURCES[0], Path("/tmp/check.o"))), file=sys.stderr)
