"""Fingerprint of the C++/CUDA sources, shared by ``setup.py`` and the import-time staleness check.

``setup.py`` bakes ``csrc_fingerprint(csrc/)`` into the extension; ``moetrain._ext`` recomputes it
from the source tree (when the package runs from a checkout) and refuses a stale build.
This module must not import torch or the rest of the package: ``setup.py`` loads it by path.
"""

import hashlib
from pathlib import Path

CPU_SUFFIXES = (".cpp", ".h")
CUDA_SUFFIXES = (".cu", ".cuh")


def csrc_fingerprint(csrc_dir: Path, with_cuda: bool) -> str:
    """``"cpu:"`` or ``"cuda:"`` and the SHA-256 (first 16 hex digits) over the names and bytes of
    the sources a build compiles: ``.cpp``/``.h``, plus ``.cu``/``.cuh`` for a CUDA build (a CPU
    build is not stale when only CUDA sources change)."""
    suffixes = CPU_SUFFIXES + (CUDA_SUFFIXES if with_cuda else ())
    digest = hashlib.sha256()
    for path in sorted(Path(csrc_dir).iterdir()):
        if path.suffix in suffixes and path.is_file():
            digest.update(path.name.encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return ("cuda:" if with_cuda else "cpu:") + digest.hexdigest()[:16]
