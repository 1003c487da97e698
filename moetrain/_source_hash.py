"""Fingerprint of the C++/CUDA sources, shared by ``setup.py`` and the import-time staleness check.

``setup.py`` bakes ``csrc_fingerprint(csrc/)`` into the extension; ``moetrain._ext`` recomputes it
from the source tree (when the package runs from a checkout) and refuses a stale build.
This module must not import torch or the rest of the package: ``setup.py`` loads it by path.
"""

import hashlib
from pathlib import Path

SOURCE_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")


def csrc_fingerprint(csrc_dir: Path) -> str:
    """SHA-256 (first 16 hex digits) over the names and bytes of every source file in ``csrc_dir``."""
    digest = hashlib.sha256()
    for path in sorted(Path(csrc_dir).iterdir()):
        if path.suffix in SOURCE_SUFFIXES and path.is_file():
            digest.update(path.name.encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()[:16]
