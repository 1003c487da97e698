"""docs/pipeline.md run as written: a pp2 run on two ranks, then its checkpoint resumed in one
process (pp 1), from a fresh working directory; the planner's figures its prose quotes are the two
documented ``moetrain plan`` commands' output (run in this process, as the resume)."""

from __future__ import annotations

import re

import pytest

from tests.helpers.doc_commands import ROOT, bash_commands, moetrain_in_process, run_moetrain

DOC = ROOT / "docs" / "pipeline.md"
LOCAL = ("configs/", "models/")  # the repository's files the commands name


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
def test_documented_commands_run(tmp_path, capsys, monkeypatch):
    """The two runs on two ranks by the installed ``moetrain launch``, the resume by the command
    line's ``main`` in this process (the two ``moetrain plan`` commands: the test below)."""
    launch_pp2, resume, launch_m6 = documented_commands()[:3]
    run_moetrain(launch_pp2, tmp_path, LOCAL)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert moetrain_in_process(resume, LOCAL) == 0
    resumed = capsys.readouterr()
    run_moetrain(launch_m6, tmp_path, LOCAL)
    run = tmp_path / "runs" / "pp2" / "checkpoints"
    assert (run / "step_00000003").is_dir() and (run / "step_00000005").is_dir()
    assert "resumed from step 3" in resumed.out + resumed.err
    assert (tmp_path / "runs" / "m6pp2" / "checkpoints" / "step_00000002").is_dir()


def _plan_output(words: list[str], capsys) -> str:
    """A documented ``moetrain plan`` command run in this process: what it prints."""
    capsys.readouterr()
    assert moetrain_in_process(words, LOCAL) == 0
    captured = capsys.readouterr()
    return captured.out + captured.err


def _number(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    assert match, pattern
    return match.group(1)


def test_the_quoted_plan_figures_are_the_commands_output(capsys):
    """GiB per GPU (both layouts), bubble, stage transfers and tokens/s of each layout, as the
    prose quotes them (whitespace and line breaks aside)."""
    staged, replicas = (_plan_output(words, capsys) for words in documented_commands()[3:5])
    assert "pipeline: 2 ranks x 1 stage(s), 1f1b, 16 micro-batches" in staged
    total = r"total / usable\s+([\d.]+) /"
    gib = _number(total, staged)
    assert _number(total, replicas) == gib
    bubble = _number(r"bubble \(p - 1\) / \(v m \+ p - 1\) = ([\d.]+)%", staged)
    transfers = _number(r"stage transfers ([\d.]+) ms", staged)
    staged_tokens, replica_tokens = (
        int(_number(r"([\d,]+) tokens/s", text).replace(",", "")) / 1e6 for text in (staged, replicas)
    )
    expected = [
        f"the same {gib} GiB per GPU both ways",
        f"a {bubble} % bubble with 16 micro-batches",
        f"{transfers} ms of stage transfers per step",
        f"{staged_tokens:.2f} M tokens/s with pp 2 x ep 4",
        f"against {replica_tokens:.2f} M tokens/s with ep 4",
    ]
    prose = " ".join(DOC.read_text(encoding="utf-8").split())
    assert [phrase for phrase in expected if phrase not in prose] == []
