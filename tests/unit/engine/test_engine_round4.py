"""The engine's end-of-run summary, its skip-limit error and its weight-decay groups:

- a finished run resubmitted (nothing left to train) leaves ``summary.json`` as the run wrote it;
- the ``max_consecutive_skips`` error names the last step whose update was applied and counts every
  skipped step since, an fp16 calibration skip inside the run of skips included (across a resume,
  and from a checkpoint that did not record that step);
- weight decay spares the parameters of norm layers and 1-D ones, not matrices whose name holds
  ``norm``.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from models.moe_lm.model import lm_loss
from moetrain.config import TrainConfig, config_from_dict
from moetrain.engine import NonFiniteGradientsError, Trainer
from moetrain.engine.setup import weight_decay_groups
from tests.faults.inf_gradient import InfGradient
from tests.unit.engine.test_engine import tiny


def _trainer(config: dict) -> Trainer:
    return Trainer(config_from_dict(TrainConfig, config))


def test_a_finished_run_resubmitted_keeps_its_summary(tmp_path):
    config = tiny(tmp_path, steps=3, checkpoint_at_end=True)
    trainer = _trainer(config)
    trainer.train()
    trainer.close()
    written = (tmp_path / "summary.json").read_text()
    trainer = _trainer(config)  # resumes at step 3: nothing to train, ends normally
    assert trainer.train() == []
    trainer.close()
    assert trainer.step == 3
    assert (tmp_path / "summary.json").read_text() == written
    summary = json.loads(written)
    assert summary["last_step"] == 3 and "loss" in summary and "lr" in summary


def _faulty_loss(trainer: Trainer, faults: dict[int, str]):
    """``lm_loss``, but NaN at the steps ``faults`` maps to "nan" and a finite loss whose backward
    overflows at those it maps to "overflow" (one micro-step per step)."""

    def loss_fn(logits, targets):
        fault = faults.get(trainer.step + 1)
        if fault == "nan":
            return lm_loss(logits, targets) * float("nan")
        if fault == "overflow":
            return lm_loss(InfGradient.apply(logits), targets)
        return lm_loss(logits, targets)

    return loss_fn


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


SKIPS = {2: "nan", 3: "overflow", 4: "nan"}  # the step 3 skip is fp16 calibration: not counted


def test_the_skip_limit_names_the_last_updated_step_across_a_calibration_skip(tmp_path):
    trainer = _trainer(tiny(tmp_path, steps=8, precision="fp16", max_consecutive_skips=2))
    trainer.loss_fn = _faulty_loss(trainer, SKIPS)
    after_step_1 = {}
    step = trainer.train_step

    def train_step():
        if trainer.step == 1:
            after_step_1.update(_weights(trainer))
        return step()

    trainer.train_step = train_step
    with pytest.raises(NonFiniteGradientsError) as error:
        trainer.train()
    trainer.close()
    message = str(error.value)
    assert message.startswith("step 4: 3 consecutive steps had non-finite gradients"), message
    assert "1 of them fp16 loss-scale calibration, not counted" in message, message
    assert "the weights are those of step 1:" in message, message
    assert all(torch.equal(after_step_1[name], p) for name, p in _weights(trainer).items())


@pytest.mark.parametrize("recorded", [True, False])
def test_the_last_updated_step_survives_a_resume(tmp_path, monkeypatch, recorded):
    """Steps 2 and 3 skipped, stopped at 3, resumed: the NaN at step 4 names step 1. A checkpoint
    without ``last_update_step`` (written before it was kept) falls back to the counted skips."""
    config = tiny(tmp_path, steps=8, precision="fp16", max_consecutive_skips=2)
    if not recorded:
        extra_state = Trainer._extra_state
        monkeypatch.setattr(
            Trainer,
            "_extra_state",
            lambda self: {k: v for k, v in extra_state(self).items() if k != "last_update_step"},
        )
    first = _trainer(config)
    first.loss_fn = _faulty_loss(first, SKIPS)
    first.train(until=3)
    first.close()
    resumed = _trainer(config)
    resumed.loss_fn = _faulty_loss(resumed, SKIPS)
    with pytest.raises(NonFiniteGradientsError) as error:
        resumed.train()
    resumed.close()
    if recorded:
        assert "step 4: 3 consecutive steps" in str(error.value) and "those of step 1:" in str(error.value)
    else:  # the old computation: the calibration skip at step 3 unknown
        assert "step 4: 2 consecutive steps" in str(error.value) and "those of step 2:" in str(error.value)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.normalizer_proj = nn.Linear(8, 8)
        self.out_proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.head_norm = nn.GroupNorm(2, 8)


def test_weight_decay_follows_shape_and_norm_layers_not_parameter_names():
    model = _Block()
    model.ln.weight = nn.Parameter(torch.ones(2, 8))  # a norm layer's 2-D parameter: still a norm
    decay, no_decay = weight_decay_groups(model, 0.1)
    names = {id(p): name for name, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["normalizer_proj.weight", "out_proj.weight"]
    assert sorted(names[id(p)] for p in no_decay["params"]) == [
        "head_norm.bias", "head_norm.weight", "ln.bias", "ln.weight",
        "normalizer_proj.bias", "out_proj.bias", "rms.weight",
    ]  # fmt: skip
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
