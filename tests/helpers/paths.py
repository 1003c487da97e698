"""The repository's root, computed once here so that a test file's depth under tests/ does not matter,
and :func:`load_script`, a script of the repository imported as a module."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """The file ``path`` (a benchmark, a script, ``setup.py``: not in a package) imported as module
    ``name`` (default: its stem); its top level runs, its ``__main__`` block does not."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
