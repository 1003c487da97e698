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
   torch version and the source fingerprint (``~/.cache/moetrain/extensions/``; ranks starting
   together wait on torch's build lock), with one progress line; later imports load it from there.
4. Where nothing can compile (no C++ compiler or ninja, or the build fails), the torch-native twins
   (:mod:`moetrain.kernels.native`) serve every operator, with one warning.

``EXTENSION`` says which of "prebuilt", "just-in-time" or "torch-native" happened; ``ops`` gathers
the operators, the build facts and the SIMD switches under one name.
"""

from __future__ import annotations

import importlib
import logging
import mmap
import os
import shutil
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
    cuda_arch_flags,
    nvcc_archs,
    sources,
    torch_range_problem,
)
from moetrain._source_hash import csrc_fingerprint

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
    built = built_against_torch_version(binary)
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


def build_just_in_time(csrc: Path, reason: str) -> ModuleType:
    """Compiles ``csrc`` for the running torch into the cache (or loads an earlier build of the
    same torch and sources from it) and returns the loaded module."""
    from torch.utils import cpp_extension

    nvcc = _cuda_compiler()
    fingerprint = csrc_fingerprint(csrc, with_cuda=nvcc is not None)
    directory = cache_root() / f"torch-{torch.__version__}-{fingerprint.replace(':', '-')}"
    directory.mkdir(parents=True, exist_ok=True)
    header = directory / "moetrain_build_info.h"
    text = build_info_header(fingerprint, torch.__version__)
    if not header.exists() or header.read_text() != text:
        header.write_text(text)
    if not any((directory / f"{JIT_NAME}{suffix}").exists() for suffix in EXTENSION_SUFFIXES):
        logger.warning(
            "moetrain: %s; compiling the C++%s extension for torch %s into %s (once per torch and "
            "source version; a minute or two)",
            reason,
            "/CUDA" if nvcc else "",
            torch.__version__,
            directory,
        )
    cuda_flags = []
    if nvcc is not None:
        arch_flags, skipped = cuda_arch_flags(nvcc_archs(nvcc))
        cuda_flags = [*NVCC_FLAGS, *arch_flags, "-DMOETRAIN_WITH_CUDA=1"]
        if skipped:
            gpus = ", ".join(CUDA_ARCHS[arch] for arch in skipped)
            logger.warning("moetrain: this nvcc cannot compile for %s", gpus)
    return cpp_extension.load(
        name=JIT_NAME,
        sources=[str(p) for p in sources(csrc, with_cuda=nvcc is not None)],
        extra_cflags=[*CXX_FLAGS, *(["-DMOETRAIN_WITH_CUDA=1"] if nvcc else [])],
        extra_cuda_cflags=cuda_flags,
        extra_ldflags=list(LINK_FLAGS),
        extra_include_paths=[str(csrc), str(directory)],
        build_directory=str(directory),
        with_cuda=nvcc is not None,
        verbose=False,
    )


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
        except Exception as error:  # a compiler error, a failed link: anything counts  # noqa: BLE001
            missing = f"the build failed ({type(error).__name__}: {str(error).strip().splitlines()[-1:]})"
    logger.warning(
        "moetrain: %s and %s: the torch-native implementations of its kernels serve instead (correct, "
        "slower on the CPU); to compile, %s",
        reason,
        missing,
        CHECKOUT_BUILD,
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
