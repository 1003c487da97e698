"""docs/moefy.md's example, run as written (a tiny GPT-2 built from its config: no download)."""

from __future__ import annotations

from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "moefy.md"


def test_the_documented_example_runs(capsys):
    pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    blocks = DOC.read_text(encoding="utf-8").split("```python\n")[1:]
    assert len(blocks) == 1
    exec(compile(blocks[0].split("```", 1)[0], str(DOC), "exec"), {})  # noqa: S102 - our own docs
    assert "['transformer.h.0.mlp', 'transformer.h.1.mlp']" in capsys.readouterr().out
