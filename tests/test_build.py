"""The extension's import guard: a missing or stale build is an ImportError that says how to build."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _import_in_copy(
    tmp_path: Path, keep_extension: bool, edit_source: bool, edit_name: str = "permute.cpp"
) -> subprocess.CompletedProcess:
    """Copies the package (and csrc/) to ``tmp_path`` and imports it there in a fresh interpreter."""
    shutil.copytree(ROOT / "moetrain", tmp_path / "moetrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    if not keep_extension:
        for built in (tmp_path / "moetrain").glob("_C*.so"):
            built.unlink()
    if edit_source:
        with open(tmp_path / "csrc" / edit_name, "a") as f:
            f.write("\n// edited after the build\n")
    # Only the copy may be importable: drop the editable install's finder, which would otherwise
    # resolve moetrain._C to the repository's build.
    code = (
        "import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
        "import moetrain; print('imported', moetrain.__file__)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def test_fresh_build_imports(tmp_path):
    result = _import_in_copy(tmp_path, keep_extension=True, edit_source=False)
    assert result.returncode == 0, result.stderr
    assert str(tmp_path) in result.stdout


def test_missing_extension_says_how_to_build(tmp_path):
    result = _import_in_copy(tmp_path, keep_extension=False, edit_source=False)
    assert result.returncode != 0
    assert "ImportError: moetrain's C++ extension moetrain._C is not built" in result.stderr
    assert "make build" in result.stderr  # a repository checkout, and an installed copy:
    assert "pip install --no-build-isolation --force-reinstall --no-deps" in result.stderr


def test_stale_extension_is_refused(tmp_path):
    result = _import_in_copy(tmp_path, keep_extension=True, edit_source=True)
    assert result.returncode != 0
    assert "moetrain._C is stale" in result.stderr and "make build" in result.stderr


def test_cpu_build_ignores_cuda_source_edits(tmp_path):
    from moetrain._ext import ops

    if ops.source_fingerprint().startswith("cuda:"):
        pytest.skip("this extension was built with CUDA: its .cu sources count")
    result = _import_in_copy(tmp_path, keep_extension=True, edit_source=True, edit_name="edited_twin.cu")
    assert result.returncode == 0, result.stderr


def test_simd_levels_are_reported_and_capped():
    from moetrain._ext import ops

    assert ops.detected_simd_level() in ("avx512", "avx2", "scalar")
    ops.set_max_simd_level("scalar")
    try:
        assert ops.simd_level() == "scalar"
    finally:
        ops.set_max_simd_level("avx512")
    with pytest.raises(ValueError, match="'avx512', 'avx2', 'scalar'"):
        ops.set_max_simd_level("sse")
