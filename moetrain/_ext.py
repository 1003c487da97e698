"""Loads the compiled extension ``moetrain._C`` and refuses a missing or stale one.

There is no pure-Python fallback: a missing build is an ImportError that says how to build.
"""

from pathlib import Path

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

__all__ = ["ops"]
