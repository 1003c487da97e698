"""moetrain export-hf end to end: a tiny moefied GPT-2 (scripts/examples/hf_moefy) trained a few
steps by `moetrain train`, its checkpoint exported as a Hugging Face folder, loaded back by
moetrain.moefy.from_pretrained: the logits equal those of the checkpoint's model, built by the
example's own builder and loaded by load_checkpoint; the way back to training; the errors."""

from __future__ import annotations

import errno
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import moetrain
import moetrain.hf_export
from moetrain.checkpoint import load_checkpoint, save_checkpoint, set_aside_newer
from moetrain.cli import main
from moetrain.failures import EXIT_BAD_INPUT
from moetrain.hf_export import checkpoint_location, export_hf
from moetrain.moefy import RECORD_KEY
from tests.helpers.doc_commands import ROOT, moetrain_in_process, run_moetrain
from tests.unit.machinery.test_moefy import tiny_gpt2

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")

EXAMPLE = ROOT / "scripts" / "examples" / "hf_moefy"
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import hf_moefy_model

        yield hf_moefy_model
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of 6 steps with checkpoints at steps 3 and 6 (`moetrain train` in this process)."""
    out = tmp_path_factory.mktemp("hf_moefy") / "run"
    overrides = [f"out_dir={out}", "steps=6", "checkpoint_every=3", "optim.warmup_steps=1"]
    words = ["moetrain", "train", "--config", "scripts/examples/hf_moefy/config.yaml"]
    words += [arg for o in overrides for arg in ("--set", o)]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(out.parent)
        assert moetrain_in_process(words, ("scripts/",)) == 0
    return out


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=TOKENS).logits


def checkpoint_model(example, run, step):
    """The run's model at ``step`` as the example builds it (a tiny GPT-2, upcycled) and
    load_checkpoint fills it: independent of export-hf's own building."""
    model = example.build_model(example.HFMoefyConfig())
    assert load_checkpoint(run / "checkpoints", model=model, step=step)["step"] == step
    return model


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trained_checkpoint_exports_to_a_hugging_face_folder_that_loads_exactly(example, run, tmp_path):
    recorded = json.loads((run / "hf_config" / "config.json").read_text())[RECORD_KEY]
    assert recorded["moefied"][0]["modules"] == ["transformer.h.0.mlp", "transformer.h.1.mlp"]

    result = export_hf(run / "checkpoints", tmp_path / "hf")  # the latest step, the run's hf_config
    assert result["step"] == 6 and (tmp_path / "hf" / "model.safetensors").is_file()
    loaded = moetrain.moefy.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "hf")
    trained = logits(checkpoint_model(example, run, 6))
    assert torch.equal(logits(loaded), trained)
    assert not torch.allclose(logits(checkpoint_model(example, run, 3)), trained)  # training moved it
    fresh = example.build_model(example.HFMoefyConfig())
    assert not torch.allclose(logits(fresh), trained)

    # a given step, a config.json path and a concrete class
    step3 = export_hf(
        run / "checkpoints" / "step_00000003",
        tmp_path / "hf3",
        config=tmp_path / "hf" / "config.json",
        model_class="GPT2LMHeadModel",
    )
    assert step3["step"] == 3
    loaded3 = moetrain.moefy.from_pretrained(transformers.GPT2LMHeadModel, tmp_path / "hf3")
    assert torch.equal(logits(loaded3), logits(checkpoint_model(example, run, 3)))

    # back to moetrain train: the example's builder takes the exported folder as its hf_model
    again = example.build_model(example.HFMoefyConfig(hf_model=str(tmp_path / "hf")))
    assert torch.equal(logits(again), trained)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_errors_are_one_line(run, tmp_path):
    assert checkpoint_location(run) == (run / "checkpoints", run / "checkpoints")
    step3 = run / "checkpoints" / "step_00000003"
    assert checkpoint_location(step3) == (step3, run / "checkpoints")
    with pytest.raises(ValueError, match="no such checkpoint, checkpoints directory or run directory"):
        export_hf(tmp_path / "nothing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        export_hf(tmp_path / "empty", tmp_path / "out")

    dense = tmp_path / "dense"
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256).save_pretrained(dense)
    with pytest.raises(ValueError, match="config.json has no 'moetrain_moefy' entry") as caught:
        export_hf(run, tmp_path / "out", config=dense)
    assert "\n" not in str(caught.value)

    wider = tmp_path / "wider"
    config = json.loads((run / "hf_config" / "config.json").read_text())
    config[RECORD_KEY]["moefied"][0]["num_experts"] = 8
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="checkpoint") as caught:
        export_hf(run, tmp_path / "out", config=wider)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_checkpoint_saved_under_expert_parallelism_exports(example, tmp_path):
    """Two ranks, two experts each (ep_size 2): the checkpoint holds the experts by global index,
    so export-hf in one process writes all four, equal to the checkpoint loaded in one process."""
    out = tmp_path / "ep2"
    words = ["moetrain", "launch", "--nproc-per-node", "2", "-m", "moetrain.cli", "train"]
    words += ["--config", "scripts/examples/hf_moefy/config.yaml", "--set", "parallel.ep_size=2"]
    words += ["--set", f"out_dir={out}", "--set", "steps=4", "--set", "checkpoint_every=4"]
    run_moetrain(words, tmp_path, ("scripts/",))
    manifest = json.loads((out / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["ep_size"]) == (2, 2)
    result = export_hf(out, tmp_path / "hf")
    assert result["step"] == 4
    loaded = moetrain.moefy.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "hf")
    w1 = loaded.transformer.h[0].mlp[0].experts.w1_EDF
    assert w1.shape[0] == 4 and not torch.equal(w1[0], w1[3])  # each rank's experts trained apart
    assert torch.equal(logits(loaded), logits(checkpoint_model(example, out, 4)))


def _moefied_gpt2(seed: int):
    """A tiny moefied GPT-2 whose weights depend on ``seed``."""
    model = tiny_gpt2()
    moetrain.moefy(model, match="transformer.h.*.mlp", num_experts=4, top_k=2)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
    return model


def _same_weights(model, other) -> bool:
    mine, theirs = model.state_dict(), other.state_dict()
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.fixture
def rolled_back(tmp_path):
    """A run directory whose step 4 was set aside by a rollback to step 2 and saved again with other
    weights: ``(run, {name: model saved there})``."""
    run = tmp_path / "run"
    checkpoints_dir = run / "checkpoints"
    saved = {"step2": _moefied_gpt2(2), "old4": _moefied_gpt2(4), "new4": _moefied_gpt2(44)}
    saved["step2"].config.save_pretrained(run / "hf_config")
    save_checkpoint(checkpoints_dir, 2, model=saved["step2"])
    save_checkpoint(checkpoints_dir, 4, model=saved["old4"])
    (rejected,) = set_aside_newer(checkpoints_dir, 2)
    save_checkpoint(checkpoints_dir, 4, model=saved["new4"])
    return run, rejected, saved


def test_a_set_aside_checkpoint_exports_its_own_weights(rolled_back, tmp_path):
    run, rejected, saved = rolled_back
    old = export_hf(rejected, tmp_path / "old")
    assert _same_weights(old["model"], saved["old4"]) and not _same_weights(old["model"], saved["new4"])
    assert (old["step"], old["checkpoint"]) == (4, rejected)
    assert checkpoint_location(rejected) == (rejected, run / "checkpoints")
    new = export_hf(run / "checkpoints" / "step_00000004", tmp_path / "new")
    assert new["checkpoint"] == run / "checkpoints" / "step_00000004"
    assert _same_weights(new["model"], saved["new4"])
    latest = export_hf(run, tmp_path / "latest")
    assert latest["checkpoint"] == run / "checkpoints" / "step_00000004"
    with pytest.raises(ValueError, match="step must be None for a checkpoint directory") as caught:
        load_checkpoint(rejected, model=_moefied_gpt2(0), step=4)
    assert "\n" not in str(caught.value)


def test_a_copied_checkpoint_exports_like_the_original(rolled_back, tmp_path):
    from safetensors.torch import load_file

    run, _, saved = rolled_back
    best = tmp_path / "saved" / "best"
    shutil.copytree(run / "checkpoints" / "step_00000002", best)
    copied = export_hf(best, tmp_path / "copied", config=run / "hf_config")
    assert (copied["step"], copied["checkpoint"]) == (2, best)
    assert _same_weights(copied["model"], saved["step2"])
    export_hf(run / "checkpoints" / "step_00000002", tmp_path / "original")
    original, exported = (load_file(tmp_path / name / "model.safetensors") for name in ("original", "copied"))
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    loaded = moetrain.moefy.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "copied")
    assert _same_weights(loaded, saved["step2"])
    with pytest.raises(ValueError, match="no Hugging Face config beside these checkpoints"):
        export_hf(best, tmp_path / "no_config")  # no hf_config/ beside saved/
    (best / "__0_0.distcp").write_bytes(b"damaged")  # the copy's manifest is verified as usual
    with pytest.raises(moetrain.checkpoint.CheckpointError, match="__0_0.distcp"):
        export_hf(best, tmp_path / "damaged", config=run / "hf_config")


def test_an_out_dir_that_is_a_file_is_refused_before_loading(rolled_back, tmp_path, monkeypatch, capsys):
    """transformers' save_pretrained only logs about a file and returns: export-hf had said it exported."""
    run, _, _ = rolled_back
    existing = tmp_path / "existing_file"
    existing.write_text("not a folder")
    monkeypatch.setattr(moetrain.hf_export, "build_moefied", None)  # nothing is built or loaded first
    with pytest.raises(ValueError, match=r"^OUT_DIR \S+existing_file is a file: give a folder") as caught:
        export_hf(run, existing)
    assert "\n" not in str(caught.value) and existing.read_text() == "not a folder"
    assert main(["export-hf", str(run), str(existing)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"moetrain: error: {caught.value}\n"


@pytest.mark.parametrize(
    ("model_class", "message"),
    [
        (
            "BertModel",
            r"--model-class BertModel builds 'bert' models, \S+config.json has model_type 'gpt2'; ",
        ),
        (
            "AutoModelForSeq2SeqLM",
            r"--model-class AutoModelForSeq2SeqLM has no model for the model_type 'gpt2' ",
        ),
    ],
    ids=["concrete", "auto"],
)
def test_a_model_class_of_another_model_type_is_one_line_naming_both(
    rolled_back, tmp_path, model_class, message
):
    run, _, _ = rolled_back
    with pytest.raises(ValueError, match=message) as caught:
        export_hf(run, tmp_path / "hf", model_class=model_class)
    assert "\n" not in str(caught.value) and "give a class for 'gpt2' models" in str(caught.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        "safetensors",  # what a full disk gives while the weights are written
        None,  # save_pretrained returns having written nothing (it only logs some refusals)
    ],
    ids=["enospc", "safetensors", "nothing_written"],
)
def test_a_failed_save_is_one_line_naming_out_dir(rolled_back, tmp_path, monkeypatch, capsys, failure):
    from safetensors import SafetensorError

    if failure == "safetensors":
        failure = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def save_pretrained(self, folder, *args, **kwargs):
        Path(folder).mkdir(parents=True, exist_ok=True)
        if failure is not None:
            raise failure

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_pretrained)
    run, _, _ = rolled_back
    out = tmp_path / "hf"
    reason = "the export was not written" if failure is None else "No space left on device"
    with pytest.raises(OSError, match=rf"^OUT_DIR {re.escape(str(out))}: .*{reason}") as caught:
        export_hf(run, out)
    assert "\n" not in str(caught.value)
    assert main(["export-hf", str(run), str(out)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == f"moetrain: error: {caught.value}\n", err
