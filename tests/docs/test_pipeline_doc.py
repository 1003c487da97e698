"""docs/pipeline.md run as written: a pp2 run on two ranks, then its checkpoint resumed in one
process (pp 1), from a fresh working directory."""

from __future__ import annotations

import pytest

from tests.helpers.doc_commands import ROOT, bash_commands, run_moetrain

DOC = ROOT / "docs" / "pipeline.md"


def documented_commands() -> list[list[str]]:
    return bash_commands(DOC)


def test_the_page_trains_with_stages_then_resumes_in_one_process():
    commands = documented_commands()
    assert [words[:2] for words in commands] == [
        ["moetrain", "launch"], ["moetrain", "train"], ["moetrain", "launch"], ["moetrain", "plan"],
        ["moetrain", "plan"],
    ]  # fmt: skip
    assert "parallel.pp_size=2" in commands[0] and "parallel.pp_size=2" in commands[2]
    assert "--pp-size" in commands[3]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_documented_commands_run(tmp_path):
    outputs = []
    for words in documented_commands():
        stdout, stderr = run_moetrain(words, tmp_path, ("configs/", "models/"))
        outputs.append(stdout + stderr)
    run = tmp_path / "runs" / "pp2" / "checkpoints"
    assert (run / "step_00000003").is_dir() and (run / "step_00000005").is_dir()
    assert "resumed from step 3" in outputs[1]
    assert (tmp_path / "runs" / "m6pp2" / "checkpoints" / "step_00000002").is_dir()
    assert "pipeline: 2 ranks x 1 stage(s), 1f1b, 16 micro-batches" in outputs[3]
