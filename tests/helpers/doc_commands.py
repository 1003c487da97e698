"""The shell commands a docs/ page documents, as its test runs them, and every runnable fenced block
of README.md and docs/*.md by a stable key (what tests/docs/test_doc_command_coverage.py checks)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

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


def _absolute(words: list[str], local: tuple[str, ...]) -> list[str]:
    """``words`` with those starting with ``local`` (repository paths) made absolute."""
    return [str(ROOT / word) if word.startswith(local) else word for word in words]


def run_moetrain(
    words: list[str], cwd: Path, local: tuple[str, ...], timeout: float = 300
) -> tuple[str, str]:
    """Runs a documented ``moetrain ...`` command with the venv's entry point in ``cwd`` (one
    thread per process), the words starting with ``local`` (repository paths) made absolute;
    asserts it exits 0 (else shows its output's tails). Returns its stdout and its stderr."""
    argv = [str(MOETRAIN), *_absolute(words[1:], local)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{shlex.join(words)}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return result.stdout, result.stderr


def moetrain_in_process(words: list[str], local: tuple[str, ...] = ()) -> int:
    """A documented ``moetrain ...`` command run by the CLI's ``main`` in this process, from the
    current working directory, the words starting with ``local`` made absolute (as
    :func:`run_moetrain`); what it prints goes to this process's stdout and stderr (capsys reads
    them). The logging handlers the command line added are detached and torch's thread count (a
    run sets it) restored afterwards. Returns its exit code."""
    from moetrain.cli import main
    from moetrain.logs import detach_handlers

    threads = torch.get_num_threads()
    try:
        return main(_absolute(words[1:], local))
    finally:
        detach_handlers()
        torch.set_num_threads(threads)


# ---- every runnable fenced block of README.md and docs/*.md, by a stable key --------------------

SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
PYTHON_LANGUAGES = ("python", "py")
COMMAND_PREFIXES = ("moetrain ", ".venv/bin/", "python ", "torchrun ", "make ", "sbatch ", "srun ")
_ENV_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")
_TRAILING_COMMENT = re.compile(r"\s+#(\s.*)?$")
_IMPORT = re.compile(r"^(import|from)\s")


@dataclass(frozen=True)
class DocBlock:
    """One fenced code block of a page: ``page`` relative to the repository root (``"README.md"``,
    ``"docs/m6.md"``), ``line`` the 1-based line of its opening fence, ``language`` its info
    string's first word (``""`` untagged), ``text`` its lines (dedented) and ``key`` (see
    :func:`block_key`)."""

    page: str
    line: int
    language: str
    text: str
    key: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def documented_pages() -> list[Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _command_line(line: str) -> str:
    """``line`` without its indentation, a shell prompt ``$ `` and leading ``NAME=value`` settings."""
    stripped = line.strip().removeprefix("$ ")
    return _ENV_ASSIGNMENT.sub("", stripped)


def is_runnable(language: str, text: str) -> bool:
    """A block a reader runs: tagged bash/sh/shell/console/python, or untagged with a line that
    starts like a command (:data:`COMMAND_PREFIXES`, after a ``$ `` prompt or ``NAME=value``
    settings)."""
    if language in SHELL_LANGUAGES + PYTHON_LANGUAGES:
        return True
    return language == "" and any(
        _command_line(line).startswith(COMMAND_PREFIXES) for line in text.splitlines()
    )


def block_key(language: str, text: str) -> str:
    """The block's first command: its first line that is not blank or a comment (for Python, nor an
    import), without a ``$ `` prompt, a trailing ``# comment`` or a line continuation."""
    in_import = False
    for line in text.splitlines():
        stripped = line.strip()
        if language in PYTHON_LANGUAGES and (in_import or _IMPORT.match(stripped)):
            in_import = (in_import or "(" in stripped) and ")" not in stripped
            continue
        if not stripped or stripped.startswith("#"):
            continue
        stripped = _TRAILING_COMMENT.sub("", stripped.removeprefix("$ "))
        return stripped.removesuffix("\\").rstrip()
    return text.strip().splitlines()[0] if text.strip() else ""


def doc_blocks(page: Path) -> list[DocBlock]:
    """The runnable fenced blocks of ``page`` (:func:`is_runnable`) in order. A key that occurs
    again on the page gets `` #2``, `` #3``, ... appended."""
    lines = page.read_text(encoding="utf-8").splitlines()
    name = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name
    blocks: list[DocBlock] = []
    seen: dict[str, int] = {}
    index = 0
    while index < len(lines):
        fence = lines[index].strip()
        if not fence.startswith("```"):
            index += 1
            continue
        words = fence[3:].split()
        language = words[0].lower() if words else ""
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        text = textwrap.dedent("\n".join(lines[index + 1 : end]))
        if is_runnable(language, text):
            key = block_key(language, text)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:
                key = f"{key} #{seen[key]}"
            blocks.append(DocBlock(name, index + 1, language, text, key))
        index = end + 1
    return blocks


def documented_blocks() -> list[DocBlock]:
    """:func:`doc_blocks` of every page of :func:`documented_pages`."""
    return [block for page in documented_pages() for block in doc_blocks(page)]


def doc_block(page: str, key: str) -> DocBlock:
    """The block of ``page`` (relative to the repository root) whose key is ``key``; a missing one
    raises naming the page's keys."""
    blocks = doc_blocks(ROOT / page)
    for block in blocks:
        if block.key == key:
            return block
    raise KeyError(f"{page} has no runnable block {key!r}; its blocks: {[b.key for b in blocks]}")


def shell_commands(block: DocBlock) -> list[list[str]]:
    """The commands of a shell block, split as a shell would (continued lines joined, comments
    dropped); in a block that shows ``$ `` prompts, only the prompted lines (the rest is output)."""
    lines = block.text.replace("\\\n", " ").splitlines()
    if any(line.startswith("$ ") for line in lines):
        lines = [line.removeprefix("$ ") for line in lines if line.startswith("$ ")]
    commands = [shlex.split(line, comments=True) for line in lines]
    return [words for words in commands if words]
