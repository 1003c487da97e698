"""M6 at its edges: the planner's target tokens for a training config, decoding in training mode,
the shortest data.seq_len."""

from __future__ import annotations

import pytest
import torch

from m6_moe.config import M6Config, M6TaskConfig
from m6_moe.data import ManifestDataset
from m6_moe.model import M6Model
from m6_moe.synthetic import write_synthetic_dataset
from m6_moe.tasks import TASKS, TaskSampler, collate
from m6_moe.tokenizer import ByteTokenizer
from tests.helpers.paths import ROOT

TOKENIZER = ByteTokenizer()


def test_planned_loss_of_a_training_config_covers_data_seq_len_target_tokens():
    """tiny.yaml's data.seq_len = 40 bounds the prefix and the target each: the planner plans 80
    text tokens per sequence, but logits and loss for the 40 target tokens a batch can hold."""
    from moetrain.planner import ClusterSpec, PlanSettings, make_plan
    from moetrain.planner.hardware import GPU_PRESETS
    from moetrain.planner.model import _model_from_file

    model, defaults = _model_from_file(ROOT / "models/m6_moe/tiny.yaml")
    fields = PlanSettings.__dataclass_fields__
    settings = PlanSettings(**{k: v for k, v in defaults.items() if k in fields})
    cluster = ClusterSpec(gpu=GPU_PRESETS["a100-80gb"], nodes=1, gpus_per_node=1)
    loss_bytes = make_plan(model, cluster, settings).activations.outside["loss"]
    tokens = settings.micro_batch * 40
    assert loss_bytes == tokens * model.arch.vocab_size * 4 + tokens * 8 + 4  # fp32 log-softmax, labels
    assert (settings.seq_len, settings.target_len) == (80, 40)


def test_decode_step_refuses_training_mode():
    """Dropout would make the cached decoding differ from the forward, as start_decoding says."""
    torch.manual_seed(0)
    config = M6Config(
        d_model=32, num_layers=1, num_heads=2, d_ff=64, max_text_len=16, image_size=16, patch_size=8,
        stem_channels=(8,), dropout=0.1,
        moe={"d_ff": 64, "num_experts": 2, "top_k": 1, "eval_capacity_factor": None},
    )  # fmt: skip
    model = M6Model(config).eval()
    cache = model.start_decoding(torch.tensor([[5, 6, 7]]), max_target_len=4)
    model.train()
    with pytest.raises(ValueError, match="decoding with a key/value cache needs eval mode"):
        model.decode_step(cache, torch.tensor([TOKENIZER.bos_id]))
    model.eval()
    assert model.decode_step(cache, torch.tensor([TOKENIZER.bos_id])).shape == (1, config.vocab_size)


def test_seq_len_must_hold_a_one_token_denoise_target(tmp_path):
    """A one-token text is all noise, target ``[<s0>, t]``: with bos 3 tokens, so data.seq_len 2
    is refused up front (a fixed-length batch, pp_size > 1, would fail mid-run); 3 fits every task."""
    data = write_synthetic_dataset(tmp_path / "data", seed=0, num_train=8, num_heldout=1)
    dataset = ManifestDataset(data / "train.jsonl", image_size=16)
    with pytest.raises(ValueError, match=r"data.seq_len must be an integer >= 3 .*, got 2"):
        TaskSampler(dataset, TOKENIZER, M6TaskConfig(), seq_len=2)
    sampler = TaskSampler(dataset, TOKENIZER, M6TaskConfig(), seq_len=3)
    samples = [sampler.sample_at(0, i, task) for i in range(sampler.epoch_size) for task in TASKS]
    inputs, labels = collate(samples, TOKENIZER, (3, 16, 16), length=3)
    assert labels.shape == inputs["prefix_ids"].shape == (len(samples), 3)


def test_a_seq_len_given_to_plan_replaces_the_configs_target_length(capsys):
    """--seq-len is the plan's own sequence: the config's target length (data.seq_len = 40 targets)
    does not outlive it (before: "target_len must be <= seq_len = 30, got 40")."""
    from moetrain.cli import main

    config = str(ROOT / "models/m6_moe/tiny.yaml")
    args = ["plan", "--model", config, "--cluster", "a100-80gb", "--nodes", "1"]
    assert main([*args, "--seq-len", "30"]) == 0, capsys.readouterr().err
