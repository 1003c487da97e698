"""What a build of ``moetrain._C`` compiles and how, shared by ``setup.py`` (the pre-built install)
and :mod:`moetrain._ext` (the just-in-time build for the running torch), so both give the
compiler the same sources and flags.

- The supported torch range: ``TORCH_FLOOR`` (the torch the CUDA images ship, 2.11) up to
  ``TORCH_CEILING`` (exclusive; 2.13 is the newest release CI tests). CI tests both ends.
- The GPUs the CUDA kernels are compiled for: every GPU the planner's presets name
  (``CUDA_ARCHS``: compute capability -> GPU), each one the installed nvcc can still target, plus
  PTX of the newest, which the driver compiles for GPUs newer than the list.

This module must not import torch or the rest of the package: ``setup.py`` loads it by path.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

TORCH_FLOOR = (2, 11)
TORCH_CEILING = (2, 14)
TORCH_REQUIREMENT = f"torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]},<{TORCH_CEILING[0]}.{TORCH_CEILING[1]}"

# Compute capability -> the planner's GPU preset (moetrain/planner/hardware.py; a test keeps them equal).
CUDA_ARCHS = {"6.0": "P100", "7.0": "V100", "8.0": "A100", "9.0": "H100"}

# -g0 undoes the -g of Python's own CFLAGS: debug information for torch's headers made each object
# ~19 MB and each translation unit ~25% slower to compile.
CXX_FLAGS = ["-O3", "-g0", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]
LINK_FLAGS = ["-fopenmp"]
CPU_SUFFIXES = (".cpp",)
CUDA_SUFFIXES = (".cu",)


def torch_release(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a torch release from {version!r}")
    return int(match.group(1)), int(match.group(2))


def torch_range_problem(version: str) -> str | None:
    """One line when ``version`` is outside the supported range, else None."""
    if TORCH_FLOOR <= torch_release(version) < TORCH_CEILING:
        return None
    return (
        f"moetrain supports {TORCH_REQUIREMENT} (tested at both ends), but torch {version} is installed; "
        f"install a torch in that range (pip install '{TORCH_REQUIREMENT}')"
    )


def sources(csrc: Path, with_cuda: bool) -> list[Path]:
    """The files a build compiles, sorted: ``*.cpp``, plus ``*.cu`` for a CUDA build."""
    suffixes = CPU_SUFFIXES + (CUDA_SUFFIXES if with_cuda else ())
    return sorted(p for p in Path(csrc).iterdir() if p.suffix in suffixes and p.is_file())


def object_name_clashes(paths: list[Path]) -> list[str]:
    """Stems compiled by more than one source (``permute.cpp`` and ``permute.cu`` both make
    ``permute.o``, which ninja refuses: "multiple rules generate")."""
    seen: dict[str, int] = {}
    for path in paths:
        seen[path.stem] = seen.get(path.stem, 0) + 1
    return sorted(stem for stem, count in seen.items() if count > 1)


def nvcc_archs(nvcc: str) -> list[str]:
    """The compute capabilities ``nvcc`` can compile for (``nvcc --list-gpu-arch``), as "7.5"."""
    listing = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    return [f"{m.group(1)[:-1]}.{m.group(1)[-1]}" for m in re.finditer(r"compute_(\d+)\b", listing)]


def cuda_arch_flags(supported: list[str]) -> tuple[list[str], list[str]]:
    """``-gencode`` flags for each of ``CUDA_ARCHS`` in ``supported``, plus PTX of the newest of
    them; and the archs left out (an nvcc too new for them: CUDA 13 dropped sm_60 and sm_70)."""
    kept = [arch for arch in CUDA_ARCHS if arch in supported]
    skipped = [arch for arch in CUDA_ARCHS if arch not in supported]
    if not kept:
        raise ValueError(
            f"this nvcc compiles for none of the GPUs moetrain targets ({', '.join(CUDA_ARCHS)}); "
            f"it supports {', '.join(supported)}"
        )
    flags = []
    for arch in kept:
        number = arch.replace(".", "")
        flags += ["-gencode", f"arch=compute_{number},code=sm_{number}"]
    newest = kept[-1].replace(".", "")
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return flags, skipped


def nvcc_arch_flags(nvcc: str) -> tuple[list[str], list[str]]:
    """:func:`cuda_arch_flags` for what ``nvcc`` can target (flags, archs left out); none of either
    when ``TORCH_CUDA_ARCH_LIST`` is set: the user chose, and torch's build applies that list. The
    rule of ``setup.py`` and of the just-in-time build alike."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return [], []
    return cuda_arch_flags(nvcc_archs(nvcc))


def skipped_archs_message(skipped: list[str], nvcc_version: str) -> str:
    gpus = ", ".join(f"sm_{a.replace('.', '')} ({CUDA_ARCHS[a]})" for a in skipped)
    return (
        f"moetrain: nvcc {nvcc_version} cannot compile for {gpus}; this build's CUDA kernels will not run "
        "there (those GPUs need a CUDA 12 toolkit and a CUDA 12 build of torch)"
    )


def build_info_header(fingerprint: str, torch_version: str) -> str:
    """``moetrain_build_info.h``: the csrc/ fingerprint and the torch version a build compiles
    against (``moetrain._ext`` compares both before it loads a binary)."""
    return (
        "#pragma once\n"
        f'#define MOETRAIN_SOURCE_FINGERPRINT "{fingerprint}"\n'
        f'#define MOETRAIN_TORCH_VERSION "{torch_version}"\n'
    )
