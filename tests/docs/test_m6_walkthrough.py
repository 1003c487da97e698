"""docs/m6.md's "Your own data" walk-through, run as written: its config and its `moetrain` commands
on a small generated set of JPEG images in a folder apart from the manifests, which list them by
absolute path. Only the documented /data/ folder is moved into a temporary directory (the runs go
to the working directory, as in the docs) and the training run is shortened with --set."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from m6_moe.synthetic import write_synthetic_dataset
from tests.helpers.doc_commands import moetrain_in_process
from tests.helpers.paths import ROOT

DOC = ROOT / "docs" / "m6.md"
SECTION = "## Your own data: train, evaluate, generate"
DATA = "/data/"
MOETRAIN = Path(sys.executable).parent / "moetrain"
SHORT_TRAINING = ["steps=4", "checkpoint_every=4", "data.micro_batch_size=4"]


def walkthrough() -> tuple[str, list[list[str]]]:
    """The section's YAML config and its commands (each split as a shell would)."""
    section = DOC.read_text(encoding="utf-8").split(SECTION, 1)[1].split("\n## ", 1)[0]
    config = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    return config, [words for words in commands if words]


def test_walkthrough_is_there():
    config, commands = walkthrough()
    assert "source: /data/captions/train.jsonl" in config
    assert [words[:2] for words in commands] == [["moetrain", "train"]] + [["moetrain", "eval"]] * 2 + [
        ["moetrain", "generate"]
    ] * 2


def write_captions(data: Path) -> None:
    """``data/images/0001.jpg ...`` and, apart from them, ``data/captions/{train,heldout}.jsonl``
    listing them by absolute path, two captions (English, Chinese) per image."""
    generated = write_synthetic_dataset(data / "generated", seed=7, num_train=6, num_heldout=3, size=32,
                                        progress=False)  # fmt: skip
    (data / "images").mkdir()
    (data / "captions").mkdir()
    names: dict[str, Path] = {}
    for split in ("train", "heldout"):
        lines = []
        for line in (generated / f"{split}.jsonl").read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record["image"] not in names:
                names[record["image"]] = data / "images" / f"{len(names) + 1:04d}.jpg"
                Image.open(generated / record["image"]).convert("RGB").save(
                    names[record["image"]], quality=95
                )
            lines.append(json.dumps({"image": str(names[record["image"]]), "text": record["text"]},
                                    ensure_ascii=False))  # fmt: skip
        (data / "captions" / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_walkthrough_trains_evaluates_and_generates(tmp_path, capsys, monkeypatch):
    """The training run by the installed ``moetrain`` command; the evaluations and generations,
    which only print, by the command line's ``main`` in this process."""
    assert MOETRAIN.is_file(), f"the moetrain command is not installed next to {sys.executable}"
    data = tmp_path / "data"
    write_captions(data)
    config, commands = walkthrough()
    moved = str(data) + "/"
    (tmp_path / "captions.yaml").write_text(config.replace(DATA, moved), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train, *printing = ([word.replace(DATA, moved) for word in words] for words in commands)
    argv = [str(MOETRAIN), *train[1:], *(item for setting in SHORT_TRAINING for item in ("--set", setting))]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{shlex.join(train)}\n{result.stderr[-3000:]}"
    outputs = [result.stdout]
    monkeypatch.chdir(tmp_path)
    for words in printing:
        capsys.readouterr()
        assert moetrain_in_process(words) == 0, shlex.join(words)
        outputs.append(capsys.readouterr().out)

    assert (tmp_path / "runs" / "captions" / "checkpoints" / "step_00000004").is_dir()
    heldout = data / "captions" / "heldout.jsonl"
    report = outputs[1].splitlines()
    assert report[0] == f"{heldout}: 3 images, 6 references"
    assert report[1].startswith("  exact match ") and report[3].startswith("  token accuracy ")
    assert report[2].startswith("  BLEU-4 ") and "tok:zh" in report[2]
    beam = json.loads(outputs[2])
    assert beam["strategy"] == "beam" and beam["num_beams"] == 4 and beam["step"] == 4
    assert beam["manifests"][0]["images"] == 3 and beam["max_new_tokens"] == 40
    assert len(outputs[3].splitlines()) == 1 and len(outputs[4].splitlines()) == 1
