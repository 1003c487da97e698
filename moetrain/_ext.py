"""Loads the compiled extension ``moetrain._C`` and refuses a missing, stale or mismatched one.

Loading ``moetrain._C`` registers the C++/CUDA kernels as torch operators ``torch.ops.moetrain.*``
(schemas in ``csrc/bindings.cpp``); :mod:`moetrain.kernels` adds their fake (meta)
implementations, autograd formulas and torch-native twins. ``ops`` gathers the extension's
functions under one name: the kernels (the torch operators), the build facts and the SIMD switches.

There is no pure-Python fallback for a missing build: an ImportError says how to build. An
extension built against another torch is refused at import with both versions named (a binary
built against another torch usually fails to load with an undefined symbol, or worse, loads).
"""

from __future__ import annotations

import importlib.util
import mmap
from pathlib import Path
from types import SimpleNamespace

import torch

from moetrain._source_hash import csrc_fingerprint

# Two ways moetrain gets onto a machine, two ways to rebuild: a repository checkout (the Makefile's
# editable install) and a copy installed from the source with pip (README).
CHECKOUT_BUILD = "`make build` (or `pip install -e . --no-build-isolation` inside the virtual environment)"
CHECKOUT_REBUILD = "`make clean && make build` (or `pip install -e . --no-build-isolation`)"
INSTALLED_REBUILD = "`pip install --no-build-isolation --force-reinstall --no-deps <the moetrain source>`"
BUILD_HINT = (
    f"build it: in a repository checkout, from its root with {CHECKOUT_BUILD}; for an installed copy, "
    f"{INSTALLED_REBUILD}"
)
# The literal csrc/bindings.cpp compiles into the binary (kTorchVersionRecord): prefix, version, ";".
_TORCH_VERSION_PREFIX = b"moetrain-built-against-torch="


def built_against_torch_version(binary: Path) -> str | None:
    """The torch version recorded in the extension binary at build time, read from the file
    without loading it (None when the record is absent: an older build)."""
    with open(binary, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(_TORCH_VERSION_PREFIX)
        if start < 0:
            return None
        start += len(_TORCH_VERSION_PREFIX)
        end = data.find(b";", start, start + 128)
        return None if end < 0 else data[start:end].decode("ascii", "replace")


def torch_mismatch_message(built: str, running: str) -> str:
    return (
        f"moetrain._C was built against torch {built} but torch {running} is installed; rebuild the "
        f"extension for this torch: in a repository checkout {CHECKOUT_REBUILD}; for an installed copy "
        f"{INSTALLED_REBUILD}"
    )


def _check_binary_before_loading() -> None:
    spec = importlib.util.find_spec("moetrain._C")
    if spec is None or spec.origin is None:
        raise ImportError(f"moetrain's C++ extension moetrain._C is not built; {BUILD_HINT}")
    built = built_against_torch_version(Path(spec.origin))
    if built is not None and built != torch.__version__:
        raise ImportError(torch_mismatch_message(built, torch.__version__))


_check_binary_before_loading()
try:
    from moetrain import _C
except ImportError as error:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        f"moetrain's C++ extension moetrain._C is not built or failed to load ({error}); {BUILD_HINT}"
    ) from error

if _C.torch_version() != torch.__version__:  # pragma: no cover - the file check above sees it first
    raise ImportError(torch_mismatch_message(_C.torch_version(), torch.__version__))

_CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
if _CSRC_DIR.is_dir():
    _expected = csrc_fingerprint(_CSRC_DIR, with_cuda=_C.source_fingerprint().startswith("cuda:"))
    if _C.source_fingerprint() != _expected:
        raise ImportError(
            f"moetrain._C is stale: it was built from csrc/ sources with fingerprint "
            f"{_C.source_fingerprint()} but {_CSRC_DIR} now has {_expected}; rebuild from the repository "
            f"root: {CHECKOUT_BUILD}"
        )

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


ops = SimpleNamespace(
    **{name: getattr(torch.ops.moetrain, name) for name in KERNEL_NAMES},
    source_fingerprint=_C.source_fingerprint,
    torch_version=_C.torch_version,
    simd_level=_C.simd_level,
    detected_simd_level=_C.detected_simd_level,
    set_max_simd_level=_C.set_max_simd_level,
    cpu_adam_simd_path=_C.cpu_adam_simd_path,
)
ops.adam_step_multi_ = _adam_step_multi_

__all__ = ["HAS_CUDA_KERNELS", "KERNEL_NAMES", "ops"]
