"""The repository's Markdown renders as written: every code fence that opens also closes."""

from __future__ import annotations

import pytest

from tests.helpers.paths import ROOT

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")])


def unclosed_fences(text: str) -> list[int]:
    """Line numbers (1-based) of fences that open a block never closed before the next opener with
    an info string (```` ```bash ```` inside a block means its closer is missing) or the end."""
    problems, opened = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped.startswith("```"):
            continue
        if opened is None:
            opened = number
        elif stripped == "```":
            opened = None
        else:
            problems.append(opened)
            opened = number
    return problems + ([opened] if opened is not None else [])


def test_the_fence_check_finds_an_unclosed_block():
    assert unclosed_fences("a\n```\ncode\n```\n") == []
    assert unclosed_fences("```\ncode\n## heading\n```bash\nx\n```\n") == [1]
    assert unclosed_fences("```\ncode\n```\n```\nleft open\n") == [4]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_fence_is_closed(page):
    assert unclosed_fences(page.read_text(encoding="utf-8")) == [], page
