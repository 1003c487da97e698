"""docs/parallelize.md run as written: every command of its bash block, in order, from a fresh
working directory (repository files addressed by absolute path; ``> FILE`` writes the command's
output there, as the shell would)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.doc_commands import MOETRAIN, ROOT, bash_commands, run_moetrain

DOC = ROOT / "docs" / "parallelize.md"


def documented_commands() -> list[list[str]]:
    return bash_commands(DOC)


def test_the_page_runs_the_example_then_plans_and_trains():
    assert [words[:2] for words in documented_commands()] == [
        ["moetrain", "launch"],
        ["moetrain", "plan"],
        ["moetrain", "launch"],
    ]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_documented_commands_run(tmp_path):
    assert MOETRAIN.is_file(), f"the moetrain command is not installed next to {sys.executable}"
    outputs = []
    for words in documented_commands():
        target = None
        if ">" in words:
            words, target = words[: words.index(">")], words[words.index(">") + 1]
        stdout, _ = run_moetrain(words, tmp_path, ("scripts/", "configs/"))
        if target is not None:
            (tmp_path / target).write_text(stdout)
        outputs.append(stdout)
    assert "parallelize: dp 1 x ep 2 x tp 2" in outputs[0] and "split.head 1" in outputs[0]
    losses = [float(line.split()[3]) for line in outputs[0].splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    plan = json.loads((tmp_path / "plan.json").read_text())
    run = tmp_path / "runs" / "planned"
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["parallel"]["strategy"] == plan["strategy"]
    assert recorded["parallel"]["ep_size"] == plan["parallel"]["ep_size"]
    assert (run / "checkpoints" / "step_00000004").is_dir()
