"""The shell commands a docs/ page documents, as its test runs them."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOETRAIN = Path(sys.executable).parent / "moetrain"  # the venv's entry point, whatever PATH says


def bash_commands(page: Path) -> list[list[str]]:
    """Every line of every ```bash block of ``page``, split as a shell would (continued lines
    joined, comments dropped, empty lines skipped)."""
    commands = []
    for block in page.read_text(encoding="utf-8").split("```bash\n")[1:]:
        lines = block.split("```", 1)[0].replace("\\\n", " ").splitlines()
        commands += [shlex.split(line, comments=True) for line in lines]
    return [words for words in commands if words]
