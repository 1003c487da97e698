"""How ``import moetrain`` gets its kernels (moetrain/_ext.py): the pre-built extension when it fits
the running torch and sources; a just-in-time build when it does not (tests/gpu/test_extension_jit.py
compiles one for real); the torch-native twins, with one warning, where nothing can compile; a torch
outside the supported range refused with one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain import _ext
from moetrain._build_spec import TORCH_REQUIREMENT, object_name_clashes, sources, torch_range_problem
from tests.helpers.paths import ROOT, load_script

NO_COMPILER = "moetrain-test-no-such-compiler"
# Only the copy may be importable: drop the editable install's finder, which would otherwise resolve
# moetrain._C to the repository's build.
ONLY_THE_COPY = "import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f)]; "


def make_copy(
    tmp_path: Path, keep_extension: bool = True, with_sources: bool = True, edit_name: str | None = None
) -> Path:
    """The package (and csrc/) copied to ``tmp_path/copy``, as a checkout or an installed copy."""
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "moetrain", copy / "moetrain", ignore=shutil.ignore_patterns("__pycache__"))
    if with_sources:
        shutil.copytree(ROOT / "csrc", copy / "csrc")
    if not keep_extension:
        for built in (copy / "moetrain").glob("_C*.so"):
            built.unlink()
    if edit_name is not None:
        with open(copy / "csrc" / edit_name, "a") as f:
            f.write("\n// edited after the build\n")
    return copy


def import_in_copy(
    copy: Path, code: str = "", env: dict | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """Imports the copy in a fresh interpreter (no C++ compiler when ``env`` says so), then runs ``code``."""
    program = ONLY_THE_COPY + "import moetrain, moetrain._ext as e; print('EXTENSION', e.EXTENSION); " + code
    return subprocess.run(
        [sys.executable, "-c", program],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "XDG_CACHE_HOME": str(copy / "cache"), **(env or {})},
    )


def test_fresh_build_imports_the_prebuilt_extension(tmp_path):
    result = import_in_copy(make_copy(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "EXTENSION prebuilt" in result.stdout
    assert "moetrain" not in result.stderr  # no warning, no build


def test_cpu_build_ignores_cuda_source_edits(tmp_path):
    if _ext.HAS_CUDA_KERNELS:
        pytest.skip("this extension was built with CUDA: its .cu sources count")
    result = import_in_copy(make_copy(tmp_path, edit_name="edited_twin.cu"), env={"CXX": NO_COMPILER})
    assert result.returncode == 0, result.stderr
    assert "EXTENSION prebuilt" in result.stdout


def test_the_binary_records_its_torch_and_sources_readable_without_loading_it():
    binary = _ext._prebuilt_binary()
    assert _ext.built_against_torch_version(binary) == torch.__version__ == _ext.ops.torch_version()
    assert _ext.built_from_sources(binary) == _ext.ops.source_fingerprint()
    assert _ext.prebuilt_problem(binary, _ext.source_dir(), torch.__version__) is None


def test_why_a_prebuilt_extension_cannot_serve(tmp_path):
    binary, csrc = _ext._prebuilt_binary(), _ext.source_dir()
    assert _ext.prebuilt_problem(None, csrc, torch.__version__) == "no pre-built extension was found"
    assert _ext.prebuilt_problem(binary, csrc, "2.99.0") == (
        f"the pre-built extension was built against torch {torch.__version__}"
    )
    edited = make_copy(tmp_path, edit_name="permute.cpp") / "csrc"
    assert _ext.prebuilt_problem(binary, edited, torch.__version__).startswith(
        f"the pre-built extension was built from other sources than {edited}"
    )


# Runs one MoE layer step and an Adam step and prints what they gave, as JSON.
LAYER_AND_ADAM = """
import json, torch
from moetrain import MoELayer
from moetrain._ext import ops
torch.manual_seed(0)
layer = MoELayer(d_model=16, d_ff=32, num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coef=1e-2)
x = torch.randn(40, 16, requires_grad=True)
layer(x).square().sum().backward()
p, g = torch.randn(100), torch.randn(100)
m, v = torch.zeros(100), torch.zeros(100)
ops.adam_step_(p, g, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
w1_grad = layer.experts.w1_EDF.grad.abs().sum().item()
print("RESULT", json.dumps({"x_grad": x.grad.sum().item(), "w1_grad": w1_grad, "param": p.sum().item()}))
"""


def _result(completed: subprocess.CompletedProcess) -> dict:
    line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_without_a_compiler_the_torch_native_twins_serve_with_one_warning(tmp_path):
    """No pre-built extension and no compiler: every operator runs as its torch-native twin, the
    layer and the optimizer give what the extension gives, and one warning says so and why."""
    twins = import_in_copy(
        make_copy(tmp_path, keep_extension=False), LAYER_AND_ADAM, env={"CXX": NO_COMPILER}
    )
    assert twins.returncode == 0, twins.stderr
    assert "EXTENSION torch-native" in twins.stdout
    warnings = [line for line in twins.stderr.splitlines() if line.startswith("moetrain")]
    assert len(warnings) == 1, twins.stderr  # (a CUDA torch without a GPU adds lines of its own)
    assert "no pre-built extension was found" in warnings[0]
    assert f"no C++ compiler ('{NO_COMPILER}' is not on PATH)" in warnings[0]
    assert "torch-native implementations of its kernels serve instead" in warnings[0]
    (tmp_path / "again").mkdir()
    extension = import_in_copy(make_copy(tmp_path / "again"), LAYER_AND_ADAM)
    assert "EXTENSION prebuilt" in extension.stdout, extension.stderr
    ours, theirs = _result(twins), _result(extension)
    for key, value in ours.items():
        assert value == pytest.approx(theirs[key], rel=1e-5), key


def test_an_extension_built_for_another_torch_is_not_loaded(tmp_path):
    """The binary's record names another torch: it is never loaded (that could crash); without a
    compiler the twins serve, and the warning names the torch it was built against."""
    copy = make_copy(tmp_path)
    (binary,) = (copy / "moetrain").glob("_C*.so")
    data, running = binary.read_bytes(), torch.__version__.encode()
    other = (b"1" if running[:1] != b"1" else b"3") + running[1:]  # same length: offsets stay valid
    prefix = b"moetrain-built-against-torch="
    assert data.count(prefix + running + b";") >= 1
    binary.write_bytes(data.replace(prefix + running + b";", prefix + other + b";"))
    result = import_in_copy(copy, env={"CXX": NO_COMPILER})
    assert result.returncode == 0, result.stderr
    assert "EXTENSION torch-native" in result.stdout
    assert f"the pre-built extension was built against torch {other.decode()}" in result.stderr


def test_an_installed_copy_without_sources_or_extension_says_how_to_reinstall(tmp_path):
    result = import_in_copy(make_copy(tmp_path, keep_extension=False, with_sources=False))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: moetrain: no pre-built extension was found and the C++ sources")
    assert "pip install --no-build-isolation --force-reinstall --no-deps" in last and "make build" in last


def test_a_torch_outside_the_supported_range_is_refused_with_one_line(tmp_path):
    assert torch_range_problem(torch.__version__) is None
    assert torch_range_problem("2.11.0+cu130") is None and torch_range_problem("2.13.1") is None
    for version in ("2.10.1", "2.14.0", "3.0.0"):
        assert torch_range_problem(version) == (
            f"moetrain supports {TORCH_REQUIREMENT} (tested at both ends), but torch {version} is "
            f"installed; install a torch in that range (pip install '{TORCH_REQUIREMENT}')"
        )
    code = ONLY_THE_COPY + "import torch; torch.__version__ = '2.10.1'; import moetrain"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=make_copy(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == f"ImportError: {torch_range_problem('2.10.1')}"


def test_every_source_compiles_to_an_object_of_its_own():
    """``permute.cpp`` and ``permute.cu`` would both become ``permute.o`` (ninja: "multiple rules")."""
    assert object_name_clashes(sources(ROOT / "csrc", with_cuda=True)) == []
    assert object_name_clashes([Path("a/permute.cpp"), Path("a/permute.cu"), Path("a/x.cu")]) == ["permute"]


def test_the_fallback_schemas_are_the_extensions():
    from moetrain.kernels.registration import SCHEMAS

    assert set(SCHEMAS) == set(_ext.KERNEL_NAMES)
    for name, schema in SCHEMAS.items():
        assert str(getattr(torch.ops.moetrain, name).default._schema) == f"moetrain::{schema}"


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


def test_an_old_setuptools_is_refused_with_one_line(monkeypatch):
    """pyproject.toml's SPDX ``license = "Apache-2.0"`` needs setuptools >= 77; older ones fail deep in
    their own validation, so setup.py says it first."""
    import setuptools

    setup_py = load_script(ROOT / "setup.py", "moetrain_setup_under_test")  # main() runs under __main__ only
    monkeypatch.setattr(setuptools, "__version__", "65.5.0")
    with pytest.raises(SystemExit) as stop:
        setup_py._require_setuptools()
    assert str(stop.value) == (
        "moetrain: building needs setuptools >= 77 (pyproject.toml's SPDX license string), found 65.5.0: "
        "pip install 'setuptools>=77'"
    )
    monkeypatch.setattr(setuptools, "__version__", "77.0.1")
    setup_py._require_setuptools()
