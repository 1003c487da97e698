"""A run's ``out_dir/config.json`` is a training config: ``moetrain train --config`` and ``moetrain
plan --model`` read it back as the same run (it holds the ``--set`` overrides, which no other file
does, so it is the way to re-run or plan a run made with them)."""

from __future__ import annotations

import json

from moetrain.cli import main
from moetrain.logs import detach_handlers
from tests.faults.launch import tiny_config, write_config
from tests.faults.test_run_directory import train_file


def test_a_runs_config_json_trains_and_plans_as_the_same_run(tmp_path, capsys):
    first, again = tmp_path / "first", tmp_path / "again"
    config = write_config(tmp_path, tiny_config(first, steps=2))
    assert train_file(config, "--set", "optim.lr=0.002", "--set", "model.moe.top_k=1") == 0
    saved = json.loads((first / "config.json").read_text())
    assert saved["model"]["name"] == "moe_lm" and saved["model"]["moe"]["top_k"] == 1

    assert train_file(first / "config.json", "--set", f"out_dir={again}") == 0
    rerun = json.loads((again / "config.json").read_text())
    assert rerun == {**saved, "out_dir": str(again)}

    capsys.readouterr()
    try:
        code = main(["plan", "--model", str(first / "config.json"), "--cluster", "a100-80gb", "--nodes", "1"])
    finally:
        detach_handlers()
    assert code == 0, capsys.readouterr().err
