"""The training step's fp16 edges and its bookkeeping, in one process: the gradient norm it
reports (the unscaled one), the loss scale at which an overflow stops counting as the scaler's
calibration, and cases a mutation review of :mod:`moetrain.engine.step` found no test for."""

from __future__ import annotations

import pytest
import torch

from moe_lm import lm_loss
from moetrain.config import TrainConfig, config_from_dict
from moetrain.engine import NonFiniteGradientsError, Trainer
from tests.faults.inf_gradient import InfGradient
from tests.unit.engine.test_engine import tiny


def _trainer(config: dict) -> Trainer:
    return Trainer(config_from_dict(TrainConfig, config))


def test_fp16_reports_the_gradient_norm_of_the_unscaled_gradients(tmp_path):
    """fp16, no clipping: the step's ``grad_norm`` is the norm of the gradients the optimizer used
    (``GradScaler.step`` unscaled them in place), not that norm times the loss scale (65536)."""
    trainer = _trainer(tiny(tmp_path, steps=1, precision="fp16", **{"optim.grad_clip": 0.0}))
    metrics = trainer.train_step()
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
    trainer.close()
    assert metrics["loss_scale"] > 1 and norm > 0
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-3)


def test_an_fp16_overflow_at_loss_scale_1_counts_toward_the_skip_limit(tmp_path):
    """A finite loss whose backward overflows is the scaler's calibration only while the loss scale
    is above 1: at exactly 1 the skip counts, and ``max_consecutive_skips`` 1 stops the run."""
    trainer = _trainer(tiny(tmp_path, steps=2, precision="fp16", max_consecutive_skips=1))
    trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": 1.0})
    trainer.loss_fn = lambda logits, targets: lm_loss(InfGradient.apply(logits), targets)
    with pytest.raises(NonFiniteGradientsError, match=r"^step 1: 1 consecutive steps"):
        trainer.train_step()
    trainer.close()


DELAYED = {"optim.name": "offload", "optim.overlap": "delayed", "optim.overlap_after_steps": 1}


def test_a_skipped_step_writes_the_delayed_update_still_in_flight(tmp_path):
    """``optim.overlap: delayed``: after step 2 its update is in flight (the weights lack it); a
    NaN loss at step 3 skips that step, which still writes step 2's update into the weights, as the
    skipped ``step()`` would have: nothing is pending afterwards and the weights moved."""
    trainer = _trainer(tiny(tmp_path, steps=3, **DELAYED))
    trainer.train_step()
    trainer.train_step()
    assert trainer.optimizer.has_pending
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.loss_fn = lambda logits, targets: lm_loss(logits, targets) * float("nan")
    metrics = trainer.train_step()
    pending = trainer.optimizer.has_pending
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    trainer.close()
    assert metrics["skipped_steps"] == 1
    assert not pending and moved


class _NoUnits:
    """``lm_loss`` declaring ``loss_units`` (as M6's loss does) that counts no unit in any batch."""

    def __call__(self, logits, targets):
        return lm_loss(logits, targets)

    def loss_units(self, targets) -> int:
        return 0


def test_a_step_with_no_loss_units_anywhere_trains_on_with_a_zero_loss_share(tmp_path):
    """A loss averaging over its units whose step holds none (e.g. every target masked): each
    micro-batch's share ``u_i * D * m / max(U, 1)`` is 0, the step is not skipped and logs loss 0."""
    trainer = _trainer(tiny(tmp_path, steps=1, grad_accum=2))
    trainer.loss_fn = _NoUnits()
    metrics = trainer.train_step()
    trainer.close()
    assert metrics["skipped_steps"] == 0 and metrics["loss"] == 0.0


def _nan_at(trainer: Trainer, faults: set[tuple[int, int]]):
    """``lm_loss``, NaN at the (step, micro-step) pairs in ``faults`` (both counted from 1)."""
    calls = {"step": 0, "micro": 0}

    def loss_fn(logits, targets):
        if calls["step"] != trainer.step + 1:
            calls.update(step=trainer.step + 1, micro=0)
        calls["micro"] += 1
        loss = lm_loss(logits, targets)
        return loss * float("nan") if (calls["step"], calls["micro"]) in faults else loss

    return loss_fn


def test_an_applied_update_ends_a_run_of_skipped_steps(tmp_path):
    """``max_consecutive_skips`` 2, NaN losses at steps 1 and 3: step 2's update resets the count,
    so neither skip is the second in a row and the run trains all 4 steps."""
    trainer = _trainer(tiny(tmp_path, steps=4, max_consecutive_skips=2))
    trainer.loss_fn = _nan_at(trainer, {(1, 1), (3, 1)})
    history = trainer.train()
    trainer.close()
    assert [m["skipped_steps"] for m in history] == [1, 1, 2, 2]


def test_fp16_one_nan_micro_step_loss_is_not_calibration(tmp_path):
    """fp16, ``grad_accum`` 2: a NaN loss in one micro-step (the other finite) makes the step's
    losses non-finite, so the skip counts toward ``max_consecutive_skips`` 1 and stops the run
    (only a skip whose every loss was finite is the scaler's calibration)."""
    trainer = _trainer(tiny(tmp_path, steps=2, grad_accum=2, precision="fp16", max_consecutive_skips=1))
    trainer.loss_fn = _nan_at(trainer, {(1, 2)})
    with pytest.raises(NonFiniteGradientsError, match=r"^step 1: 1 consecutive steps"):
        trainer.train_step()
    trainer.close()
