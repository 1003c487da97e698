"""docs/parallelize.md run as written: every command of its bash block, in order, from a fresh
working directory (repository files addressed by absolute path; ``> FILE`` writes the command's
output there, as the shell would; ``moetrain plan`` runs in this process)."""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from tests.helpers.doc_commands import MOETRAIN, ROOT, bash_commands, moetrain_in_process, run_moetrain

DOC = ROOT / "docs" / "parallelize.md"
LOCAL = ("scripts/", "configs/")  # the repository's files the commands name


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
def test_documented_commands_run(tmp_path, capsys, monkeypatch):
    """The launches by the installed ``moetrain`` command; ``moetrain plan``, which only prints, by
    the command line's ``main`` in this process."""
    assert MOETRAIN.is_file(), f"the moetrain command is not installed next to {sys.executable}"
    monkeypatch.chdir(tmp_path)
    outputs = []
    for words in documented_commands():
        target = None
        if ">" in words:
            words, target = words[: words.index(">")], words[words.index(">") + 1]
        if words[1] == "plan":
            capsys.readouterr()
            assert moetrain_in_process(words, LOCAL) == 0, shlex.join(words)
            stdout = capsys.readouterr().out
        else:
            stdout, _ = run_moetrain(words, tmp_path, LOCAL)
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
