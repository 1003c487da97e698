"""Fault: rolling back past newer checkpoints (issue 27). A run resumed from a step S older than the
newest checkpoint (``--resume-from latest-valid`` past a damaged one, ``--resume-from N`` by hand)
sets the newer checkpoints aside (``step_X.rejected-<UTC time>``: kept, never loaded, out of
"latest" and of ``keep_last``) and saves its own steps S+1... normally: before, it died at the
first step that already had a directory ("already exists"), and a requeued job did so forever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.checkpoint import latest_checkpoint, list_checkpoints
from tests.faults.launch import finish, start_ranks, tiny_config, write_config
from tests.faults.test_run_directory import one_error, train


def damage(checkpoint: Path) -> None:
    data = next(checkpoint.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-10])  # truncated


def complete(out_dir: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(out_dir / "checkpoints")]


def set_aside(out_dir: Path) -> list[str]:
    """The names of the set-aside directories, without their time stamp."""
    return sorted(p.name.split(".rejected-")[0] for p in (out_dir / "checkpoints").glob("*.rejected-*"))


def logged_steps(out_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_latest_valid_past_a_damaged_newest_sets_it_aside_and_the_run_goes_on(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=3, checkpoint_every=1, keep_last=5) == 0
    damage(out_dir / "checkpoints" / "step_00000003")
    capsys.readouterr()
    assert (
        train(tmp_path, out_dir, "--resume-from", "latest-valid", steps=5, checkpoint_every=1, keep_last=5)
        == 0
    )
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "set aside" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("resumed from step 2: the newer checkpoints (steps 3) are set aside as ")
    assert complete(out_dir) == [1, 2, 3, 4, 5]  # step 3 saved again by this run
    assert set_aside(out_dir) == ["step_00000003"]
    assert logged_steps(out_dir) == [1, 2, 3, 4, 5]
    # a requeue of the same command resumes from the run's own newest checkpoint: no loop
    assert (
        train(tmp_path, out_dir, "--resume-from", "latest-valid", steps=6, checkpoint_every=1, keep_last=5)
        == 0
    )
    assert "set aside" not in capsys.readouterr().err
    assert complete(out_dir) == [2, 3, 4, 5, 6] and set_aside(out_dir) == ["step_00000003"]
    assert logged_steps(out_dir) == [1, 2, 3, 4, 5, 6]


def test_resume_from_an_older_step_sets_the_newer_good_ones_aside(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=4, checkpoint_every=1, keep_last=10) == 0
    assert train(tmp_path, out_dir, "--resume-from", "2", steps=4, checkpoint_every=1, keep_last=10) == 0
    assert "the newer checkpoints (steps 3, 4) are set aside" in capsys.readouterr().err
    assert complete(out_dir) == [1, 2, 3, 4] and set_aside(out_dir) == ["step_00000003", "step_00000004"]
    assert logged_steps(out_dir) == [1, 2, 3, 4]
    assert train(tmp_path, out_dir, steps=5, checkpoint_every=1, keep_last=10) == 0  # plain resume: latest
    assert complete(out_dir) == [1, 2, 3, 4, 5]


def test_keep_last_1_keeps_the_runs_own_newest_not_a_set_aside_one(tmp_path, capsys):
    """Before: the damaged newest kept its keep_last slot and stayed "latest" (every plain resume
    refused) while the run saved older steps beside it."""
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=6, checkpoint_every=1, keep_last=3) == 0
    damage(out_dir / "checkpoints" / "step_00000006")
    assert train(tmp_path, out_dir, "--resume-from", "4", steps=5, checkpoint_every=1, keep_last=1) == 0
    assert complete(out_dir) == [5]
    assert latest_checkpoint(out_dir / "checkpoints").name == "step_00000005"
    assert set_aside(out_dir) == ["step_00000005", "step_00000006"]
    capsys.readouterr()
    assert train(tmp_path, out_dir, steps=7, checkpoint_every=1, keep_last=1) == 0  # plain resume works
    assert complete(out_dir) == [7]


def test_a_missing_step_is_still_refused_and_nothing_is_set_aside(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=2, checkpoint_every=1, keep_last=5) == 0
    capsys.readouterr()
    assert train(tmp_path, out_dir, "--resume-from", "7", steps=9) == 2
    assert "resume_from = 7: no complete checkpoint of that step" in one_error(capsys)
    assert complete(out_dir) == [1, 2] and set_aside(out_dir) == []


@pytest.mark.timeout(120)
def test_two_ranks_roll_back_together_and_rank_0_alone_renames(tmp_path):
    out_dir = tmp_path / "run"
    settings = {"checkpoint_every": 1, "keep_last": 5}
    first = write_config(tmp_path, tiny_config(out_dir, steps=3, **settings), "first.json")
    assert [code for code, _ in finish(start_ranks([first, first]), timeout=90)] == [0, 0]
    damage(out_dir / "checkpoints" / "step_00000003")
    second = write_config(tmp_path, tiny_config(out_dir, steps=5, **settings), "second.json")
    results = finish(start_ranks([second, second], extra_args=["--resume-from", "latest-valid"]), timeout=90)
    assert [code for code, _ in results] == [0, 0], results
    assert complete(out_dir) == [1, 2, 3, 4, 5] and set_aside(out_dir) == ["step_00000003"]
    assert logged_steps(out_dir) == [1, 2, 3, 4, 5]
