"""docs/own_model.md run as written: every command of its bash blocks, in order, from a fresh working
directory (the example's files are addressed by absolute path; nothing else changes), and what the
page says about their results."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.helpers.doc_commands import MOETRAIN, ROOT, bash_commands, moetrain_in_process

DOC = ROOT / "docs" / "own_model.md"
EXAMPLE = "scripts/examples/own_model/"


def documented_commands() -> list[list[str]]:
    return bash_commands(DOC)


def test_the_page_documents_training_resuming_on_two_ranks_and_planning():
    commands = documented_commands()
    assert [words[:2] for words in commands] == [
        ["moetrain", "train"],
        ["moetrain", "launch"],
        ["moetrain", "plan"],
    ]
    assert all(words[0] == "moetrain" for words in commands)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_documented_commands_train_resume_on_two_ranks_and_plan(tmp_path, capsys, monkeypatch):
    """The runs by the installed ``moetrain`` command; ``moetrain plan``, which only prints, by the
    command line's ``main`` in this process."""
    assert MOETRAIN.is_file(), f"the moetrain command is not installed next to {sys.executable}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    *runs, plan = (
        [word.replace(EXAMPLE, f"{ROOT / EXAMPLE}/") for word in words] for words in documented_commands()
    )
    for words in runs:
        argv = [str(MOETRAIN), *words[1:]]
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
        output = f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        assert result.returncode == 0, f"{shlex.join(words)}\n{output}"
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert moetrain_in_process(plan) == 0, shlex.join(plan)
    printed = capsys.readouterr().out

    run = tmp_path / "runs" / "digit_sum"
    assert sorted(path.name for path in (run / "checkpoints").iterdir())[-2:] == [
        "step_00000300",
        "step_00000400",
    ]
    assert "resumed from step 300" in (run / "logs" / "rank_0.log").read_text()
    assert (run / "logs" / "rank_1.log").is_file()
    assert len((run / "config_history.jsonl").read_text().splitlines()) == 2
    losses = {record["step"]: record["loss"] for record in map(json.loads, (run / "metrics.jsonl").open())}
    assert max(losses) == 400
    assert losses[400] < 0.5 * losses[10], "the classifier did not learn"
    assert "on 2 nodes x 8 A100" in printed and "ep_size 4 (1 experts per layer per GPU" in printed
    assert "parameters: 17.482K total" in printed and "fits" in printed
