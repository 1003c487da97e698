"""Loads the compiled extension ``moetrain._C`` and refuses a missing or stale one.

There is no pure-Python fallback: a missing build is an ImportError that says how to build.
"""

from pathlib import Path
from types import SimpleNamespace

from moetrain._source_hash import csrc_fingerprint

BUILD_HINT = (
    "build it from the repository root with `make build` "
    "(or `pip install -e . --no-build-isolation` inside the virtual environment)"
)

try:
    import torch  # noqa: F401  (libtorch must be loaded before the extension)

    from moetrain import _C as ops
except ImportError as error:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        f"moetrain's C++ extension moetrain._C is not built or failed to load ({error}); {BUILD_HINT}"
    ) from error

_CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
if _CSRC_DIR.is_dir():
    _expected = csrc_fingerprint(_CSRC_DIR, with_cuda=ops.source_fingerprint().startswith("cuda:"))
    if ops.source_fingerprint() != _expected:
        raise ImportError(
            f"moetrain._C is stale: it was built from csrc/ sources with fingerprint "
            f"{ops.source_fingerprint()} but {_CSRC_DIR} now has {_expected}; rebuild: {BUILD_HINT}"
        )

# The CUDA ops of moetrain._C (``permute_rows_cuda``, ...) under the CPU ops' names, or None when
# the extension was built without CUDA.
_CUDA_KERNELS = (
    SimpleNamespace(
        **{name.removesuffix("_cuda"): getattr(ops, name) for name in dir(ops) if name.endswith("_cuda")}
    )
    if hasattr(ops, "permute_rows_cuda")
    else None
)


def kernels_for(tensor: torch.Tensor, caller: str):
    """The extension's kernels for ``tensor``'s device, under the CPU ops' names: ``ops`` for CPU
    tensors, the ``*_cuda`` ops for CUDA tensors (``kernels_for(x, ...).permute_rows`` is
    ``ops.permute_rows_cuda`` when ``x`` is on a GPU). ``caller`` names the function and argument
    in the errors: a CUDA tensor with an extension built without CUDA, or any other device."""
    if tensor.device.type == "cpu":
        return ops
    if tensor.device.type == "cuda":
        if _CUDA_KERNELS is None:
            raise RuntimeError(
                f"{caller} got a CUDA tensor ({tensor.device}), but moetrain._C was built without CUDA "
                "kernels: setup.py compiles csrc/*.cu only when torch has CUDA (torch.version.cuda is "
                f"{torch.version.cuda!r}) and nvcc is found (CUDA_HOME or PATH). Rebuild in such an "
                "environment with `make clean && make build` (or `pip install -e . --no-build-isolation`), "
                "or move the tensors to the CPU."
            )
        return _CUDA_KERNELS
    raise RuntimeError(
        f"{caller} got a tensor on {tensor.device}; moetrain's kernels run on CPU and CUDA tensors"
    )


__all__ = ["kernels_for", "ops"]
