"""Documented commands and examples of README.md and docs/ that no page test ran, run as written:
each block is read from its page by its key (tests/helpers/doc_commands.py), Python blocks run
in-process with only the names the page leaves to the reader defined, commands run from a fresh
working directory with repository files addressed by absolute path. Only sizes and steps are
shrunk, through flags or ``--set`` appended after the documented ones (the last value wins), and
``/data/`` (a reader's data) is moved into the test's directory."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.faults.launch import tiny_config, write_config
from tests.helpers.dist_utils import run_distributed
from tests.helpers.doc_commands import doc_block, moetrain_in_process, run_moetrain, shell_commands
from tests.helpers.paths import ROOT

DATA = "/data/"


def run_block(page: str, key: str, namespace: dict | None = None) -> dict:
    """Executes the Python block ``key`` of ``page`` in ``namespace`` (the names the page leaves to
    the reader); returns the namespace."""
    block = doc_block(page, key)
    namespace = {} if namespace is None else namespace
    exec(compile(block.text, block.where, "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


def run_python(argv: list[str], cwd: Path, timeout: float) -> str:
    """``python ARGV`` with the venv's interpreter (one thread); asserts it exits 0; its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, (
        f"python {shlex.join(argv)}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    )
    return result.stdout


# ---- README.md -------------------------------------------------------------------------------------


def test_readme_swap_your_ffn_example(capsys):
    namespace = run_block("README.md", "class Block(nn.Module):")
    printed = capsys.readouterr().out
    stats, x = namespace["stats"], namespace["x"]
    assert namespace["model"](x).shape == x.shape  # same shape in, same shape out
    assert float(stats.aux_loss) > 0 and 0.0 <= stats.dropped_fraction <= 1.0
    share = stats.layers[0].token_share
    assert len(share) == 8 and abs(float(share.sum()) - 1.0) < 1e-6
    assert printed == f"{stats.aux_loss!s} {stats.dropped_fraction!s} {share!s}\n"


def test_readme_train_moe_lm_script_runs(tmp_path):
    command = "python scripts/examples/train_moe_lm.py"
    assert f"`{command}` trains the smaller byte-level MoE language model" in " ".join(
        (ROOT / "README.md").read_text(encoding="utf-8").split()
    )
    words = shlex.split(command)
    shorter = ["--steps", "2", "--batch", "2", "--seq", "16", "--threads", "1"]  # one thread, as every test
    out = run_python([str(ROOT / words[1]), *shorter], tmp_path, timeout=120)
    assert "per-expert token share (last step):" in out and "loss (nats/byte)" in out


# ---- docs/m6.md ------------------------------------------------------------------------------------


def test_m6_1t_preset_counts_on_meta(capsys):
    namespace = run_block("docs/m6.md", 'config = M6Config.preset("1T")')
    total, active = (int(word) for word in capsys.readouterr().out.split())
    assert next(namespace["model"].parameters()).is_meta
    row = next(
        line
        for line in (ROOT / "docs" / "m6.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `1T`")
    )
    assert f"| {total / 1e9:.1f}B (" in row and f"| {active / 1e9:.2f}B |" in row, (total, active, row)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_m6_pretrain_then_evaluate_and_generate(tmp_path, capsys, monkeypatch):
    """The tiny preset trained as documented (2 steps), then the page's evaluation and generation
    snippets on that run's model and embedded data."""
    from m6_moe import ByteTokenizer
    from m6_moe.trained_model import load_trained_model
    from moetrain.config.files import build_train_config

    (words,) = shell_commands(doc_block("docs/m6.md", "moetrain train --config models/m6_moe/tiny.yaml"))
    shorter = ["steps=2", "checkpoint_every=2"]
    run_moetrain(
        words + [item for s in shorter for item in ("--set", s)], tmp_path, ("models/",), timeout=240
    )
    run = tmp_path / "runs" / "m6_tiny"
    assert (run / "checkpoints" / "step_00000002").is_dir() and (run / "data" / "heldout.jsonl").is_file()

    monkeypatch.chdir(tmp_path)  # the snippet names runs/m6_tiny/data
    config = build_train_config(str(ROOT / words[words.index("--config") + 1]), shorter)
    model, _ = load_trained_model(config, run / "checkpoints", device="cpu")
    run_block(
        "docs/m6.md",
        'print(evaluate_captioning(model, ByteTokenizer(), "runs/m6_tiny/data"))',
        {"model": model},
    )
    printed = capsys.readouterr().out
    assert "'images': 200" in printed and "'baseline_accuracy': " in printed and "'accuracy': " in printed

    pixels = torch.randint(
        0, 256, (2, 3, config.model.image_size, config.model.image_size), dtype=torch.uint8
    )
    namespace = {
        "model": model,
        "tokenizer": ByteTokenizer(),
        "pixels_uint8_BCHW": pixels,
        "pixels": pixels[:1],
    }
    run_block("docs/m6.md", "generate(model, tokenizer, images=pixels_uint8_BCHW)", namespace)


def _manifest_lines(manifest: Path) -> list[dict]:
    """The records of a synthetic manifest with their image paths made absolute."""
    records = [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines()]
    return [{**record, "image": str(manifest.parent / record["image"])} for record in records]


def _write_manifest(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def test_m6_manifest_check_and_index_command_with_a_glob_and_prune(tmp_path):
    """``ManifestDataset(...).verify_images()`` and ``python -m m6_moe.index_command`` over a manifest
    and a shell glob of shards, run by bash as written (``/data/`` in the test's directory); then
    ``--prune`` after a manifest changed removes its older index."""
    from m6_moe.synthetic import write_synthetic_dataset

    data = tmp_path / "data"
    m6 = write_synthetic_dataset(data / "m6", seed=0, num_train=6, num_heldout=2, size=16, progress=False)
    records = _manifest_lines(m6 / "train.jsonl")
    _write_manifest(m6 / "laion-zh.jsonl", records[:4])
    _write_manifest(m6 / "shards" / "part-00000.jsonl", records[4:8])
    _write_manifest(m6 / "shards" / "part-00001.jsonl", records[8:])

    namespace = {}
    block = doc_block("docs/m6.md", 'dataset = ManifestDataset("/data/m6/train.jsonl", image_size=224)')
    exec(compile(block.text.replace(DATA, f"{data}/"), block.where, "exec"), namespace)  # noqa: S102
    assert len(namespace["dataset"]) == 12 and namespace["dataset"].verify_images() == 0

    block = doc_block(
        "docs/m6.md", "python -m m6_moe.index_command /data/m6/laion-zh.jsonl /data/m6/shards/part-*.jsonl"
    )
    line = block.text.strip().replace(DATA, f"{data}/")  # bash expands the glob
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }

    def index_command(extra: str = "") -> list[str]:
        argv = ["bash", "-c", line + extra]
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{line}{extra}\n{result.stderr[-2000:]}"
        return result.stdout.splitlines()

    printed = index_command()
    manifests = [
        m6 / "laion-zh.jsonl",
        m6 / "shards" / "part-00000.jsonl",
        m6 / "shards" / "part-00001.jsonl",
    ]
    assert [p.split(": ")[0] for p in printed] == [str(m) for m in manifests], printed
    assert [p.split(": ")[1].split(" records")[0] for p in printed] == ["4", "4", "4"], printed
    index_dir = m6 / ".laion-zh.jsonl.index"
    first = sorted(index_dir.iterdir())
    _write_manifest(m6 / "laion-zh.jsonl", records[:5])  # a new version of one manifest
    printed = index_command(" --prune")
    assert f"{manifests[0]}: removed 1 older index(es)" in printed, printed
    assert f"{manifests[1]}: removed 0 older index(es)" in printed, printed
    (kept,) = index_dir.iterdir()
    assert kept not in first


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_m6_demo_with_another_seed(tmp_path):
    """``python scripts/demo.py --seed N`` (m6.md, "The demo's accuracy over seeds"), 2 steps and
    4 held-out images, run from another directory with a relative ``--out-dir`` (as routing.md's
    commands give it): the run lands there, and the evaluation finds it."""
    command = "python scripts/demo.py --seed N"
    assert f"`{command}`" in (ROOT / "docs" / "m6.md").read_text(encoding="utf-8")
    words = shlex.split(command.replace(" N", " 1"))
    shorter = ["--steps", "2", "--eval-limit", "4", "--out-dir", "runs/demo_seed"]
    out = run_python([str(ROOT / words[1]), *words[2:], *shorter], tmp_path, timeout=200)
    assert "trained 2 steps (seed 1) on 2 ranks (ep_size 2)" in out, out[-2000:]
    assert "caption accuracy (exact match, held-out)" in out
    assert (tmp_path / "runs" / "demo_seed" / "checkpoints").is_dir()
    assert not (ROOT / "runs" / "demo_seed").exists()


# ---- docs/planner.md -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_planner_python_api_example(capsys):
    namespace = run_block("docs/planner.md", 'model, _ = resolve_model("m6-1T")')
    table = capsys.readouterr().out
    assert "ep_size 480" in table and "micro-batch 4 x 512 tokens" in table and "grad_accum 8" in table
    assert "GPU memory per GPU" in table and "time per step" in table
    result = namespace["result"]
    assert result.best is not None and result.best.fits and result.winners[0].status == "best"
    assert result.rejected and all(c.reason for c in result.rejected)  # why not the others


@pytest.mark.timeout(300)
def test_planner_calibrate_on_a_measured_run(tmp_path, capsys, monkeypatch):
    """The two commands of "Calibrating on a measured run": the run shortened to 3 steps, the plan
    printed without and with the optional ``[--json]``."""
    block = doc_block(
        "docs/planner.md",
        "moetrain train --config configs/tiny_lm.yaml --set steps=20 --set out_dir=runs/calib",
    )
    train, plan = shell_commands(block)
    assert plan[-1] == "[--json]" and plan[:3] == ["moetrain", "plan", "--calibrate"]
    run_moetrain(train + ["--set", "steps=3", "--set", "log_every=1"], tmp_path, ("configs/",), timeout=240)
    monkeypatch.chdir(tmp_path)  # the plan names runs/calib
    assert moetrain_in_process(plan[:-1]) == 0
    assert "constants that make them agree:" in capsys.readouterr().out
    assert moetrain_in_process([*plan[:-1], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run_dir"] == "runs/calib" and report["world_size"] == 1 and report["records"] >= 1
    assert report["measured"]["step_s"] > 0 and report["predicted"]["step_s"] > 0


# ---- docs/checkpoint.md ----------------------------------------------------------------------------

CHECKPOINT_KEY = "ctx = ParallelContext(ep_size=4)"


def _checkpoint_example_rank(rank: int, world: int, directory: str, total_steps: int, fill: float) -> dict:
    """docs/checkpoint.md's example on this rank in ``directory``, with the names it leaves to the
    reader: ``MyMoEModel`` (its every weight a pattern times ``fill``), ``total_steps`` and
    ``global_batch``. Returns where it started and this rank's weights after the loop."""
    from moetrain import MoELayer

    class MyMoEModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.ffn = MoELayer(d_model=16, d_ff=32, num_experts=8, top_k=2)
            with torch.no_grad():
                for parameter in self.parameters():
                    parameter.copy_(torch.arange(parameter.numel()).view_as(parameter) % 97 * fill)

        def forward(self, x):
            return self.ffn(self.inp(x))

    os.chdir(directory)  # the example's runs/exp1
    namespace = {"MyMoEModel": MyMoEModel, "total_steps": total_steps, "global_batch": 32}
    block = doc_block("docs/checkpoint.md", CHECKPOINT_KEY)
    exec(compile(block.text, block.where, "exec"), namespace)  # noqa: S102 - our own docs
    weights = {name: p.detach().clone() for name, p in namespace["model"].named_parameters()}
    return {"start": namespace["start"], "samples_seen": namespace.get("data_position"), "weights": weights}


def test_checkpoint_example_saves_then_resumes_on_four_ranks(tmp_path):
    first = run_distributed(_checkpoint_example_rank, 4, str(tmp_path), 1000, 1.0, timeout=120)
    assert [r["start"] for r in first] == [0] * 4
    second = run_distributed(_checkpoint_example_rank, 4, str(tmp_path), 2000, 2.0, timeout=120)
    assert [(r["start"], r["samples_seen"]) for r in second] == [(1000, 1000 * 32)] * 4
    for saved, loaded in zip(first, second, strict=True):
        assert saved["weights"].keys() == loaded["weights"].keys()
        for name, weight in saved["weights"].items():
            assert torch.equal(loaded["weights"][name], weight), name  # the step-1000 weights, not fill 2
    assert sorted(p.name for p in (tmp_path / "runs" / "exp1").iterdir()) == [
        "step_00001000",
        "step_00002000",
    ]


# ---- docs/training.md ------------------------------------------------------------------------------


def test_training_resume_choices(tmp_path, capsys, monkeypatch):
    """``--resume-from latest-valid`` and ``--resume-from STEP`` on a tiny ``run.yaml`` that trained
    4 steps (checkpoints at 2 and 4); the block's step 2000 becomes the shortened run's step 2."""
    latest, by_step = shell_commands(
        doc_block("docs/training.md", "moetrain train --config run.yaml --resume-from latest-valid")
    )
    assert (
        by_step[:-1] == ["moetrain", "train", "--config", "run.yaml", "--resume-from"]
        and by_step[-1] == "2000"
    )
    monkeypatch.chdir(tmp_path)
    write_config(
        tmp_path, tiny_config(Path("runs/run"), steps=4, checkpoint_every=2, keep_last=5), "run.yaml"
    )
    assert moetrain_in_process(["moetrain", "train", "--config", "run.yaml"]) == 0
    capsys.readouterr()
    assert moetrain_in_process([*latest, "--set", "steps=5"]) == 0
    assert "resumed from step 4" in capsys.readouterr().err
    assert moetrain_in_process([*by_step[:-1], "2", "--set", "steps=3"]) == 0
    assert "resumed from step 2" in capsys.readouterr().err
    log = (tmp_path / "runs" / "run" / "logs" / "rank_0.log").read_text(encoding="utf-8")
    assert re.search(r"resumed from step 4\b", log) and re.search(r"resumed from step 2\b", log)
