"""Boundaries of the core package: it never imports its example models (``moe_lm``, ``m6_moe``),
and it reaches torch's private names only through moetrain/_torch_compat.py (whose wrappers
tests/unit/foundation/test_torch_compat.py checks)."""

from __future__ import annotations

import io
import subprocess
import sys
import tokenize

import pytest

from tests.helpers.paths import ROOT

COMPAT = ROOT / "moetrain" / "_torch_compat.py"

IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
import moetrain
names = sorted(m.name for m in pkgutil.walk_packages(moetrain.__path__, "moetrain."))
for name in names:
    importlib.import_module(name)
models = sorted(m for m in sys.modules if m.split(".")[0] in ("m6_moe", "moe_lm"))
print(len(names), bool(models), models)
"""
MODEL_PACKAGES = {"m6_moe", "moe_lm"}


@pytest.mark.slow
def test_importing_every_core_module_imports_no_model_package():
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_MODULE], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    count, imported, _ = done.stdout.split(" ", 2)
    assert int(count) > 50 and imported == "False", done.stdout


def test_no_core_module_names_a_model_package_in_an_import():
    """The import statements of moetrain/ (module level and inside functions alike) name no
    example model package: the models register through their entry points."""
    import ast

    found = []
    for path in sorted((ROOT / "moetrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}"
                for n in names
                if n.split(".")[0] in MODEL_PACKAGES
            ]
    assert found == [], "\n".join(found)


# Private by name but documented for users: torch._check is the documented way to state a shape
# assumption to torch.compile / torch.export (torch.compiler docs).
PUBLIC_UNDERSCORE = {"torch._check"}


def private_torch_names(source: str) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of each ``torch.<...>`` chain in the code (not comments or strings)
    with a component that starts with ``_`` and is not a dunder (``torch._C``, ``torch.utils._pytree``),
    outside ``PUBLIC_UNDERSCORE``."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type != tokenize.NL]
    found = []
    for i, token in enumerate(tokens):
        if token.type != tokenize.NAME or token.string != "torch" or (i and tokens[i - 1].string == "."):
            continue
        parts, j = ["torch"], i + 1
        while j + 1 < len(tokens) and tokens[j].string == "." and tokens[j + 1].type == tokenize.NAME:
            parts.append(tokens[j + 1].string)
            j += 2
        for end in range(2, len(parts) + 1):
            part = parts[end - 1]
            if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
                name = ".".join(parts[:end])
                if name not in PUBLIC_UNDERSCORE:
                    found.append((token.start[0], name))
                break
    return found


def test_the_private_name_scan_sees_code_only():
    code = (
        "import torch._dynamo\n"
        "from torch.utils._pytree import tree_map\n"
        "x = torch._C._foo(torch.__version__)  # torch._utils in a comment\n"
        "torch._check(x)\n"
        "s = 'torch._C'\n"
    )
    assert private_torch_names(code) == [(1, "torch._dynamo"), (2, "torch.utils._pytree"), (3, "torch._C")]


def test_torch_private_names_appear_only_in_the_compat_module():
    found = []
    for package in ("moetrain", "models"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == COMPAT:
                continue
            for line, name in private_torch_names(path.read_text(encoding="utf-8")):
                found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert found == [], "wrap it in moetrain/_torch_compat.py (with a test):\n" + "\n".join(found)
    assert private_torch_names(COMPAT.read_text(encoding="utf-8"))  # the scan sees the wrapped ones


LOADED_AFTER_PLAN = """
import sys
from moetrain.cli import main
code = main(["plan", "--model", "configs/m6_1t.yaml", "--cluster", "v100-32gb", "--nodes", "60"])
print(code, "torch.distributed.checkpoint" in sys.modules)
from moetrain.checkpoint import save_checkpoint
print(callable(save_checkpoint), "torch.distributed.checkpoint" in sys.modules)
"""


def test_a_command_that_never_touches_a_checkpoint_does_not_import_dcp():
    """DCP (with DTensor) is about a third of `moetrain`'s start-up: `moetrain plan`, `moetrain
    launch` and a refused config do without it; the checkpoint functions load it on first use."""
    done = subprocess.run(
        [sys.executable, "-c", LOADED_AFTER_PLAN], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["0 False", "True True"], done.stdout[-500:]
