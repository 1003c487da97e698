"""``optim.overlap: delayed`` through the engine (moetrain/engine/ with moetrain/offload): warm-up
steps exact, a run stopped and resumed in the middle equals one that never stopped (the pending
update is recorded in the checkpoint and replayed), the finished run's weights and its last
checkpoint hold every update, and each logging step reports where the step's time went
(time/*_s, read by ``plan --calibrate``)."""

from __future__ import annotations

import pytest
import torch

from moetrain.checkpoint import load_checkpoint
from moetrain.config import TrainConfig, config_from_dict
from moetrain.engine import Trainer
from tests.unit.engine.test_engine import tiny

DELAYED = {"optim.name": "offload", "optim.overlap": "delayed", "optim.overlap_after_steps": 2}


def _train(config: dict, until=None) -> tuple[list[dict], dict[str, torch.Tensor], bool]:
    trainer = Trainer(config_from_dict(TrainConfig, config))
    try:
        history = trainer.train(until=until)
        weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        return history, weights, trainer.optimizer.has_pending
    finally:
        trainer.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_delayed_run_resumed_in_the_middle_equals_one_that_never_stopped(tmp_path, precision):
    straight, straight_weights, pending = _train(tiny(tmp_path / "straight", precision=precision, **DELAYED))
    assert not pending  # the finished run wrote its last update
    first, _, _ = _train(tiny(tmp_path / "resumed", precision=precision, **DELAYED), until=5)
    rest, resumed_weights, _ = _train(tiny(tmp_path / "resumed", precision=precision, **DELAYED))
    assert [m["loss"] for m in first + rest] == [m["loss"] for m in straight]
    for name, weight in straight_weights.items():
        assert torch.equal(weight, resumed_weights[name]), name


@pytest.mark.parametrize("checkpoint_every", [4, 3])
def test_the_last_checkpoint_holds_the_last_update(tmp_path, checkpoint_every):
    """Saved inside the loop (``checkpoint_every`` divides ``steps``) or after it, the run's last
    checkpoint loaded model-only (as export and evaluation load it) equals the finished weights."""
    config = tiny(tmp_path / "run", checkpoint_every=checkpoint_every, **DELAYED)
    _, finished, _ = _train(config)
    fresh = Trainer(config_from_dict(TrainConfig, tiny(tmp_path / "fresh")))
    try:
        loaded = load_checkpoint(tmp_path / "run" / "checkpoints", model=fresh.model)
        assert loaded["step"] == config["steps"]
        stale = [n for n, p in fresh.model.named_parameters() if not torch.equal(p.detach(), finished[n])]
    finally:
        fresh.close()
    assert not stale


def test_warm_up_steps_are_exact_and_the_delay_changes_what_follows(tmp_path):
    exact, _, _ = _train(tiny(tmp_path / "exact", **{"optim.name": "offload"}))
    delayed, _, _ = _train(tiny(tmp_path / "delayed", **DELAYED))
    losses = [m["loss"] for m in exact], [m["loss"] for m in delayed]
    # overlap_after_steps 2: updates 1 and 2 are exact, so the losses of steps 1-3 agree
    assert losses[0][:3] == losses[1][:3]
    assert losses[0][3:] != losses[1][3:]  # from step 4 on, weights are one update behind


def test_logging_steps_report_where_the_time_went(tmp_path):
    history, _, _ = _train(tiny(tmp_path / "run", grad_accum=2, **DELAYED))
    for metrics in history:
        phases = {key: metrics[key] for key in metrics if key.startswith("time/")}
        assert set(phases) == {
            "time/step_s", "time/forward_s", "time/backward_s", "time/grad_sync_s", "time/optimizer_s",
            "time/optimizer_host_s",
        }  # fmt: skip
        assert all(value >= 0 for value in phases.values())
        parts = phases["time/forward_s"] + phases["time/backward_s"] + phases["time/grad_sync_s"]
        assert parts + phases["time/optimizer_s"] <= phases["time/step_s"] * 1.05 + 1e-4
