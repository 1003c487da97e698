"""README.md's "Train from a config file" block: its commands, run in the order given (steps
shortened), each train (the second is not a resume of the first's finished run that trains
nothing); and a run resumed at or past its ``steps`` says so in one warning and exits 0."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from moetrain.checkpoint import list_checkpoints
from moetrain.cli import main
from moetrain.logs import detach_handlers
from tests.faults.launch import tiny_config, write_config
from tests.helpers.doc_commands import run_moetrain
from tests.helpers.paths import ROOT

NOTHING_TO_TRAIN = "nothing to train; raise steps or use another out_dir"


def readme_train_commands() -> list[list[str]]:
    """The commands of the first ```bash block under README.md's "## Train from a config file",
    split as a shell would (continued lines joined, comments dropped)."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## Train from a config file\n", 1)[1]
    block = section.split("\n## ", 1)[0].split("```bash\n", 1)[1].split("```", 1)[0]
    words = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    return [w for w in words if w]


def out_dir_of(words: list[str]) -> str:
    """The ``out_dir`` a command trains into: its last ``--set out_dir=...``, else the config's."""
    sets = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--set"]
    dirs = [value.split("=", 1)[1] for value in sets if value.startswith("out_dir=")]
    return dirs[-1] if dirs else "runs/tiny_lm"  # configs/tiny_lm.yaml's


def test_the_readme_train_block_trains_with_each_command_in_order(tmp_path):
    commands = readme_train_commands()
    assert [words[1] for words in commands] == ["train", "launch"], commands
    assert "--nproc-per-node" in commands[1] and "configs/tiny_lm.yaml" in commands[0] + commands[1]
    steps = [3, 2]  # the block's 300 and 200 (the config's), in the same order
    for words, last in zip(commands, steps, strict=True):
        out_dir = tmp_path / out_dir_of(words)
        before = [s for s, _ in list_checkpoints(out_dir / "checkpoints")]
        _, err = run_moetrain(words + ["--set", f"steps={last}"], tmp_path, ("configs/",), timeout=240)
        assert NOTHING_TO_TRAIN not in err, f"{shlex.join(words)}\n{err[-2000:]}"
        after = [s for s, _ in list_checkpoints(out_dir / "checkpoints")]
        assert after[-1] == last and last not in before, (shlex.join(words), before, after)
        records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r][-1] == last, records[-1]


def train(tmp_path: Path, out_dir: Path, **overrides) -> int:
    """``moetrain train`` in-process on a tiny config (tests/faults/launch.py)."""
    name = f"config-{len(list(tmp_path.glob('config-*')))}.json"
    config = write_config(tmp_path, tiny_config(out_dir, **overrides), name)
    try:
        return main(["train", "--config", str(config)])
    finally:
        detach_handlers()


def test_a_run_resumed_past_its_steps_warns_that_it_trains_nothing_and_exits_0(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=3) == 0
    assert NOTHING_TO_TRAIN not in capsys.readouterr().err
    assert train(tmp_path, out_dir, steps=2) == 0  # a finished run resubmitted must not fail
    warnings = [line for line in capsys.readouterr().err.splitlines() if NOTHING_TO_TRAIN in line]
    assert len(warnings) == 1 and "resumed at step 3, which is at or past steps = 2" in warnings[0], warnings
    assert [s for s, _ in list_checkpoints(out_dir / "checkpoints")][-1] == 3
