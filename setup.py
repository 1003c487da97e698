"""Builds moetrain and its extension ``moetrain._C`` from ``csrc/``.

CPU sources (``csrc/*.cpp``) are always compiled: C++17, -O3, OpenMP; SIMD code paths are chosen at
run time inside the kernels, so no ``-march`` flag is used and the build runs on any x86-64 CPU.
CUDA sources (``csrc/*.cu``) are added only when torch was built with CUDA and nvcc is found; they
are compiled for every GPU the planner's presets name that this nvcc can target (or for
``TORCH_CUDA_ARCH_LIST``, torch's own setting, when it is set). Sources and flags come from
``moetrain/_build_spec.py``, which the just-in-time build in ``moetrain/_ext.py`` shares.
"""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
GENERATED = ROOT / "build" / "generated"


def _load_by_path(name: str):
    """A module of moetrain/ that imports neither torch nor the package, loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"_moetrain_{name}", ROOT / "moetrain" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD_SPEC = _load_by_path("_build_spec")
SETUPTOOLS_FLOOR = (77, 0)  # the SPDX `license = "Apache-2.0"` string of pyproject.toml


def _require_setuptools() -> None:
    import setuptools

    release = tuple(int(part) for part in setuptools.__version__.split(".")[:2] if part.isdigit())
    if release < SETUPTOOLS_FLOOR:
        sys.exit(
            f"moetrain: building needs setuptools >= 77 (pyproject.toml's SPDX license string), found "
            f"{setuptools.__version__}: pip install 'setuptools>=77'"
        )


def _require_torch():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        sys.exit(
            "moetrain: PyTorch must be installed before moetrain is built, and the build must see it: "
            "`pip install --no-build-isolation .` in the environment that holds your torch (pip's build "
            "isolation hides it), or `make build` for this repository's .venv."
        )
    problem = BUILD_SPEC.torch_range_problem(torch.__version__)
    if problem is not None:
        sys.exit(problem)
    return cpp_extension


def _refuse_isolated_build() -> None:
    """pip's build isolation installs a fresh torch into a temporary environment; the extension
    would then be compiled against it instead of the torch that will run it."""
    import torch

    location = str(Path(torch.__file__).resolve())
    if "pip-build-env" in location or "build-env-" in location:
        sys.exit(
            f"moetrain: this build would compile against a temporary torch ({torch.__version__}, "
            f"{location}), not the one you run: install with `pip install --no-build-isolation .` in the "
            "environment that holds your torch"
        )


def _find_nvcc(cpp_extension) -> str | None:
    import torch

    if torch.version.cuda is None:
        return None
    cuda_home = cpp_extension.CUDA_HOME
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _nvcc_arch_flags(nvcc: str) -> list[str]:
    """The presets' GPUs this nvcc can target (one line names those it cannot); none when the
    user chose with ``TORCH_CUDA_ARCH_LIST``, which torch's build then applies."""
    flags, skipped = BUILD_SPEC.nvcc_arch_flags(nvcc)
    if skipped:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.split()[-1]
        print(BUILD_SPEC.skipped_archs_message(skipped, version), file=sys.stderr)
    return flags


def _write_build_info_header(with_cuda: bool) -> None:
    """``build/generated/moetrain_build_info.h``: the csrc/ fingerprint and the torch version this
    build compiles against (``moetrain._ext`` compares both at import). Only bindings.cpp includes
    it, so a source edit or a torch upgrade recompiles that file and the edited one."""
    import torch

    fingerprint = _load_by_path("_source_hash").csrc_fingerprint(CSRC, with_cuda)
    GENERATED.mkdir(parents=True, exist_ok=True)
    header = GENERATED / "moetrain_build_info.h"
    text = BUILD_SPEC.build_info_header(fingerprint, torch.__version__)
    if not header.exists() or header.read_text() != text:
        header.write_text(text)


def _extensions():
    cpp_extension = _require_torch()
    _refuse_isolated_build()
    nvcc = _find_nvcc(cpp_extension)
    with_cuda = nvcc is not None
    _write_build_info_header(with_cuda)
    source_paths = BUILD_SPEC.sources(CSRC, with_cuda)
    clashes = BUILD_SPEC.object_name_clashes(source_paths)
    if clashes:
        sys.exit(f"moetrain: several csrc/ sources are named {', '.join(clashes)}: give each its own stem")
    sources = [str(p.relative_to(ROOT)) for p in source_paths]
    define_macros = []
    extension_class = cpp_extension.CppExtension
    extra_compile_args = {"cxx": list(BUILD_SPEC.CXX_FLAGS)}
    if with_cuda:
        extension_class = cpp_extension.CUDAExtension
        extra_compile_args["nvcc"] = BUILD_SPEC.NVCC_FLAGS + _nvcc_arch_flags(nvcc)
        define_macros.append(("MOETRAIN_WITH_CUDA", "1"))
    return [
        extension_class(
            name="moetrain._C",
            sources=sources,
            include_dirs=[str(CSRC), str(GENERATED)],
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=list(BUILD_SPEC.LINK_FLAGS),
        )
    ], cpp_extension


def _build_ext_class(cpp_extension):
    class BuildExtWithCache(cpp_extension.BuildExtension):
        """Keeps ninja's object files in build/temp, so a rebuild (also through `pip install -e`,
        which would otherwise use a fresh temporary directory) recompiles only edited sources."""

        def build_extensions(self):
            self.build_temp = str(ROOT / "build" / "temp")
            super().build_extensions()

    return BuildExtWithCache.with_options(use_ninja=True)


def main() -> None:
    _require_setuptools()
    ext_modules, cpp_extension = _extensions()
    # Metadata, packages and entry points: pyproject.toml. Here: the extension, and the dependencies:
    # the supported torch range (a torch other than the one this build compiled against makes
    # moetrain._ext rebuild the extension for it on first import, so an upgrade never breaks it).
    setup(
        install_requires=[BUILD_SPEC.TORCH_REQUIREMENT, "pyyaml", "numpy"],
        ext_modules=ext_modules,
        cmdclass={"build_ext": _build_ext_class(cpp_extension)},
    )


if __name__ == "__main__":
    main()
