"""Builds moetrain and its extension ``moetrain._C`` from ``csrc/``.

CPU sources (``csrc/*.cpp``) are always compiled: C++17, -O3, OpenMP; SIMD code paths are chosen at
run time inside the kernels, so no ``-march`` flag is used and the build runs on any x86-64 CPU.
CUDA sources (``csrc/*.cu``) are added only when torch was built with CUDA and nvcc is found.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
GENERATED = ROOT / "build" / "generated"


def _load_source_hash_module():
    spec = importlib.util.spec_from_file_location(
        "_moetrain_source_hash", ROOT / "moetrain" / "_source_hash.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _require_torch():
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError:
        sys.exit(
            "moetrain: PyTorch must be installed before moetrain is built, and the build must see it: "
            "`pip install --no-build-isolation .` in the environment that holds your torch (pip's build "
            "isolation hides it), or `make build` for this repository's .venv."
        )
    return cpp_extension


def _torch_release() -> str:
    """The running torch's release, without the local label (``2.13.0+cpu`` -> ``2.13.0``): the
    requirement ``torch==2.13.0`` then accepts the CPU and every CUDA build of that release."""
    import torch

    return torch.__version__.split("+", 1)[0]


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


def _nvcc_available(cpp_extension) -> bool:
    import torch

    if torch.version.cuda is None:
        return False
    cuda_home = cpp_extension.CUDA_HOME
    return bool(cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists()) or shutil.which("nvcc") is not None


def _write_build_info_header(with_cuda: bool) -> None:
    """``build/generated/moetrain_build_info.h``: the csrc/ fingerprint and the torch version this
    build compiles against (``moetrain._ext`` compares both at import). Only bindings.cpp includes
    it, so a source edit or a torch upgrade recompiles that file and the edited one."""
    import torch

    fingerprint = _load_source_hash_module().csrc_fingerprint(CSRC, with_cuda)
    GENERATED.mkdir(parents=True, exist_ok=True)
    header = GENERATED / "moetrain_build_info.h"
    text = (
        "#pragma once\n"
        f'#define MOETRAIN_SOURCE_FINGERPRINT "{fingerprint}"\n'
        f'#define MOETRAIN_TORCH_VERSION "{torch.__version__}"\n'
    )
    if not header.exists() or header.read_text() != text:
        header.write_text(text)


def _extensions():
    cpp_extension = _require_torch()
    _refuse_isolated_build()
    with_cuda = _nvcc_available(cpp_extension)
    _write_build_info_header(with_cuda)
    sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp"))
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
    define_macros = []
    extension_class = cpp_extension.CppExtension
    extra_compile_args = {"cxx": cxx_flags}
    if with_cuda:
        sources += sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cu"))
        extension_class = cpp_extension.CUDAExtension
        extra_compile_args["nvcc"] = ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]
        define_macros.append(("MOETRAIN_WITH_CUDA", "1"))
    return [
        extension_class(
            name="moetrain._C",
            sources=sources,
            include_dirs=[str(CSRC), str(GENERATED)],
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=["-fopenmp"],
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
    ext_modules, cpp_extension = _extensions()
    # Metadata, packages and entry points: pyproject.toml. Here: the extension, and the dependencies,
    # with torch pinned to the version the extension is compiled against (its ABI is that version's).
    setup(
        install_requires=[f"torch=={_torch_release()}", "pyyaml", "numpy"],
        ext_modules=ext_modules,
        cmdclass={"build_ext": _build_ext_class(cpp_extension)},
    )


if __name__ == "__main__":
    main()
