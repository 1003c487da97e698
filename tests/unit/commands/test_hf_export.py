"""moetrain export-hf end to end: a tiny moefied GPT-2 (scripts/examples/hf_moefy) trained a few
steps by `moetrain train`, its checkpoint exported as a Hugging Face folder, loaded back by
moetrain.moefy.from_pretrained: the logits equal those of the checkpoint's model, built by the
example's own builder and loaded by load_checkpoint; the way back to training; the errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import moetrain
from moetrain.checkpoint import load_checkpoint
from moetrain.hf_export import checkpoint_location, export_hf
from moetrain.moefy import RECORD_KEY
from tests.helpers.doc_commands import ROOT, run_moetrain

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
    """A run of 6 steps with checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("hf_moefy") / "run"
    overrides = [f"out_dir={out}", "steps=6", "checkpoint_every=3", "optim.warmup_steps=1"]
    words = ["moetrain", "train", "--config", "scripts/examples/hf_moefy/config.yaml"]
    run_moetrain(words + [arg for o in overrides for arg in ("--set", o)], out.parent, ("scripts/",))
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
    assert checkpoint_location(run) == (run / "checkpoints", None)
    assert checkpoint_location(run / "checkpoints" / "step_00000003") == (run / "checkpoints", 3)
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
