"""The shell commands a docs/ page documents, as its test runs them."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT

MOETRAIN = Path(sys.executable).parent / "moetrain"  # the venv's entry point, whatever PATH says


def bash_commands(page: Path) -> list[list[str]]:
    """Every line of every ```bash block of ``page``, split as a shell would (continued lines
    joined, comments dropped, empty lines skipped)."""
    commands = []
    for block in page.read_text(encoding="utf-8").split("```bash\n")[1:]:
        lines = block.split("```", 1)[0].replace("\\\n", " ").splitlines()
        commands += [shlex.split(line, comments=True) for line in lines]
    return [words for words in commands if words]


def run_moetrain(
    words: list[str], cwd: Path, local: tuple[str, ...], timeout: float = 300
) -> tuple[str, str]:
    """Runs a documented ``moetrain ...`` command with the venv's entry point in ``cwd`` (one
    thread per process), the words starting with ``local`` (repository paths) made absolute;
    asserts it exits 0 (else shows its output's tails). Returns its stdout and its stderr."""
    argv = [str(MOETRAIN)] + [str(ROOT / word) if word.startswith(local) else word for word in words[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{shlex.join(words)}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return result.stdout, result.stderr
