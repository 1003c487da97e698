"""Loading a checkpoint (moetrain/checkpoint/restore.py) at its edges: optimizer state of size zero
loads; expert parameters the model lacks are named; the experts stacked into one parameter on a
rank must agree on their saved state keys and on their unsplit state (value and dtype). Hand-edited
checkpoints are resealed, so that only the check under test can refuse them."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil

import pytest
import torch
from torch import nn

from moetrain.checkpoint import load_checkpoint, save_checkpoint
from tests.faults.test_crafted_checkpoint import _load_metadata_unsafely, _reseal
from tests.unit.machinery.test_checkpoint import D_MODEL, Net, _adamw, _small_checkpoint, _train


class _WithEmptyParameter(nn.Module):
    """A linear layer and a parameter with no elements (shape (0, 4))."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.empty = nn.Parameter(torch.zeros(0, 4))


def _stepped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _WithEmptyParameter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.linear(torch.randn(2, 4)).sum().backward()
    model.empty.grad = torch.zeros_like(model.empty)
    optimizer.step()
    return model, optimizer


def test_optimizer_state_with_a_zero_dimension_loads(tmp_path):
    """A size of 0 is a valid size (only a negative one is refused): the AdamW moments of a
    (0, 4) parameter, read with the size the checkpoint's metadata gives, round-trip."""
    saved, saved_optimizer = _stepped(0)
    save_checkpoint(tmp_path, 1, model=saved, optimizer=saved_optimizer)
    model, optimizer = _stepped(1)
    assert load_checkpoint(tmp_path, model=model, optimizer=optimizer)["step"] == 1
    assert optimizer.state[model.empty]["exp_avg"].shape == (0, 4)
    saved_state = saved_optimizer.state[saved.linear.weight]["exp_avg"]
    assert torch.equal(optimizer.state[model.linear.weight]["exp_avg"], saved_state)


class _Ends(nn.Module):
    """``Net`` of test_checkpoint.py without its MoE layer: the same ``inp`` and ``out``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, D_MODEL)
        self.out = nn.Linear(D_MODEL, 3)


def test_a_checkpoint_with_experts_the_model_lacks_names_the_expert_parameters(tmp_path):
    """Loading an MoE checkpoint into a model without that MoE layer: one line naming the expert
    parameters (as the checkpoint's manifest lists them), not their per-expert entries."""
    _small_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"has expert parameters this model lacks: \['moe\.experts\.w1_EDF'"):
        load_checkpoint(tmp_path, model=_Ends())


def test_experts_stacked_on_a_rank_whose_saved_state_keys_differ_name_both(tmp_path):
    """A (resealed, hand-edited) checkpoint whose expert 1 lacks its AdamW ``exp_avg`` while expert
    0 has it: the experts stacked into one parameter need the same state keys, and the one-line
    error names both entries and their keys."""
    path, _ = _small_checkpoint(tmp_path)
    metadata = _load_metadata_unsafely(path)
    del metadata.state_dict_metadata["optim/moe.experts.w1_EDF.expert.1/exp_avg"]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(path)
    model = Net()
    with pytest.raises(ValueError) as error:
        load_checkpoint(tmp_path, model=model, optimizer=_adamw(model))
    message = str(error.value)
    assert message.startswith("optimizer state of parameter 'moe.experts.w1_EDF': "), message
    assert "'optim/moe.experts.w1_EDF.expert.1' has entries ['exp_avg_sq', 'step']" in message, message


def _other_step_for_expert_1(path, tmp_path, steps: int, dtype: torch.dtype) -> None:
    """Hand-edits (and reseals) checkpoint ``path``: expert 1's AdamW ``step`` of
    ``moe.experts.w1_EDF`` becomes that of a run of ``steps`` steps whose default dtype is ``dtype``."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        later = Net()
        optimizer = _adamw(later)
        _train(later, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), steps)
        other = save_checkpoint(tmp_path / "other", steps, model=later, optimizer=optimizer)
    finally:
        torch.set_default_dtype(default)
    key = "optim/moe.experts.w1_EDF.expert.1/step"
    metadata, theirs = _load_metadata_unsafely(path), _load_metadata_unsafely(other)
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    (their_info,) = [info for i, info in theirs.storage_data.items() if i.fqn == key]
    shutil.copy(other / their_info.relative_path, path / "other.distcp")
    metadata.storage_data[index] = dataclasses.replace(their_info, relative_path="other.distcp")
    metadata.state_dict_metadata[key] = theirs.state_dict_metadata[key]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["other.distcp"] = {}
    (path / "manifest.json").write_text(json.dumps(manifest))
    _reseal(path)


@pytest.mark.parametrize(
    ("steps", "dtype"), [(2, torch.float32), (1, torch.float64)], ids=["value-2", "float64-1"]
)
def test_experts_stacked_on_a_rank_whose_shared_state_differs_are_refused(tmp_path, steps, dtype):
    """The experts stacked into one parameter share its unsplit state (AdamW's ``step``, 1.0 in
    float32 after one step): a hand-edited checkpoint whose expert 1 holds another value, or the
    same value in another dtype, is refused in one line rather than loaded with expert 0's."""
    path, _ = _small_checkpoint(tmp_path / "a")
    _other_step_for_expert_1(path, tmp_path, steps, dtype)
    model = Net()
    with pytest.raises(
        ValueError, match=r"^optimizer state 'step' of parameter 'moe\.experts\.w1_EDF': the experts"
    ):
        load_checkpoint(tmp_path / "a", model=model, optimizer=_adamw(model))
