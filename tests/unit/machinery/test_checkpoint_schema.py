"""Checkpoint loading checks what it reads against what it loads into before changing anything:
the optimizer's kind (its state keys), and the global DCP metadata is read once per load."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain.checkpoint import load_checkpoint, save_checkpoint
from moetrain.offload import OffloadOptimizer
from moetrain.offload.groupwise import GroupwiseApply


def _stepped(optimizer_of, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 4)
    optimizer = optimizer_of(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.1)


@pytest.mark.parametrize(
    ("saved_with", "loaded_into", "expected"),
    [
        (_sgd, _adamw, "state keys ['momentum_buffer'] of parameter 'weight' do not fit AdamW (it needs"),
        (_adamw, _sgd, "state keys ['exp_avg', 'exp_avg_sq', 'step'] of parameter 'weight' do not fit SGD"),
        (_adamw, lambda p: torch.optim.NAdam(p), "do not fit NAdam (it needs ['exp_avg', 'exp_avg_sq', 'mu_"),
        (
            _sgd,
            lambda p: GroupwiseApply(_adamw(p), 2),
            "state keys ['momentum_buffer'] of parameter 'weight'",
        ),
        (_sgd, lambda p: OffloadOptimizer(p, lr=0.1), "do not fit OffloadOptimizer (it needs ['exp_avg',"),
    ],
    ids=["sgd-adamw", "adamw-sgd", "adam-nadam", "sgd-groupwise", "sgd-offload"],
)
def test_another_kind_of_optimizer_is_one_line_and_changes_nothing(
    tmp_path, saved_with, loaded_into, expected
):
    saved, saved_optimizer = _stepped(saved_with)
    save_checkpoint(tmp_path, 1, model=saved, optimizer=saved_optimizer)
    model, optimizer = _stepped(loaded_into, seed=1)
    weights = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    with pytest.raises(ValueError) as error:
        load_checkpoint(tmp_path, model=model, optimizer=optimizer)
    message = str(error.value)
    assert message.startswith("optimizer: checkpoint ") and expected in message, message
    assert "\n" not in message
    for p, q in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p.detach(), q)
    assert sorted(optimizer.state[model.weight]) == sorted(state)
    for key, value in state.items():
        assert torch.equal(optimizer.state[model.weight][key], value)


@pytest.mark.parametrize(
    ("saved_with", "loaded_into"),
    [
        (_adamw, lambda p: OffloadOptimizer(p, lr=0.1)),
        (lambda p: OffloadOptimizer(p, lr=0.1), _adamw),
        (_adamw, lambda p: GroupwiseApply(_adamw(p), 2)),
        (lambda p: torch.optim.SGD(p, lr=0.1), _adamw),  # no momentum: no state saved, fresh moments
    ],
    ids=["adamw-offload", "offload-adamw", "adamw-groupwise", "stateless-sgd-adamw"],
)
def test_optimizers_whose_state_fits_still_load(tmp_path, saved_with, loaded_into):
    saved, saved_optimizer = _stepped(saved_with)
    save_checkpoint(tmp_path, 1, model=saved, optimizer=saved_optimizer)
    torch.manual_seed(1)
    model = nn.Linear(4, 4)
    optimizer = loaded_into(model.parameters())  # fresh: no state before the load
    load_checkpoint(tmp_path, model=model, optimizer=optimizer)
    assert torch.equal(model.weight.detach(), saved.weight.detach())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # the loaded state is one this optimizer steps with


def test_the_global_metadata_is_unpickled_once_per_load(tmp_path, monkeypatch):
    """``.metadata`` grows with the entries (seconds to unpickle at scale): load reads it once and
    hands it to DCP's reader."""
    import moetrain.checkpoint.safe_dcp as safe_dcp

    model = nn.Linear(4, 4)
    save_checkpoint(tmp_path, 1, model=model, extra_state={"x": 1})
    reads = []
    unpickle = safe_dcp.MetadataUnpickler.load

    def counted(self):
        reads.append(self.source)
        return unpickle(self)

    monkeypatch.setattr(safe_dcp.MetadataUnpickler, "load", counted)
    load_checkpoint(tmp_path, model=nn.Linear(4, 4))
    assert len(reads) == 1, reads
