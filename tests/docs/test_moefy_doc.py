"""docs/moefy.md run as written: its Python blocks in order in one namespace (a tiny GPT-2 built
from its config: no download), and its commands (moetrain train of the hf_moefy example, export-hf,
a run that starts from the export: the last two in this process)."""

from __future__ import annotations

import shlex

import pytest

from tests.helpers.doc_commands import bash_commands, moetrain_in_process, run_moetrain
from tests.helpers.paths import ROOT

DOC = ROOT / "docs" / "moefy.md"
LOCAL = ("scripts/",)  # the example's files


def test_the_documented_examples_run(capsys, tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")
    monkeypatch.chdir(tmp_path)  # save_pretrained("gpt2-moe") writes here
    blocks = [block.split("```", 1)[0] for block in DOC.read_text(encoding="utf-8").split("```python\n")[1:]]
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own docs
    assert "['transformer.h.0.mlp', 'transformer.h.1.mlp']" in capsys.readouterr().out
    assert (tmp_path / "gpt2-moe" / "model.safetensors").is_file()
    assert namespace["loaded"].config.moetrain_moefy["moefied"][0]["num_experts"] == 8


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_documented_commands_run(tmp_path, capsys, monkeypatch):
    """The first training run by the installed ``moetrain`` command; the export and the run that
    starts from it by the command line's ``main`` in this process."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (a test dependency) is not installed"
    )
    import moetrain

    commands = bash_commands(DOC)
    assert [words[:2] for words in commands] == [
        ["moetrain", "train"],
        ["moetrain", "export-hf"],
        ["moetrain", "train"],
    ]
    train, export, train_more = commands
    run_moetrain(train, tmp_path, LOCAL)
    monkeypatch.chdir(tmp_path)
    outputs = []
    for words in (export, train_more):
        capsys.readouterr()
        assert moetrain_in_process(words, LOCAL) == 0, shlex.join(words)
        outputs.append(capsys.readouterr())
    assert "exported step 20 of runs/hf_moefy/checkpoints/step_00000020 to runs/hf_moefy/hf" in outputs[0].out
    assert "runs/hf_moefy/hf is moefied: loaded as saved" in outputs[1].err
    assert (tmp_path / "runs" / "hf_moefy_more" / "checkpoints" / "step_00000010").is_dir()
    loaded = moetrain.moefy.from_pretrained(
        transformers.AutoModelForCausalLM, tmp_path / "runs" / "hf_moefy" / "hf"
    )
    assert sum(type(m).__name__ == "MoELayer" for m in loaded.modules()) == 2
