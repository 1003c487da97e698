"""`moetrain eval` / `moetrain generate` for M6: what is checked before the checkpoint is read,
what reaches stdout when a late step fails, the files and sink keys they write, and the work
``--limit`` costs. The commands run in this process (``cli``) on the checkpoint of
test_m6_eval.py's ``workspace``."""

# ruff: noqa: F811 - test_m6_eval's fixtures, imported below, are the tests' parameters

from __future__ import annotations

import errno
import json
import os
import shutil
import sys

import pytest
import torch
import yaml

from m6_moe import command_options, eval_command, evaluate
from m6_moe.data import ManifestDataset
from m6_moe.generate import sampling_probs
from tests.unit.engine.test_metrics_sinks import FakeWandb
from tests.unit.models.test_m6_eval import TOKENIZER, cli, workspace  # noqa: F401 - fixtures

LOADED = "into one process on"  # the log line of a checkpoint read (load_trained_model)


def eval_argv(workspace, *argv) -> list:
    checkpoint = workspace["root"] / "run" / "checkpoints"
    manifest = workspace["manifests"] / "relative.jsonl"
    return ["eval", "--config", workspace["config"], "--checkpoint", checkpoint, "--manifest", manifest,
            "--max-new-tokens", "3", "--no-progress", *argv]  # fmt: skip


def generate_argv(workspace, *argv) -> list:
    checkpoint = workspace["root"] / "run" / "checkpoints"
    image = workspace["images"] / "heldout" / "00001.png"
    return ["generate", "--config", workspace["config"], "--checkpoint", checkpoint, "--image", image,
            "--max-new-tokens", "4", *argv]  # fmt: skip


def assert_refused_early(code: int, out: str, err: str, *messages: str) -> None:
    """Exit code 2, one line on stderr holding every message, nothing printed, no checkpoint read."""
    assert code == 2 and out == "" and err.startswith("moetrain: error: "), err
    assert len(err.strip().splitlines()) == 1 and LOADED not in err, err
    assert all(message in err for message in messages), err


def config_with_sinks(workspace, tmp_path, sinks: list[str]):
    config = yaml.safe_load(workspace["config"].read_text())
    config.update(out_dir=str(tmp_path / "run"), metrics={"sinks": sinks})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return path


# ------------------------------------------------------------------------------ eval --to-sinks
def test_to_sinks_checks_the_sink_packages_before_the_checkpoint_is_read(
    workspace, cli, monkeypatch, tmp_path
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb: ImportError
    config = config_with_sinks(workspace, tmp_path, ["jsonl", "wandb"])
    argv = eval_argv(workspace, "--to-sinks")
    argv[argv.index("--config") + 1] = config
    assert_refused_early(*cli(*argv), "--to-sinks", "metrics.sinks", "wandb")


def test_to_sinks_prints_the_report_before_sending_it(workspace, cli, monkeypatch, tmp_path):
    wandb = FakeWandb()

    def unreachable(**kwargs):
        raise OSError("wandb.init: the tracker cannot be reached")

    wandb.init = unreachable
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    config = config_with_sinks(workspace, tmp_path, ["jsonl", "wandb"])
    argv = eval_argv(workspace, "--to-sinks", "--json")
    argv[argv.index("--config") + 1] = config
    code, out, err = cli(*argv)
    assert code == 2 and "the tracker cannot be reached" in err, err
    assert json.loads(out)["manifests"][0]["images"] == 5  # the scores were printed first


def test_sink_keys_are_distinct_per_manifest_and_all_is_the_aggregate():
    scores = {"exact_match": 0.5, "bleu4": 50.0, "token_accuracy": 0.5}
    report = {
        "manifests": [
            {"manifest": "data/en/test.jsonl", **scores, "exact_match": 0.9},
            {"manifest": "data/zh/test.jsonl", **scores, "exact_match": 0.1},
            {"manifest": "all.jsonl", **scores, "exact_match": 0.3},
        ],
        "all": scores,
    }
    out = eval_command.eval_scalars(report)
    assert len(out) == 12
    assert out["eval/en/test/exact_match"] == 0.9 and out["eval/zh/test/exact_match"] == 0.1
    assert out["eval/all-2/exact_match"] == 0.3 and out["eval/all/exact_match"] == 0.5
    names = eval_command.sink_names
    assert names(["runs/x/held.jsonl"]) == ["held"]  # one manifest: its file name, as before
    assert names(["a/b/t.jsonl", "c/b/t.jsonl", "t.jsonl"]) == ["a/b/t", "c/b/t", "t"]
    assert names(["/d/all.jsonl", "h.jsonl", "h.jsonl", "h.json", "h-2.jsonl"]) == [
        "d/all", "h", "h-3", "h-4", "h-2",
    ]  # fmt: skip


# ---------------------------------------------------------------------------- eval --predictions
def test_predictions_path_is_checked_before_the_checkpoint_is_read(workspace, cli, tmp_path):
    assert_refused_early(
        *cli(*eval_argv(workspace, "--predictions", tmp_path)), "--predictions", "a directory"
    )
    (tmp_path / "file").write_text("")
    below_a_file = tmp_path / "file" / "p.jsonl"
    assert_refused_early(
        *cli(*eval_argv(workspace, "--predictions", below_a_file)), "--predictions", "not a directory"
    )
    missing_parents = tmp_path / "new" / "dir" / "p.jsonl"  # created when written
    code, out, err = cli(*eval_argv(workspace, "--predictions", missing_parents))
    assert code == 0 and len(missing_parents.read_text().splitlines()) == 5, err


def test_scores_are_printed_when_the_predictions_cannot_be_written(workspace, cli, monkeypatch, tmp_path):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(command_options.os, "fsync", full_disk)  # the write of the predictions
    path = tmp_path / "p.jsonl"
    code, out, err = cli(*eval_argv(workspace, "--predictions", path, "--json"))
    assert (
        code == 2
        and err.splitlines()[-1] == f"moetrain: error: --predictions {path}: No space left on device"
    )
    assert json.loads(out)["manifests"][0]["images"] == 5
    assert not path.exists() and not list(tmp_path.glob(".p.jsonl.*"))  # nothing half-written


def test_written_files_get_the_umask_mode_and_are_synced_before_the_rename(monkeypatch, tmp_path):
    calls = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append("replace") or replace(a, b))
    previous = os.umask(0o027)
    try:  # the umask is not set to read it (a race: another thread's files would get umask 0)
        with monkeypatch.context() as patch:
            patch.setattr(os, "umask", lambda mask: pytest.fail(f"os.umask({mask:#o}) called"))
            command_options.write_atomically(tmp_path / "out.jsonl", "{}\n")
    finally:
        os.umask(previous)
    assert (tmp_path / "out.jsonl").read_text() == "{}\n"
    assert (tmp_path / "out.jsonl").stat().st_mode & 0o777 == 0o640  # 0o666 & ~umask, not 0o600
    assert calls == ["fsync", "replace"]
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


# ------------------------------------------------------------------------------------- generate
def test_a_tiny_temperature_samples_the_argmax():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5], [3.0, -1.0, 0.0, 2.999]])
    for temperature in (1e-40, 5e-324):
        probs = sampling_probs(logits, temperature=temperature)
        assert probs.tolist() == [[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]  # ties share the mass
        assert sampling_probs(logits, top_k=2, top_p=0.9, temperature=temperature)[1].tolist() == [1, 0, 0, 0]


def test_generate_sample_with_a_tiny_temperature_is_greedy(workspace, cli):
    code, greedy, err = cli(*generate_argv(workspace))
    assert code == 0, err
    code, sampled, err = cli(*generate_argv(workspace, "--strategy", "sample", "--temperature", "1e-40"))
    assert code == 0 and sampled == greedy, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--strategy", "sample", "--seed", str(2**64)], "--seed must be an integer in [-2**63, 2**64 - 1]"),
        (["--strategy", "sample", "--seed", str(-(2**63) - 1)], "--seed must be an integer"),
        (["--strategy", "beam", "--length-penalty", "nan"], "--length-penalty must be a finite number"),
        (["--strategy", "beam", "--length-penalty=-inf"], "--length-penalty must be a finite number"),
    ],
)
def test_generate_checks_seed_and_length_penalty_before_the_checkpoint_is_read(workspace, cli, argv, message):
    assert_refused_early(*cli(*generate_argv(workspace, *argv)), message)


def test_eval_checks_the_length_penalty_before_the_checkpoint_is_read(workspace, cli):
    argv = eval_argv(workspace, "--strategy", "beam", "--length-penalty", "inf")
    assert_refused_early(*cli(*argv), "--length-penalty must be a finite number")


def test_generate_takes_the_extreme_seeds(workspace, cli):
    for seed in (2**64 - 1, -(2**63)):
        code, out, err = cli(*generate_argv(workspace, "--strategy", "sample", "--seed", str(seed)))
        assert code == 0 and len(out.splitlines()) == 1, err


# ----------------------------------------------------------------------------------- eval --limit
@pytest.fixture
def long_manifest(workspace, tmp_path):
    """One real image with a reference on the first and on the last line; between them 30 records
    of other images (never loaded: the files do not exist) and 10 text-only records."""
    shutil.copy(workspace["images"] / "heldout" / "00001.png", tmp_path / "a.png")
    records = [{"image": "a.png", "text": "first reference"}]
    for i in range(30):
        records.append({"image": f"missing/{i}.png", "text": f"caption {i}"})
        if i % 3 == 0:
            records.append({"text": f"text only {i}"})
    records.append({"image": "a.png", "text": "late reference"})
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_limit_reads_each_image_record_once_and_no_text_only_record(workspace, long_manifest, monkeypatch):
    data = ManifestDataset(long_manifest, 16, 3)
    text_only = {i for i in range(len(data)) if data.read(i)[1] is None}
    reads = {}
    read = ManifestDataset.read

    def counted(self, index):
        reads[index] = reads.get(index, 0) + 1
        return read(self, index)

    monkeypatch.setattr(ManifestDataset, "read", counted)
    result = evaluate.caption_manifest(
        workspace["model"], TOKENIZER, data, max_new_tokens=2, limit=1, progress=False
    )
    assert result.references == [["first reference", "late reference"]]  # every reference of the image
    assert result.text_only_records == 10 and len(text_only) == 10
    assert not text_only & set(reads)  # counted from the index
    others = [i for i in range(len(data)) if i not in text_only and i not in (0, len(data) - 1)]
    assert len(others) == 30 and all(reads[i] == 1 for i in others)


def test_limited_grouping_is_the_first_groups_of_the_whole(long_manifest, monkeypatch):
    monkeypatch.setattr(evaluate, "_IMAGE_RECORDS_CHUNK", 4)  # several chunks of the index array
    data = ManifestDataset(long_manifest, 16, 3)
    whole = evaluate.images_with_references(data)
    assert len(whole) == 31 and whole[0] == [0, len(data) - 1]
    for limit in (1, 2, 7, 31, 40):
        assert evaluate.images_with_references(data, limit) == whole[:limit]
