"""Loads moetrain's compiled kernels for the running torch, building them just in time when needed.

Loading the extension registers the C++/CUDA kernels as torch operators ``torch.ops.moetrain.*``
(schemas in ``csrc/bindings.cpp``); :mod:`moetrain.kernels` adds their fake (meta)
implementations, autograd formulas and torch-native twins. At import, in this order:

1. A torch outside the supported range (``moetrain._build_spec``) is refused with one line.
2. The pre-built ``moetrain._C`` (``make build``, ``pip install --no-build-isolation .``) is loaded
   when its binary records the running torch and the fingerprint of the sources at hand. Both
   records are read from the file before loading it: a build against another torch may fail to load
   with an undefined symbol, and a loaded build has registered its operators for good.
3. Otherwise (none built, built for another torch, sources edited since) the same sources are
   compiled just in time, with the same flags as ``setup.py``, into a cache directory named by the
   torch version, the source fingerprint and the build's other inputs
   (``~/.cache/moetrain/extensions/``; :func:`build_just_in_time`), with one progress line; later
   imports load it from there.
4. Where nothing can compile (no C++ compiler or ninja, or the build fails), the torch-native twins
   (:mod:`moetrain.kernels.native`) serve every operator, with one warning.

``EXTENSION`` says which of "prebuilt", "just-in-time" or "torch-native" happened; ``ops`` gathers
the operators, the build facts and the SIMD switches under one name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import mmap
import os
import re
import shutil
import sys
import sysconfig
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from moetrain._build_spec import (
    CUDA_ARCHS,
    CXX_FLAGS,
    LINK_FLAGS,
    NVCC_FLAGS,
    build_info_header,
    nvcc_arch_flags,
    sources,
    torch_range_problem,
)
from moetrain._source_hash import CPU_SUFFIXES, CUDA_SUFFIXES, csrc_fingerprint

logger = logging.getLogger("moetrain.ext")

# Two ways moetrain gets onto a machine, two ways to pre-build: a repository checkout (the Makefile's
# editable install) and a copy installed from the source with pip (README).
CHECKOUT_BUILD = "`make build` (or `pip install -e . --no-build-isolation` inside the virtual environment)"
INSTALLED_REBUILD = "`pip install --no-build-isolation --force-reinstall --no-deps <the moetrain source>`"
# Literals csrc/bindings.cpp compiles into the binary: prefix, value, ";".
_TORCH_VERSION_PREFIX = b"moetrain-built-against-torch="
_SOURCE_PREFIX = b"moetrain-source-fingerprint="
_PACKAGE = Path(__file__).resolve().parent
JIT_NAME = "moetrain_C"
BUILD_LOCK = ".moetrain-build.lock"
_COMPILER_ERROR = re.compile(r"error:|undefined reference", re.IGNORECASE)


class BuildFailed(RuntimeError):
    """The just-in-time build failed; the message is one line: the build directory and the first
    compiler errors."""


def _binary_record(binary: Path, prefix: bytes) -> str | None:
    """The value the binary records after ``prefix`` (None when the record is absent: an older
    build), read from the file without loading it."""
    with open(binary, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(prefix)
        if start < 0:
            return None
        start += len(prefix)
        end = data.find(b";", start, start + 128)
        return None if end < 0 else data[start:end].decode("ascii", "replace")


def built_against_torch_version(binary: Path) -> str | None:
    """The torch version recorded in the extension binary at build time."""
    return _binary_record(binary, _TORCH_VERSION_PREFIX)


def built_from_sources(binary: Path) -> str | None:
    """The csrc/ fingerprint recorded in the extension binary at build time."""
    return _binary_record(binary, _SOURCE_PREFIX)


def source_dir(package: Path = _PACKAGE) -> Path | None:
    """The C++/CUDA sources: ``csrc/`` beside the package (a checkout or an editable install), or
    ``moetrain/_csrc/`` (a wheel ships them there for the just-in-time build)."""
    for candidate in (package.parent / "csrc", package / "_csrc"):
        if (candidate / "bindings.cpp").is_file():
            return candidate
    return None


def _cuda_compiler() -> str | None:
    """nvcc, when the running torch has CUDA (else the build is CPU-only)."""
    if torch.version.cuda is None:
        return None
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def prebuilt_problem(binary: Path | None, csrc: Path | None, torch_version: str) -> str | None:
    """Why the pre-built binary cannot serve the running torch (None: it can)."""
    if binary is None:
        return "no pre-built extension was found"
    try:
        if binary.stat().st_size == 0:
            return f"the pre-built extension {binary} is empty"
        built = built_against_torch_version(binary)
    except (OSError, ValueError) as error:
        return f"the pre-built extension {binary} cannot be read ({error})"
    if built != torch_version:
        return f"the pre-built extension was built against torch {built or 'of an unknown version'}"
    if csrc is not None:
        recorded = built_from_sources(binary) or ""
        expected = csrc_fingerprint(csrc, with_cuda=recorded.startswith("cuda:"))
        if recorded != expected:
            return f"the pre-built extension was built from other sources than {csrc} ({recorded or '?'})"
    return None


def cache_root() -> Path:
    """Where just-in-time builds live: ``$XDG_CACHE_HOME/moetrain/extensions`` (``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moetrain" / "extensions"


def compiler_problem() -> str | None:
    """What is missing for a build on this machine (None: a C++ compiler and ninja are there)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _nvcc_arch_flags(nvcc: str) -> list[str]:
    """As ``setup.py``'s: ``-gencode`` flags for the presets' GPUs this nvcc can target (one
    warning names those it cannot); none when ``TORCH_CUDA_ARCH_LIST`` is set, which torch's build
    then applies."""
    flags, skipped = nvcc_arch_flags(nvcc)
    if skipped:
        gpus = ", ".join(CUDA_ARCHS[arch] for arch in skipped)
        logger.warning("moetrain: this nvcc cannot compile for %s", gpus)
    return flags


def build_key(nvcc: str | None, flags: list[str]) -> str:
    """12 hex digits over what a build embeds besides the sources and the torch version: the Python
    (``sys.implementation.cache_tag``, its include directory), the torch install (its commit and
    location), the compilers, ``TORCH_CUDA_ARCH_LIST`` for a CUDA build, and the flags."""
    parts = [
        sys.implementation.cache_tag,
        sysconfig.get_paths()["include"],
        str(torch.version.git_version),
        str(Path(torch.__file__).resolve().parent),
        os.environ.get("CXX", "c++"),
        nvcc or "",
        os.environ.get("TORCH_CUDA_ARCH_LIST", "") if nvcc else "",
        *flags,
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Holds ``directory/.moetrain-build.lock`` (``flock``, which the kernel releases when the
    holder dies, however it dies), waiting with one warning while another process holds it."""
    descriptor = os.open(directory / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("moetrain: waiting for another process building the extension in %s", directory)
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def _write_if_changed(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a renamed temporary file, unless ``path`` holds it already
    (an unchanged file keeps its time, so ninja does not recompile what includes it)."""
    if path.is_file() and path.read_bytes() == data:
        return
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _copy_sources(csrc: Path, copy: Path, with_cuda: bool) -> list[Path]:
    """Copies the fingerprinted files of ``csrc`` into ``copy`` and returns the sources to compile
    there: every install whose sources have one fingerprint then builds from the same paths."""
    copy.mkdir(exist_ok=True)
    suffixes = CPU_SUFFIXES + (CUDA_SUFFIXES if with_cuda else ())
    for path in sorted(csrc.iterdir()):
        if path.suffix in suffixes and path.is_file():
            _write_if_changed(copy / path.name, path.read_bytes())
    return sources(copy, with_cuda)


def _stamp_path(binary: Path) -> Path:
    return binary.with_name(binary.name + ".stamp")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_stamp(binary: Path) -> None:
    """``<binary>.stamp``: the binary's size, modification time (ns) and SHA-256, written once the
    binary is on disk (fsync), through a renamed temporary file."""
    with open(binary, "rb") as file:
        os.fsync(file.fileno())
    status = binary.stat()
    stamp = {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "sha256": _sha256(binary)}
    path = _stamp_path(binary)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as file:
        json.dump(stamp, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(binary.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _read_stamp(binary: Path) -> dict | None:
    try:
        stamp = json.loads(_stamp_path(binary).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _stamp_is_current(binary: Path) -> bool:
    """Whether the stamp names the binary's present size and modification time (that is, the
    binary was checked against it, or it was written, and nothing has written the binary since)."""
    stamp, status = _read_stamp(binary), binary.stat()
    recorded = None if stamp is None else (stamp.get("size"), stamp.get("mtime_ns"))
    return recorded == (status.st_size, status.st_mtime_ns)


def cached_build_problem(binary: Path, fingerprint: str) -> str | None:
    """Why a cached just-in-time build cannot be loaded (None: it can): no stamp of a completed
    build, a size or SHA-256 other than the stamp's (a crash, a full disk), or records (where the
    sources compile them in) of other sources or another torch."""
    stamp = _read_stamp(binary)
    if stamp is None:
        return "has no stamp of a completed build"
    try:
        size = binary.stat().st_size
        if size != stamp.get("size") or _sha256(binary) != stamp.get("sha256"):
            return f"is damaged ({size} bytes; its build wrote {stamp.get('size')} bytes of another SHA-256)"
        sources_built, torch_built = built_from_sources(binary), built_against_torch_version(binary)
    except (OSError, ValueError) as error:
        return f"cannot be read ({error})"
    if sources_built not in (None, fingerprint) or torch_built not in (None, torch.__version__):
        return f"records sources {sources_built} and torch {torch_built}"
    return None


def _failure_summary(error: Exception) -> str:
    """The first compiler errors (at most 3) in a failed build's output, else its last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line[:300] for line in lines if _COMPILER_ERROR.search(line)][:3]
    return "; ".join(errors or lines[-1:]) or type(error).__name__


def build_just_in_time(csrc: Path, reason: str) -> ModuleType:
    """Compiles ``csrc`` for the running torch into the cache (or loads an earlier build of the
    same sources, torch, Python and flags from it) and returns the loaded module.

    The build directory, ``torch-<version>-<fingerprint>-<key>`` (:func:`build_key`) in
    :func:`cache_root`, holds a copy of the sources that is compiled, so every install with the same
    sources, torch and Python shares one build. One process builds there at a time (``flock`` on
    ``.moetrain-build.lock``; a ``lock`` of torch's found then was left by a killed build and is
    removed). A cached binary is loaded only when :func:`cached_build_problem` finds none; else it
    and its objects are removed and rebuilt. A failed build raises :class:`BuildFailed`."""
    from torch.utils import cpp_extension

    nvcc = _cuda_compiler()
    with_cuda = nvcc is not None
    fingerprint = csrc_fingerprint(csrc, with_cuda=with_cuda)
    cflags = [*CXX_FLAGS, *(["-DMOETRAIN_WITH_CUDA=1"] if with_cuda else [])]
    cuda_flags = [*NVCC_FLAGS, *_nvcc_arch_flags(nvcc), "-DMOETRAIN_WITH_CUDA=1"] if with_cuda else []
    key = build_key(nvcc, [*cflags, *cuda_flags, *LINK_FLAGS])
    directory = cache_root() / f"torch-{torch.__version__}-{fingerprint.replace(':', '-')}-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        (directory / "lock").unlink(missing_ok=True)  # torch's FileBaton, left by a killed build
        copied = _copy_sources(csrc, directory / "csrc", with_cuda)
        _write_if_changed(
            directory / "moetrain_build_info.h", build_info_header(fingerprint, torch.__version__).encode()
        )
        binaries = [directory / f"{JIT_NAME}{suffix}" for suffix in EXTENSION_SUFFIXES]
        cached = next((binary for binary in binaries if binary.exists()), None)
        problem = None if cached is None else cached_build_problem(cached, fingerprint)
        if problem is not None:
            logger.warning("moetrain: the cached build %s %s; rebuilding it", cached, problem)
            for stale in [cached, _stamp_path(cached), *directory.glob("*.o")]:
                stale.unlink(missing_ok=True)
        if cached is None or problem is not None:
            logger.warning(
                "moetrain: %s; compiling the C++%s extension for torch %s into %s (once per torch and "
                "source version; a minute or two)",
                reason,
                "/CUDA" if nvcc else "",
                torch.__version__,
                directory,
            )
        try:
            module = cpp_extension.load(
                name=JIT_NAME,
                sources=[str(p) for p in copied],
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_flags,
                extra_ldflags=list(LINK_FLAGS),
                extra_include_paths=[str(directory / "csrc"), str(directory)],
                build_directory=str(directory),
                with_cuda=with_cuda,
                verbose=False,
            )
        except Exception as error:  # a compiler error, a failed link or load: anything counts  # noqa: BLE001
            logger.debug("moetrain: the build in %s failed: %s", directory, error)
            summary = _failure_summary(error).replace(f"{directory / 'csrc'}{os.sep}", f"{csrc}{os.sep}")
            raise BuildFailed(f"the build in {directory} failed ({summary})") from error
        binary = Path(module.__file__)
        if not _stamp_is_current(binary):  # built (or rebuilt by ninja) just now
            _write_stamp(binary)
    return module


def _prebuilt_binary() -> Path | None:
    for suffix in EXTENSION_SUFFIXES:
        candidate = _PACKAGE / f"_C{suffix}"
        if candidate.exists():
            return candidate
    import importlib.util

    spec = importlib.util.find_spec("moetrain._C")  # an editable install may keep it elsewhere
    return Path(spec.origin) if spec is not None and spec.origin else None


def _torch_native_module() -> SimpleNamespace:
    """What the extension module offers besides its operators, for a run on the twins."""
    return SimpleNamespace(
        source_fingerprint=lambda: "torch-native",
        torch_version=lambda: torch.__version__,
        simd_level=lambda: "torch",
        detected_simd_level=lambda: "torch",
        set_max_simd_level=lambda level: None,
        cpu_adam_simd_path=lambda: "torch",
    )


def _load() -> tuple[object, str]:
    problem = torch_range_problem(torch.__version__)
    if problem is not None:
        raise ImportError(problem)
    binary, csrc = _prebuilt_binary(), source_dir()
    reason = prebuilt_problem(binary, csrc, torch.__version__)
    if reason is None:
        # by name: the compiled module, not the package (whose __init__ imports everything above)
        return importlib.import_module("moetrain._C"), "prebuilt"
    if csrc is None:
        raise ImportError(
            f"moetrain: {reason} and the C++ sources are not installed to build one; reinstall with "
            f"{INSTALLED_REBUILD}, or in a checkout {CHECKOUT_BUILD}"
        )
    missing = compiler_problem()
    if missing is None:
        try:
            return build_just_in_time(csrc, reason), "just-in-time"
        except BuildFailed as error:
            missing = str(error)
        except Exception as error:  # a missing nvcc architecture, an unwritable cache: anything  # noqa: BLE001
            missing = f"the build failed ({type(error).__name__}: {_failure_summary(error)})"
    logger.warning(
        "moetrain: %s and %s: the torch-native implementations of its kernels serve instead (correct, "
        "slower on the CPU); to compile, %s",
        reason,
        missing,
        INSTALLED_REBUILD if csrc == _PACKAGE / "_csrc" else CHECKOUT_BUILD,
    )
    return _torch_native_module(), "torch-native"


_C, EXTENSION = _load()
HAS_CUDA_KERNELS = _C.source_fingerprint().startswith("cuda:")
KERNEL_NAMES = (
    "build_dispatch_plan",
    "permute_rows",
    "unpermute_rows",
    "unpermute_weight_grad",
    "transpose_chunks",
    "pack_scaled_fp16",
    "unpack_scaled_fp16",
    "adam_step_",
    "adam_step_multi_",
    "adam_memory_probe_",
)


def _adam_step_multi_(
    params, grads, exp_avgs, exp_avg_sqs, *, steps, param_copies_out=None, grad_scale=1.0, **hyper
) -> None:
    """``torch.ops.moetrain.adam_step_multi_`` with ``param_copies_out`` as None or one entry (a
    tensor, or None for no copy) per param, turned into the op's (copies, copy_index) pair."""
    if param_copies_out is not None and len(param_copies_out) != len(params):
        raise ValueError(
            "adam_step_multi_: param_copies_out must be None or have one entry (tensor or None) per param, "
            f"got {len(param_copies_out)} entries for {len(params)} params"
        )
    lengths = {len(params), len(grads), len(exp_avgs), len(exp_avg_sqs), len(steps)}
    if not params and lengths == {0}:
        return  # nothing to step (the operator needs a tensor to know its device)
    copies = [copy for copy in param_copies_out or () if copy is not None]
    copy_index, next_index = [], 0
    for copy in param_copies_out or ():
        copy_index.append(-1 if copy is None else next_index)
        next_index += copy is not None
    torch.ops.moetrain.adam_step_multi_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        steps=steps,
        grad_scale=grad_scale,
        param_copies_out=copies,
        copy_index=copy_index,
        **hyper,
    )


class _Ops(SimpleNamespace):
    """The operators (looked up when used: with the torch-native twins, :mod:`moetrain.kernels`
    defines them after this module loads), the build facts and the SIMD switches."""

    def __getattr__(self, name: str):
        if name in KERNEL_NAMES:
            return getattr(torch.ops.moetrain, name)
        raise AttributeError(name)


ops = _Ops(
    source_fingerprint=_C.source_fingerprint,
    torch_version=_C.torch_version,
    simd_level=_C.simd_level,
    detected_simd_level=_C.detected_simd_level,
    set_max_simd_level=_C.set_max_simd_level,
    cpu_adam_simd_path=_C.cpu_adam_simd_path,
    adam_step_multi_=_adam_step_multi_,
)

__all__ = ["EXTENSION", "HAS_CUDA_KERNELS", "KERNEL_NAMES", "ops"]
