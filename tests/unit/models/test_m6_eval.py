"""M6 evaluation on any manifest and the `moetrain eval` / `moetrain generate` commands.

The commands run in this process through ``moetrain.cli.main`` on a checkpoint saved here (the
documented walk-through runs the real executables: tests/docs/test_m6_walkthrough.py)."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from m6_moe.config import M6Config
from m6_moe.data import ManifestDataset
from m6_moe.evaluate import caption_manifest, caption_scores, evaluate_manifest, images_with_references
from m6_moe.generate import generate
from m6_moe.model import M6Model
from m6_moe.synthetic import write_synthetic_dataset
from m6_moe.tokenizer import ByteTokenizer
from m6_moe.trained_model import load_trained_model, resolve_checkpoint
from moetrain.checkpoint import save_checkpoint
from moetrain.cli import build_train_config, main

TOKENIZER = ByteTokenizer()
MODEL = {
    "name": "m6_moe", "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "max_text_len": 64,
    "image_size": 16, "patch_size": 8, "stem_channels": [8], "moe_every": 1,
    "moe": {"d_ff": 64, "num_experts": 4, "top_k": 2, "num_prototypes": 2, "eval_capacity_factor": None},
}  # fmt: skip


def model_config() -> M6Config:
    return M6Config(**{k: v for k, v in MODEL.items() if k != "name"})


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    """Images of the synthetic generator in one folder; manifests elsewhere: ``absolute.jsonl``
    (absolute image paths, plus a text-only record), ``relative.jsonl`` (the same records,
    relative paths); a config and a checkpoint of a randomly initialised model at step 3."""
    root = tmp_path_factory.mktemp("m6_eval")
    images = write_synthetic_dataset(
        root / "images", seed=5, num_train=1, num_heldout=5, size=16, progress=False
    )
    records = [json.loads(line) for line in (images / "heldout.jsonl").read_text().splitlines()]
    manifests = root / "manifests"
    manifests.mkdir()
    absolute = [{"image": str((images / r["image"]).resolve()), "text": r["text"]} for r in records]
    absolute.insert(3, {"text": "a text-only record"})
    (manifests / "absolute.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in absolute))
    relative = [{"image": f"../images/{r['image']}", "text": r["text"]} for r in records]
    (manifests / "relative.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in relative))
    config_path = root / "run.yaml"
    config = {"model": MODEL, "data": {"seq_len": 12}, "out_dir": str(root / "run"), "device": "cpu"}
    config_path.write_text(yaml.safe_dump(config, allow_unicode=True))
    torch.manual_seed(11)
    model = M6Model(model_config())
    save_checkpoint(root / "run" / "checkpoints", 3, model=model)
    return {
        "root": root,
        "images": images,
        "manifests": manifests,
        "config": config_path,
        "model": model.eval(),
    }


@pytest.fixture
def cli(capsys):
    """``run(*argv) -> (exit code, stdout, stderr)`` through ``moetrain.cli.main``; the log handlers
    the commands attach are removed afterwards."""
    loggers = [logging.getLogger(name) for name in ("moetrain", "m6_moe")]
    saved = [(list(lg.handlers), lg.level, lg.propagate) for lg in loggers]

    def run(*argv: str) -> tuple[int, str, str]:
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    for logger, (handlers, level, propagate) in zip(loggers, saved, strict=True):
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


def dataset(path: Path, **options) -> ManifestDataset:
    return ManifestDataset(path, 16, 3, **options)


# ------------------------------------------------------------------------------------- library
def test_records_are_grouped_by_image_relative_or_absolute(workspace):
    absolute = dataset(workspace["manifests"] / "absolute.jsonl")
    relative = dataset(workspace["manifests"] / "relative.jsonl")
    assert [len(g) for g in images_with_references(absolute)] == [2] * 5  # en + zh caption per image
    model = workspace["model"]
    results = [caption_manifest(model, TOKENIZER, d, max_new_tokens=6, batch_size=2, progress=False)
               for d in (absolute, relative)]  # fmt: skip
    assert results[0].images == results[1].images and results[0].predictions == results[1].predictions
    assert results[0].references == results[1].references and results[0].text_only_records == 1
    assert results[0].references[0] == [absolute.records[0].text, absolute.records[1].text]
    # the captions are what generate() gives for each image alone
    first = torch.stack([absolute.load_image(0)])
    assert results[0].predictions[0] == generate(model, TOKENIZER, images=first, max_new_tokens=6)[0]


def test_token_accuracy_equals_a_one_record_at_a_time_count(workspace):
    """Batched and padded teacher forcing counts what a plain loop over the records counts."""
    model = workspace["model"]
    data = dataset(workspace["manifests"] / "relative.jsonl")
    result = caption_manifest(model, TOKENIZER, data, max_new_tokens=2, batch_size=3, progress=False)
    correct = total = 0
    with torch.no_grad():
        for index, record in enumerate(data.records):
            tokens = TOKENIZER.encode(record.text)
            image = (data.load_image(index).float() / 127.5 - 1)[None]
            target = torch.tensor([[TOKENIZER.bos_id, *tokens]])
            predicted = model(prefix_ids=torch.empty(1, 0, dtype=torch.long), target_ids=target, images=image)
            correct += int((predicted.argmax(-1)[0] == torch.tensor([*tokens, TOKENIZER.eos_id])).sum())
            total += len(tokens) + 1
    assert (result.tokens_correct, result.tokens_total) == (correct, total)
    assert total > 0 and caption_scores([result])["token_accuracy"] == pytest.approx(correct / total)


def test_bad_image_files_stop_or_are_skipped(workspace, tmp_path):
    lines = (workspace["manifests"] / "absolute.jsonl").read_text().splitlines()
    lines[2] = json.dumps({"image": str(tmp_path / "missing.png"), "text": "gone"})
    manifest = tmp_path / "broken.jsonl"
    manifest.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=r"broken.jsonl:3: image .*missing.png does not exist"):
        evaluate_manifest(workspace["model"], TOKENIZER, dataset(manifest), max_new_tokens=2, progress=False)
    scores = evaluate_manifest(
        workspace["model"],
        TOKENIZER,
        dataset(manifest, skip_bad_records=True),
        max_new_tokens=2,
        progress=False,
    )
    assert scores["skipped_images"] == 1 and scores["images"] == 5  # the other record of image 2 stays


# -------------------------------------------------------------------------------------- loading
def test_checkpoint_argument_forms(workspace, tmp_path):
    checkpoints = workspace["root"] / "run" / "checkpoints"
    assert resolve_checkpoint(checkpoints) == (checkpoints, None)
    assert resolve_checkpoint(checkpoints / "step_00000003") == (checkpoints / "step_00000003", None)
    with pytest.raises(ValueError, match="looks like a run's out_dir: use .*checkpoints"):
        resolve_checkpoint(workspace["root"] / "run")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nothing")
    (tmp_path / "step_00000009").mkdir()
    with pytest.raises(ValueError, match="is incomplete \\(no manifest.json\\)"):
        resolve_checkpoint(tmp_path / "step_00000009")
    config = build_train_config(str(workspace["config"]), [])
    shutil.copytree(checkpoints / "step_00000003", tmp_path / "best")  # a copy under another name
    for where in (checkpoints, tmp_path / "best"):
        model, loaded = load_trained_model(config, where)
        assert loaded["step"] == 3 and not model.training
        for name, value in workspace["model"].state_dict().items():
            assert torch.equal(model.state_dict()[name], value), name


def _save_with_two_expert_parallel_ranks(rank: int, world_size: int, directory: str) -> None:
    from moetrain.config import ParallelConfig
    from moetrain.parallel import ParallelContext
    from moetrain.parallelize import parallelize

    parallel = ParallelContext(ParallelConfig(ep_size=world_size, local_world_size=world_size))
    torch.manual_seed(0)
    model = M6Model(model_config())
    parallelize(model, parallel)  # this rank's 2 of the 4 experts of each layer
    save_checkpoint(directory, 5, model=model, parallel=parallel)


@pytest.mark.slow
def test_a_checkpoint_of_two_expert_parallel_ranks_loads_into_one_process(workspace, tmp_path):
    """Experts are seeded by their global index, so the 2-rank model is the 1-process model with
    the same seed: after loading, every weight (every expert of every layer) matches it."""
    from tests.helpers.dist_utils import run_distributed

    run_distributed(_save_with_two_expert_parallel_ranks, 2, str(tmp_path / "checkpoints"))
    config = build_train_config(str(workspace["config"]), [])
    model, loaded = load_trained_model(config, tmp_path / "checkpoints" / "step_00000005")
    assert (loaded["saved_world_size"], loaded["saved_ep_size"]) == (2, 2)
    torch.manual_seed(0)
    reference = M6Model(model_config())
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


# ------------------------------------------------------------------------------------- commands
def test_eval_command_text_and_json(workspace, cli):
    manifests = workspace["manifests"]
    base = [
        "eval",
        "--config",
        workspace["config"],
        "--checkpoint",
        workspace["root"] / "run" / "checkpoints",
    ]
    code, out, err = cli(*base, "--manifest", manifests / "relative.jsonl", "--max-new-tokens", "6")
    assert code == 0, err
    assert out.splitlines()[0] == f"{manifests / 'relative.jsonl'}: 5 images, 10 references"
    assert "  exact match " in out and "  BLEU-4 " in out and "tok:zh" in out and "  token accuracy " in out
    assert "eval relative.jsonl [" in err and "greedy decoding, at most 6 new tokens, key/value cache" in err

    predictions = workspace["root"] / "predictions.jsonl"
    both = [manifests / "relative.jsonl", manifests / "absolute.jsonl"]
    code, out, err = cli(*base, "--manifest", *both, "--max-new-tokens", "6", "--json", "--no-progress",
                         "--predictions", predictions)  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["step"] == 3 and [m["images"] for m in report["manifests"]] == [5, 5]
    assert report["all"]["images"] == 10 and report["manifests"][1]["text_only_records"] == 1
    expected = evaluate_manifest(workspace["model"], TOKENIZER, dataset(manifests / "relative.jsonl"),
                                 max_new_tokens=6, progress=False)  # fmt: skip
    assert report["manifests"][0] == {"manifest": str(manifests / "relative.jsonl"), **expected}
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(lines) == 10 and set(lines[0]) == {"manifest", "image", "prediction", "references"}
    assert "[" not in err  # --no-progress


def test_eval_command_takes_a_glob_matching_several_manifests(workspace, cli):
    """``--manifest 'parts/part-*.jsonl'`` (two matches) is one dataset: the report and the
    predictions name the pattern, the progress bar the files, and the scores are those of the
    same records in one manifest."""
    lines = (workspace["manifests"] / "relative.jsonl").read_text().splitlines()
    parts = workspace["root"] / "parts"  # beside manifests/: the relative image paths still hold
    parts.mkdir(exist_ok=True)
    (parts / "part-0.jsonl").write_text("\n".join(lines[:4]) + "\n")
    (parts / "part-1.jsonl").write_text("\n".join(lines[4:]) + "\n")
    pattern = str(parts / "part-*.jsonl")
    checkpoint = workspace["root"] / "run" / "checkpoints"
    base = ["eval", "--config", workspace["config"], "--checkpoint", checkpoint]
    predictions = workspace["root"] / "glob_predictions.jsonl"
    code, out, err = cli(*base, "--manifest", pattern, "--max-new-tokens", "6", "--batch-size", "2",
                         "--predictions", predictions)  # fmt: skip
    assert code == 0, err
    assert out.splitlines()[0] == f"{pattern}: 5 images, 10 references"
    assert "eval part-0.jsonl, part-1.jsonl [" in err
    assert {json.loads(line)["manifest"] for line in predictions.read_text().splitlines()} == {pattern}
    code, out, err = cli(*base, "--manifest", pattern, "--max-new-tokens", "6", "--json", "--no-progress")
    assert code == 0, err
    one_file = dataset(workspace["manifests"] / "relative.jsonl")
    expected = evaluate_manifest(workspace["model"], TOKENIZER, one_file, max_new_tokens=6, progress=False)
    assert json.loads(out)["manifests"] == [{"manifest": pattern, **expected}]
    assert len(dataset(pattern).manifests) == 2 and dataset(pattern).source == pattern


def test_eval_command_beam_and_bad_input(workspace, cli):
    base = [
        "eval",
        "--config",
        workspace["config"],
        "--checkpoint",
        workspace["root"] / "run" / "checkpoints",
    ]
    manifest = workspace["manifests"] / "absolute.jsonl"
    code, out, err = cli(*base, "--manifest", manifest, "--strategy", "beam", "--num-beams", "2",
                         "--max-new-tokens", "4", "--limit", "2", "--json", "--no-progress")  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["num_beams"] == 2 and report["manifests"][0]["images"] == 2
    for argv, message in [
        (["--manifest", manifest, "--num-beams", "3"], "only --strategy beam takes --num-beams"),
        (["--manifest", workspace["root"] / "none.jsonl"], "none.jsonl cannot be read"),
        (["--manifest", manifest, "--max-new-tokens", "65"], "max_new_tokens = 65 does not fit"),
    ]:
        code, out, err = cli(*base, *argv)
        assert code == 2 and out == "" and err.startswith("moetrain: error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1
    code, out, err = cli("eval", "--config", workspace["config"], "--checkpoint", workspace["root"] / "run",
                         "--manifest", manifest)  # fmt: skip
    assert code == 2 and "looks like a run's out_dir" in err


def test_generate_command(workspace, cli):
    base = [
        "generate",
        "--config",
        workspace["config"],
        "--checkpoint",
        workspace["root"] / "run" / "checkpoints",
    ]
    image = workspace["images"] / "heldout" / "00001.png"
    code, out, err = cli(
        *base, "--image", image, "--image", image, "--max-new-tokens", "5", "--log-level", "WARNING"
    )
    assert code == 0 and err == "", err
    pixels = torch.stack([dataset(workspace["manifests"] / "absolute.jsonl").load_image(2)])
    expected = generate(workspace["model"], TOKENIZER, images=pixels, max_new_tokens=5)[0]
    assert out.splitlines() == [expected.replace("\n", "\\n").replace("\r", "\\r")] * 2

    sampled = [
        json.loads(
            cli(
                *base,
                "--image",
                image,
                "--prefix",
                "a <extra_id_0>",
                "--strategy",
                "sample",
                "--top-p",
                "0.9",
                "--temperature",
                "1.2",
                "--seed",
                seed,
                "--json",
            )[1]
        )  # fmt: skip
        for seed in ("1", "1", "2")
    ]
    assert sampled[0] == sampled[1]
    assert sampled[0]["max_new_tokens"] == 12  # the config's data.seq_len
    assert sampled[0]["outputs"][0]["prefix"] == "a <extra_id_0>"
    code, out, err = cli(*base, "--prefix", "red", "--strategy", "beam", "--num-beams", "2", "--no-cache",
                         "--max-new-tokens", "3")  # fmt: skip
    assert code == 0 and len(out.splitlines()) == 1

    not_an_image = workspace["root"] / "run.yaml"
    for argv, message in [
        ([], "give --image, --prefix or both"),
        (["--prefix", "a", "--top-k", "3"], "only --strategy sample takes --top-k"),
        (["--prefix", "x" * 64], "a prefix of 64 tokens leaves no room for new tokens"),
        (["--prefix", b"caf\xe9".decode("utf-8", "surrogateescape")], "is not valid Unicode text"),
        (["--prefix", "a <extra_id_99>"], "<extra_id_99> is not a sentinel"),
        (["--image", not_an_image], "run.yaml cannot be read"),
        (["--prefix", "a", "--strategy", "sample", "--top-p", "0"], "top_p must be a number in (0, 1]"),
    ]:
        code, out, err = cli(*base, *argv)
        assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, err


def test_eval_scores_go_to_the_runs_trackers_with_to_sinks(workspace, cli, monkeypatch, tmp_path):
    """``--to-sinks``: the scores reach the config's trackers (a fake ``wandb`` here) at the
    checkpoint's step and as summary; metrics.jsonl, the training run's record, is not touched."""
    from tests.unit.engine.test_metrics_sinks import FakeWandb

    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    config = yaml.safe_load(workspace["config"].read_text())
    config.update(out_dir=str(tmp_path / "run"), metrics={"sinks": ["jsonl", "wandb"], "project": "m6-tiny"})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    relative = workspace["manifests"] / "relative.jsonl"
    checkpoint = workspace["root"] / "run" / "checkpoints"
    code, out, err = cli("eval", "--config", path, "--checkpoint", checkpoint, "--manifest", relative,
                         "--max-new-tokens", "6", "--json", "--no-progress", "--to-sinks")  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    scores = report["manifests"][0]
    expected = {f"eval/relative/{key}": scores[key] for key in ("exact_match", "bleu4", "token_accuracy")}
    (init,) = [call for call in wandb.calls if call[0] == "init"]
    assert init[1]["project"] == "m6-tiny"
    assert ("log", 3, expected) in wandb.calls and wandb.run.summary == expected
    assert wandb.calls[-1] == ("finish",)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
