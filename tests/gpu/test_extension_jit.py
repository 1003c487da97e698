"""The just-in-time build (moetrain/_ext.py) for real: an installed copy with no extension built for
the running torch compiles csrc/ on first import, with one progress line, into a cache named by the
torch version and the sources; the next import loads it from there without compiling.

Compiling takes minutes on 2 cores, so these tests carry the marker ``build``: ``make test`` leaves
them out and CI's torch-floor leg (scripts/ci_torch_floor.sh) runs them under the floor torch. The
CUDA sources are left out here (no nvcc on PATH): the floor leg's own build compiles and links them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.gpu.test_build import import_in_copy, make_copy

pytestmark = [pytest.mark.build, pytest.mark.timeout(1800)]

CHECK_KERNELS = """
import torch
from moetrain.kernels import native
x, slot_of_row = torch.randn(12, 8, dtype=torch.float64), torch.tensor([5, 0, 3, -1, 7, 2])
got = torch.ops.moetrain.permute_rows(x, slot_of_row, 2, None)
assert torch.equal(got, native.permute_rows(x, slot_of_row, 2, None)), "permute_rows differs from its twin"
print("FINGERPRINT", e.ops.source_fingerprint(), "TORCH", e.ops.torch_version())
"""


def test_a_copy_without_a_build_compiles_once_then_loads_from_the_cache(tmp_path):
    import torch

    copy = make_copy(tmp_path, keep_extension=False)
    cpu_only = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
                "CUDA_HOME": str(tmp_path / "no-cuda"), "MAX_JOBS": "2"}  # fmt: skip
    first = import_in_copy(copy, CHECK_KERNELS, env=cpu_only, timeout=1500)  # compiles: minutes
    assert first.returncode == 0, first.stderr[-4000:]
    assert "EXTENSION just-in-time" in first.stdout
    assert "FINGERPRINT cpu:" in first.stdout and f"TORCH {torch.__version__}" in first.stdout
    progress = [line for line in first.stderr.splitlines() if "compiling the C++ extension" in line]
    assert len(progress) == 1, first.stderr[-4000:]
    assert "no pre-built extension was found" in progress[0] and torch.__version__ in progress[0]
    cached = list((copy / "cache" / "moetrain" / "extensions").glob(f"torch-{torch.__version__}-cpu-*"))
    assert len(cached) == 1 and list(cached[0].glob("moetrain_C*.so")), cached

    again = import_in_copy(copy, CHECK_KERNELS, env=cpu_only)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "EXTENSION just-in-time" in again.stdout
    assert "compiling" not in again.stderr, again.stderr
