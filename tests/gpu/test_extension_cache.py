"""The just-in-time build's cache (moetrain/_ext.py ``build_just_in_time``) and the import's fallbacks
around it: a build directory keyed by everything the build embeds, compiled from a copy of the sources
kept in it; one builder at a time under an ``flock`` the kernel frees, a ``lock`` left by torch's
killed build removed; a damaged cached binary rebuilt; a failed build named by its compiler errors;
``TORCH_CUDA_ARCH_LIST`` honoured as setup.py does; an empty pre-built binary and an installed copy's
advice.

Most tests replace torch's ``cpp_extension.load`` by a recorder (nothing is compiled); the last one
compiles a one-file extension for real (seconds; tests/gpu/test_extension_jit.py builds the real
sources, minutes).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils import cpp_extension

from moetrain import _build_spec, _ext
from tests.gpu.test_build import NO_COMPILER, import_in_copy, make_copy
from tests.helpers.paths import ROOT

BUILD_LOCK = ".moetrain-build.lock"

# One file, with the records csrc/bindings.cpp compiles in (moetrain._ext reads them before loading;
# `used` keeps them verbatim in the binary).
TINY_BINDINGS = r"""
#include <pybind11/pybind11.h>
#include "moetrain_build_info.h"
[[gnu::used]] static const char kRecords[] = "moetrain-built-against-torch=" MOETRAIN_TORCH_VERSION
                                             ";moetrain-source-fingerprint=" MOETRAIN_SOURCE_FINGERPRINT ";";
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fingerprint", [] { return MOETRAIN_SOURCE_FINGERPRINT; }); }
"""


def tiny_csrc(root: Path) -> Path:
    csrc = root / "csrc"
    csrc.mkdir(parents=True)
    (csrc / "bindings.cpp").write_text(TINY_BINDINGS)
    return csrc


class FakeLoad:
    """Stands in for ``cpp_extension.load``: records its arguments and what the build directory held
    when it was called, and "builds" a binary holding the records ``moetrain_build_info.h`` names."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, **arguments):
        directory = Path(arguments["build_directory"])
        held = _lock_is_held(directory / BUILD_LOCK)
        self.calls.append({**arguments, "held": held, "files": sorted(p.name for p in directory.iterdir())})
        header = (directory / "moetrain_build_info.h").read_text()
        fingerprint = re.search(r'MOETRAIN_SOURCE_FINGERPRINT "(.*)"', header).group(1)
        binary = directory / "moetrain_C.so"
        if not binary.exists():
            records = (
                f"moetrain-built-against-torch={torch.__version__};moetrain-source-fingerprint={fingerprint};"
            )
            binary.write_bytes(b"\x7fELF" + bytes(1000) + records.encode() + bytes(1000))
        return SimpleNamespace(__file__=str(binary))


def _lock_is_held(path: Path) -> bool:
    """Whether some open file holds an ``flock`` on ``path`` (a second open file cannot take it)."""
    if not path.exists():
        return False
    descriptor = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    return False


class Recorded(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A CPU build into ``tmp_path/cache`` through :class:`FakeLoad`, and the warnings it logs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(_ext, "_cuda_compiler", lambda: None)
    load = FakeLoad()
    monkeypatch.setattr(cpp_extension, "load", load)
    handler = Recorded()
    _ext.logger.addHandler(handler)
    yield SimpleNamespace(load=load, warnings=handler.messages)
    _ext.logger.removeHandler(handler)


def test_installs_with_the_same_sources_share_one_build_compiled_from_its_copy(
    tmp_path, monkeypatch, fake_build
):
    """A checkout and an installed copy with the same sources share one build, compiled from the
    sources copied into it (build.ninja holds absolute paths: each tree's own paths made each import
    rebuild the other's); another Python or torch install gets a directory of its own."""
    checkout, installed = (
        tiny_csrc(tmp_path / "checkout"),
        tiny_csrc(tmp_path / "site" / "moetrain" / "_csrc"),
    )
    _ext.build_just_in_time(checkout, "test")
    _ext.build_just_in_time(installed, "test")
    first, second = fake_build.load.calls
    directory = Path(first["build_directory"])
    assert second["build_directory"] == str(directory)
    assert first["sources"] == second["sources"] == [str(directory / "csrc" / "bindings.cpp")]
    assert (directory / "csrc" / "bindings.cpp").read_text() == TINY_BINDINGS
    assert first["extra_include_paths"] == second["extra_include_paths"]
    assert not any(
        str(tmp_path / tree) in path for tree in ("checkout", "site") for path in first["extra_include_paths"]
    )

    with monkeypatch.context() as patch:
        patch.setattr(torch.version, "git_version", "another torch build")
        _ext.build_just_in_time(checkout, "test")
    with monkeypatch.context() as patch:
        patch.setattr(sys.implementation, "cache_tag", "cpython-399")
        _ext.build_just_in_time(checkout, "test")
    directories = [call["build_directory"] for call in fake_build.load.calls]
    assert len(set(directories)) == 3, directories
    assert all(Path(d).name.startswith(f"torch-{torch.__version__}-cpu-") for d in directories)


def test_a_build_holds_its_flock_and_removes_the_lock_a_killed_build_of_torch_left(tmp_path, fake_build):
    """torch's FileBaton ``lock`` outlives a build killed by SIGTERM/SIGKILL, and every later import
    waited on it forever; under moetrain's flock (freed by the kernel when its holder dies) no other
    build is running, so a ``lock`` found then is stale and goes."""
    csrc = tiny_csrc(tmp_path)
    _ext.build_just_in_time(csrc, "test")
    directory = Path(fake_build.load.calls[0]["build_directory"])
    (directory / "lock").write_text("")
    _ext.build_just_in_time(csrc, "test")
    for call in fake_build.load.calls:
        assert call["held"] and "lock" not in call["files"], call
    assert not _lock_is_held(directory / BUILD_LOCK)


def test_a_damaged_cached_build_is_removed_and_rebuilt(tmp_path, fake_build):
    """The binary is loaded only when it matches the stamp written (and fsynced) after its build; a
    truncated one killed every import with SIGBUS, an empty one made the twins serve for good."""
    csrc = tiny_csrc(tmp_path)
    _ext.build_just_in_time(csrc, "test")
    directory = Path(fake_build.load.calls[0]["build_directory"])
    binary, stamp = directory / "moetrain_C.so", directory / "moetrain_C.so.stamp"
    assert stamp.is_file()
    built = binary.read_bytes()

    _ext.build_just_in_time(csrc, "test")  # intact: loaded as it is, without a word
    assert "moetrain_C.so" in fake_build.load.calls[-1]["files"]
    assert len(fake_build.warnings) == 1 and "compiling" in fake_build.warnings[0], fake_build.warnings

    for damage, expected in [
        (built[: len(built) // 2], "is damaged"),
        (b"", "is damaged"),
        (None, "no stamp"),
    ]:
        fake_build.warnings.clear()
        (directory / "bindings.o").write_bytes(b"an object of the damaged build")
        if damage is None:
            stamp.unlink()
        else:
            binary.write_bytes(damage)
        _ext.build_just_in_time(csrc, "test")
        files = fake_build.load.calls[-1]["files"]
        assert "moetrain_C.so" not in files and "bindings.o" not in files, (expected, files)
        assert expected in fake_build.warnings[0] and str(binary) in fake_build.warnings[0], (
            fake_build.warnings
        )
        assert "compiling" in fake_build.warnings[1]
        assert (
            binary.read_bytes() == built
            and _ext.cached_build_problem(binary, _ext.built_from_sources(binary)) is None
        )


def test_a_failed_build_warns_with_the_first_compiler_errors_and_its_directory(
    tmp_path, monkeypatch, fake_build
):
    """The warning kept only torch's last line, as a list: "(RuntimeError: ['ninja: build stopped:
    subcommand failed.'])"; it names the build directory and the compiler's errors, in the user's sources."""
    csrc = tiny_csrc(tmp_path)

    def failing_load(**arguments):
        copy = Path(arguments["build_directory"]) / "csrc" / "bindings.cpp"
        output = (
            f"[1/2] c++ -MMD -MF bindings.o.d -c {copy} -o bindings.o\nFAILED: bindings.o\n"
            f'{copy}:3:2: error: #error "deliberate"\n    3 | #error "deliberate"\n      |  ^~~~~\n'
            "ninja: build stopped: subcommand failed.\n"
        )
        raise RuntimeError(f"Error building extension 'moetrain_C': {output}")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    monkeypatch.setattr(_ext, "prebuilt_problem", lambda *_: "no pre-built extension was found")
    monkeypatch.setattr(_ext, "source_dir", lambda: csrc)
    monkeypatch.setattr(_ext, "compiler_problem", lambda: None)
    module, how = _ext._load()
    assert how == "torch-native" and module.simd_level() == "torch"
    (directory,) = (tmp_path / "cache" / "moetrain" / "extensions").iterdir()
    warning = fake_build.warnings[-1]
    assert (
        f'the build in {directory} failed ({csrc / "bindings.cpp"}:3:2: error: #error "deliberate")'
        in warning
    )
    assert "['" not in warning and "\n" not in warning, warning


def test_torch_cuda_arch_list_replaces_the_preset_gpus_and_keys_the_build(tmp_path, monkeypatch, fake_build):
    """As in setup.py: TORCH_CUDA_ARCH_LIST set, no -gencode flags of moetrain's (torch's build then
    applies the list); each list builds into a directory of its own."""
    monkeypatch.setattr(_ext, "_cuda_compiler", lambda: "/fake/nvcc")
    monkeypatch.setattr(_build_spec, "nvcc_archs", lambda nvcc: ["7.5", "8.0", "9.0", "12.0"])
    csrc = tiny_csrc(tmp_path)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    _ext.build_just_in_time(csrc, "test")
    for arch_list in ("9.0", "8.0"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
        _ext.build_just_in_time(csrc, "test")
    presets, *chosen = fake_build.load.calls
    assert "arch=compute_90,code=sm_90" in presets["extra_cuda_cflags"]
    for call in chosen:
        assert call["with_cuda"] and not any("arch=" in flag for flag in call["extra_cuda_cflags"]), call
    assert len({call["build_directory"] for call in fake_build.load.calls}) == 3


def test_an_empty_prebuilt_extension_is_named_and_the_twins_serve(tmp_path):
    """An empty moetrain/_C*.so (an interrupted install) crashed ``import moetrain`` in mmap."""
    copy = make_copy(tmp_path)
    (binary,) = (copy / "moetrain").glob("_C*.so")
    binary.write_bytes(b"")
    result = import_in_copy(copy, env={"CXX": NO_COMPILER})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "EXTENSION torch-native" in result.stdout
    assert f"the pre-built extension {binary} is empty" in result.stderr


def test_an_installed_copy_is_told_to_reinstall_not_to_run_make_build(tmp_path):
    """An installed copy (the wheel's moetrain/_csrc; no Makefile, no setup.py) was told to run
    `make build` or `pip install -e .`."""
    site = tmp_path / "site-packages"
    shutil.copytree(
        ROOT / "moetrain", site / "moetrain", ignore=shutil.ignore_patterns("__pycache__", "_C*.so")
    )
    shutil.copytree(ROOT / "csrc", site / "moetrain" / "_csrc")
    result = import_in_copy(site, env={"CXX": NO_COMPILER})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "EXTENSION torch-native" in result.stdout
    assert f"to compile, {_ext.INSTALLED_REBUILD}" in result.stderr
    assert "make build" not in result.stderr


# Builds (or loads) the tiny sources at argv[1] with moetrain's just-in-time build and checks the records.
BUILD_TINY = """
import sys
from pathlib import Path
import moetrain._ext as e
module = e.build_just_in_time(Path(sys.argv[1]), "test")
print("FINGERPRINT", module.fingerprint(), "RECORDED", e.built_from_sources(Path(module.__file__)))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_build_is_shared_by_two_trees_and_survives_a_killed_build_of_torch(tmp_path):
    """One compile for real: a second tree with the same sources loads it without compiling (before,
    it rebuilt it: .ninja_log gained entries), and a ``lock`` left by a killed build no longer makes
    the next import wait forever."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "MAX_JOBS": "1", "OMP_NUM_THREADS": "1"}

    def build(csrc: Path, timeout: float = 180) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", BUILD_TINY, str(csrc)]
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert result.returncode == 0, result.stderr[-3000:]
        fingerprint = _ext.csrc_fingerprint(csrc, with_cuda=False)
        assert f"FINGERPRINT {fingerprint} RECORDED {fingerprint}" in result.stdout, result.stdout
        return result

    checkout, installed = (
        tiny_csrc(tmp_path / "checkout"),
        tiny_csrc(tmp_path / "site" / "moetrain" / "_csrc"),
    )
    first = build(checkout)
    assert "compiling" in first.stderr
    (directory,) = (tmp_path / "cache" / "moetrain" / "extensions").iterdir()
    ninja_log = (directory / ".ninja_log").read_text()
    second = build(installed)
    assert "compiling" not in second.stderr, second.stderr
    assert (directory / ".ninja_log").read_text() == ninja_log  # nothing compiled or linked again

    (directory / "lock").write_text("")  # what torch's build left when it was killed
    third = build(checkout, timeout=90)  # waited forever before
    assert "compiling" not in third.stderr, third.stderr
    assert not (directory / "lock").exists()
