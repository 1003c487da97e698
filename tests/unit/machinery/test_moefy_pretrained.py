"""moefy and Hugging Face's save_pretrained / from_pretrained: the record in config.json, the exact
round trip through moetrain.moefy.from_pretrained (logits, greedy generation, weights, dtypes), what
plain transformers loading does with a moefied folder, and the one-line errors. Tiny GPT-2 and Llama
built from configs (no download)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

import moetrain
from moetrain.moefy import RECORD_KEY, from_pretrained
from tests.unit.machinery.test_moefy import TOKENS, logits, tiny_gpt2, tiny_llama

transformers = pytest.importorskip("transformers", reason="transformers (a test dependency) is not installed")

MATCH = {tiny_gpt2: "transformer.h.*.mlp", tiny_llama: "model.layers.*.mlp"}
CLASS = {tiny_gpt2: "GPT2LMHeadModel", tiny_llama: "LlamaForCausalLM"}


def trained_moe(build, **options):
    """A moefied model whose experts differ from each other and from the dense FFN (one AdamW
    step), so a dense or wrongly loaded model cannot give its logits."""
    model = build()
    moetrain.moefy(model, match=MATCH[build], num_experts=4, top_k=2, **options)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    optimizer.step()
    return model.eval()


def greedy(model) -> torch.Tensor:
    prompt = TOKENS[:, :4]
    return model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False
    )


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_save_pretrained_then_from_pretrained_gives_the_same_moe_model(build, tmp_path):
    model = trained_moe(build)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())[RECORD_KEY]
    assert saved["format"] == 1 and len(saved["moefied"]) == 1
    call = saved["moefied"][0]
    assert call["modules"] == [MATCH[build].replace("*", str(i)) for i in range(2)]
    assert (call["num_experts"], call["top_k"]) == (4, 2)
    assert call["options"]["normalize_gates"] is True and call["options"]["capacity_factor"] is None

    for model_class in (transformers.AutoModelForCausalLM, getattr(transformers, CLASS[build])):
        loaded = moetrain.moefy.from_pretrained(model_class, tmp_path)
        assert type(loaded) is type(model) and not loaded.training
        assert torch.equal(logits(loaded), logits(model))
        assert torch.equal(greedy(loaded), greedy(model))
        want = model.state_dict()
        assert list(loaded.state_dict()) == list(want)
        for name, tensor in loaded.state_dict().items():
            assert torch.equal(tensor, want[name]), name
        assert loaded.config.to_dict()[RECORD_KEY] == saved  # saving it again records the same calls


def test_two_moefy_calls_are_recorded_and_replayed_in_order(tmp_path):
    model = tiny_gpt2()
    moetrain.moefy(model, match="transformer.h.0.mlp", num_experts=4, top_k=2)
    moetrain.moefy(model, match="transformer.h.1.mlp", num_experts=2, top_k=1, aux_loss_coef=0.5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    calls = json.loads((tmp_path / "config.json").read_text())[RECORD_KEY]["moefied"]
    assert [(c["modules"], c["num_experts"], c["top_k"]) for c in calls] == [
        (["transformer.h.0.mlp"], 4, 2),
        (["transformer.h.1.mlp"], 2, 1),
    ]
    assert calls[1]["options"]["aux_loss_coef"] == 0.5
    loaded = from_pretrained(transformers.GPT2LMHeadModel, tmp_path)
    second = loaded.transformer.h[1].mlp[0].config
    assert (second.num_experts, second.top_k, second.aux_loss_coef) == (2, 1, 0.5)
    assert torch.equal(logits(loaded), logits(model))


def test_saved_dtypes_are_kept_and_dtype_casts(tmp_path):
    model = trained_moe(tiny_gpt2).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert torch.equal(logits(loaded), logits(model))
    upcast = from_pretrained(transformers.AutoModelForCausalLM, tmp_path, dtype=torch.float32)
    assert {p.dtype for p in upcast.parameters()} == {torch.float32}
    assert torch.equal(
        upcast.transformer.h[0].mlp[0].experts.w1_EDF, model.transformer.h[0].mlp[0].experts.w1_EDF.float()
    )


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_plain_transformers_loading_is_dense_and_reports_the_experts_it_ignored(tmp_path):
    """What the documentation warns about: transformers cannot know the record, rebuilds the dense
    MLPs with fresh weights and says so only in its LOAD REPORT (a warning, no error)."""
    model = trained_moe(tiny_gpt2)
    model.save_pretrained(tmp_path)
    handler = _Records()
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    finally:
        root.removeHandler(handler)
    assert type(plain.transformer.h[0].mlp).__name__ == "GPT2MLP"
    assert not torch.allclose(logits(plain), logits(model), atol=1e-2)
    report = "\n".join(handler.messages)
    assert "LOAD REPORT" in report and "UNEXPECTED" in report and "experts.w1_EDF" in report
    assert "MISSING" in report and "mlp.c_fc.weight" in report
    assert plain.config.to_dict()[RECORD_KEY]["moefied"][0]["num_experts"] == 4  # the record survives


def _edit_record(folder, edit):
    file = folder / "config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


def _one_line_error(folder, pattern):
    with pytest.raises(ValueError, match=pattern) as caught:
        from_pretrained(transformers.AutoModelForCausalLM, folder)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(folder))


def test_a_folder_without_the_record_is_one_clear_error(tmp_path):
    tiny_gpt2().save_pretrained(tmp_path / "dense")
    _one_line_error(
        tmp_path / "dense", "config.json has no 'moetrain_moefy' entry, so the MoE options are unknown"
    )
    (tmp_path / "empty").mkdir()
    _one_line_error(tmp_path / "empty", r"no config.json \(not a Hugging Face model folder\)")


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (lambda r: r.update(format=2), "format 2, this moetrain reads format 1"),
        (lambda r: r.update(moefied=[]), "'moefied' must be a non-empty list"),
        (lambda r: r["moefied"][0].pop("top_k"), r"moefied\[0\] lacks top_k"),
        (
            lambda r: r["moefied"][0].update(top_k=9),
            "top_k must satisfy 1 <= top_k <= num_experts = 4, got 9",
        ),
        (lambda r: r["moefied"][0]["options"].update(warp_speed=1), "unknown key 'moefy.warp_speed'"),
        (lambda r: r["moefied"][0]["options"].update(d_ff=8), r"options may not set d_ff"),
        (
            lambda r: r["moefied"][0]["modules"].append("transformer.h.7.mlp"),
            "names module 'transformer.h.7.mlp'",
        ),
    ],
    ids=["format", "no-calls", "lacks-top_k", "top_k", "unknown-option", "ffn-option", "absent-module"],
)
def test_an_invalid_record_is_one_clear_error(tmp_path, edit, pattern):
    trained_moe(tiny_gpt2).save_pretrained(tmp_path)
    _edit_record(tmp_path, lambda config: edit(config[RECORD_KEY]))
    _one_line_error(
        tmp_path,
        f"config.json: invalid 'moetrain_moefy' entry: .*{pattern}",
    )


def test_weights_that_do_not_fit_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    trained_moe(tiny_gpt2).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights.pop("transformer.h.1.mlp.0.router.weight")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _one_line_error(
        tmp_path, r"do not fit the moefied GPT2LMHeadModel: missing transformer.h.1.mlp.0.router.weight \(1\)"
    )
    _edit_record(tmp_path, lambda config: config[RECORD_KEY]["moefied"][0].update(num_experts=8))
    _one_line_error(tmp_path, r"shape transformer.h.0.mlp.0.experts")
    (tmp_path / "model.safetensors").unlink()
    _one_line_error(tmp_path, "no model.safetensors or model.safetensors.index.json")


def test_sharded_safetensors_load(tmp_path):
    model = trained_moe(tiny_llama)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = from_pretrained(transformers.LlamaForCausalLM, tmp_path)
    assert torch.equal(logits(loaded), logits(model))


def _sharded(folder):
    """A sharded moefied Llama in ``folder``; returns the index, its content and its first shard."""
    trained_moe(tiny_llama).save_pretrained(folder, max_shard_size="40KB")
    index = folder / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    return index, content, folder / sorted(set(content["weight_map"].values()))[0]


def _point_shard(index, content, shard, entry):
    """Rewrites ``index`` so the tensors of ``shard`` are read from ``entry``."""
    weight_map = {key: entry if name == shard.name else name for key, name in content["weight_map"].items()}
    index.write_text(json.dumps({**content, "weight_map": weight_map}))


@pytest.mark.parametrize("where", ["parent", "absolute", "subfolder", "dot-dot"])
def test_an_index_entry_outside_the_folder_is_refused(tmp_path, where):
    """A weight file name in the index is a plain name of a file in the folder: a copy of the
    shard elsewhere (which would load) is never read, nor is an absolute path."""
    folder = tmp_path / "model"
    index, content, shard = _sharded(folder)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / shard.name).write_bytes(shard.read_bytes())
    (folder / "sub").mkdir()
    (folder / "sub" / shard.name).write_bytes(shard.read_bytes())
    entry = {
        "parent": f"../elsewhere/{shard.name}",
        "absolute": str(elsewhere / shard.name),
        "subfolder": f"sub/{shard.name}",
        "dot-dot": "..",
    }[where]
    _point_shard(index, content, shard, entry)
    refused = "model.safetensors.index.json: weight_map entry"
    _one_line_error(folder, rf"{refused} '{re.escape(entry)}': must be a file name in .*no path separator")
    _point_shard(index, content, shard, "/etc/passwd")
    _one_line_error(folder, f"{refused} '/etc/passwd': must be a file name")


def test_a_hub_snapshot_whose_shards_link_to_blobs_loads(tmp_path):
    """A Hugging Face hub cache snapshot holds each shard as a link to ``../../blobs``: the folder's
    own links are followed (only the index's names are checked)."""
    folder = tmp_path / "snapshots" / "abc"
    index, content, _ = _sharded(folder)
    expected = logits(from_pretrained(transformers.AutoModelForCausalLM, folder))
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in set(content["weight_map"].values()):
        (folder / name).rename(blobs / name)
        (folder / name).symlink_to(Path("..", "..", "blobs", name))
    assert all((folder / name).is_symlink() for name in set(content["weight_map"].values()))
    assert torch.equal(logits(from_pretrained(transformers.AutoModelForCausalLM, folder)), expected)


def test_a_shard_that_is_not_safetensors_is_one_clear_error(tmp_path):
    index, content, shard = _sharded(tmp_path)
    shard.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 64)
    unreadable = f"{re.escape(shard.name)}: not a readable safetensors file"
    _one_line_error(tmp_path, rf"{unreadable} \(SafetensorError: ")
    shard.unlink()
    _one_line_error(tmp_path, rf"{unreadable} \(FileNotFoundError: ")


def test_a_record_left_by_plain_loading_is_replaced_when_the_dense_model_is_moefied_again(tmp_path, caplog):
    """A moefied folder loaded by plain transformers is dense, but its config still holds the
    record: moefying that model again records the new call only (with a warning), and the saved
    folder round-trips."""
    trained_moe(tiny_gpt2).save_pretrained(tmp_path / "moe")
    dense = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    assert len(dense.config.moetrain_moefy["moefied"]) == 1
    with caplog.at_level(logging.WARNING, logger="moetrain.moefy"):
        moetrain.moefy(dense, match="transformer.h.*.mlp", num_experts=2, top_k=1)
    assert "recorded 1 moefy call(s) whose modules were not MoE layers" in caplog.text
    calls = dense.config.moetrain_moefy["moefied"]
    assert [(c["num_experts"], c["top_k"]) for c in calls] == [(2, 1)]
    dense.save_pretrained(tmp_path / "again")
    assert torch.equal(
        logits(from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "again")), logits(dense)
    )


def test_remote_code_is_refused(tmp_path):
    trained_moe(tiny_gpt2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code: moetrain never runs code from a model folder"):
        from_pretrained(transformers.AutoModelForCausalLM, tmp_path, trust_remote_code=True)
