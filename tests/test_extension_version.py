"""The import-time check that moetrain._C was built against the running torch: the version is read
from the binary without loading it, so a mismatch is a clear ImportError naming both versions and
the rebuild command instead of an undefined-symbol error (or a crash) while loading."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from moetrain import _ext

ROOT = Path(__file__).resolve().parent.parent
PREFIX = b"moetrain-built-against-torch="


def _binary(package: Path) -> Path:
    (binary,) = package.glob("_C*.so")
    return binary


def test_the_binary_records_the_torch_it_was_built_against():
    assert _ext.built_against_torch_version(_binary(ROOT / "moetrain")) == torch.__version__
    assert _ext.ops.torch_version() == torch.__version__


def test_an_extension_built_for_another_torch_is_refused_by_name(tmp_path):
    shutil.copytree(ROOT / "moetrain", tmp_path / "moetrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    binary = _binary(tmp_path / "moetrain")
    data = binary.read_bytes()
    running = torch.__version__.encode()
    other = (b"1" if running[:1] != b"1" else b"3") + running[1:]  # same length: offsets stay valid
    assert data.count(PREFIX + running + b";") >= 1  # .rodata, and the debug info may hold a copy
    binary.write_bytes(data.replace(PREFIX + running + b";", PREFIX + other + b";"))
    code = (
        "import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f)]; import moetrain"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == (
        f"ImportError: moetrain._C was built against torch {other.decode()} but torch {torch.__version__} is "
        "installed; rebuild the extension for this torch: in a repository checkout "
        "`make clean && make build` (or `pip install -e . --no-build-isolation`); for an installed copy "
        "`pip install --no-build-isolation --force-reinstall --no-deps <the moetrain source>`"
    )
