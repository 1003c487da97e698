"""docs/moefy.md run as written: its Python blocks in order in one namespace (a tiny GPT-2 built
from its config: no download), and its commands (moetrain train of the hf_moefy example, export-hf,
a run that starts from the export)."""

from __future__ import annotations

import pytest

from tests.helpers.doc_commands import bash_commands, run_moetrain
from tests.helpers.paths import ROOT

DOC = ROOT / "docs" / "moefy.md"


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
def test_the_documented_commands_run(tmp_path):
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
    outputs = [run_moetrain(words, tmp_path, ("scripts/",)) for words in commands]
    assert "exported step 20 of runs/hf_moefy/checkpoints/step_00000020 to runs/hf_moefy/hf" in outputs[1][0]
    assert "runs/hf_moefy/hf is moefied: loaded as saved" in outputs[2][1]
    assert (tmp_path / "runs" / "hf_moefy_more" / "checkpoints" / "step_00000010").is_dir()
    loaded = moetrain.moefy.from_pretrained(
        transformers.AutoModelForCausalLM, tmp_path / "runs" / "hf_moefy" / "hf"
    )
    assert sum(type(m).__name__ == "MoELayer" for m in loaded.modules()) == 2
