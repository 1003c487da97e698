"""What a logging step reports: tokens/s under tensor parallelism, the expert load of every
micro-batch of the step, the metrics lines of a resumed run, the window's loss around a skipped
step, the LR schedule's end as documented, and the config error lines of a few keys."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moetrain.config import OptimConfig, TrainConfig, config_from_dict
from moetrain.engine import Trainer, lr_at
from moetrain.layers import MoELayer
from tests.helpers.dist_utils import run_distributed
from tests.unit.engine.test_engine import tiny


def _trainer(config: dict) -> Trainer:
    return Trainer(config_from_dict(TrainConfig, config))


def _lines(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def tokens_worker(rank, world, out_dir):
    config = tiny(out_dir, steps=2, grad_accum=2, **{"model.num_heads": 4, "parallel.tp_size": 2})
    trainer = _trainer(config)
    try:
        history = trainer.train()
        streams = trainer.parallel.data_count
    finally:
        trainer.close()
    return streams, [m["tokens_per_s"] * m["time/step_s"] for m in history]


@pytest.mark.timeout(300)
def test_tokens_per_s_counts_a_tensor_parallel_groups_batch_once(tmp_path):
    """tp_size 2 on 2 ranks: both ranks read the same micro-batches (one data stream); the tokens
    of a step are those of that stream once (they were counted by each rank of the group)."""
    ranks = run_distributed(tokens_worker, 2, str(tmp_path), timeout=240)
    streams, per_step = ranks[0]
    assert streams == 1
    step_tokens = 4 * 16 * 2 * streams  # micro_batch_size * seq_len * grad_accum * data streams
    assert per_step == [pytest.approx(step_tokens)] * 2


def test_expert_metrics_cover_every_micro_batch_of_the_step(tmp_path):
    """grad_accum 4: expert_load_cv and dropped_fraction are those of the routed and kept counts
    summed over the step's 4 micro-batches (they were the last micro-batch's)."""
    trainer = _trainer(tiny(tmp_path, steps=1, grad_accum=4, **{"model.moe.capacity_factor": 1.0}))
    layer = next(m for m in trainer.model.modules() if isinstance(m, MoELayer))
    seen = []
    layer.register_forward_hook(
        lambda module, args, output: seen.append(
            (module.last_stats.routed_per_expert.double(), module.last_stats.kept_per_expert.double())
        )
    )
    try:
        (metrics,) = trainer.train()
    finally:
        trainer.close()
    assert len(seen) == 4
    routed = torch.stack([r for r, _ in seen])
    kept = torch.stack([k for _, k in seen])

    def cv(counts):
        return (counts.std(unbiased=False) / counts.mean()).item()

    step_cv, step_dropped = cv(routed.sum(0)), 1 - (kept.sum() / routed.sum()).item()
    assert step_dropped > 0 and step_cv != pytest.approx(cv(routed[-1]))  # the two readings differ
    assert metrics["expert_load_cv"] == [pytest.approx(step_cv, rel=1e-9)]
    assert metrics["dropped_fraction"] == [pytest.approx(step_dropped, rel=1e-9)]


def test_a_resumed_run_writes_the_metrics_lines_of_an_uninterrupted_one(tmp_path):
    """log_every 3, checkpoint_every 4, a crash in step 6: the resumed run's metrics.jsonl equals
    the uninterrupted run's (step 4, a checkpoint, is a logging step: the steps between the line
    of step 3 and the checkpoint were in no line)."""
    over = {"steps": 8, "log_every": 3, "checkpoint_every": 4}
    straight = _trainer(tiny(tmp_path / "straight", **over))
    try:
        straight.train()
    finally:
        straight.close()
    crashed = _trainer(tiny(tmp_path / "crashed", **over))
    loss_fn = crashed.loss_fn

    def crashing_loss(output, targets):
        if crashed.step + 1 == 6:
            raise RuntimeError("simulated crash in step 6")
        return loss_fn(output, targets)

    crashed.loss_fn = crashing_loss
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.train()
    crashed.release()
    resumed = _trainer(tiny(tmp_path / "crashed", **over))
    try:
        resumed.train()
    finally:
        resumed.close()
    keys = (
        "step",
        "loss",
        "aux_loss",
        "lr",
        "grad_norm",
        "skipped_steps",
        "expert_load_cv",
        "dropped_fraction",
    )
    want = [{k: m[k] for k in keys} for m in _lines(tmp_path / "straight")]
    got = [{k: m[k] for k in keys} for m in _lines(tmp_path / "crashed")]
    assert [m["step"] for m in want] == [3, 4, 6, 8]
    assert got == want


def test_the_step_train_stops_at_is_a_logging_step(tmp_path):
    """train(until=5) checkpoints step 5: its line holds steps 4-5, which a resumed run cannot
    log (they are the same as a log_every 1 run's)."""
    every = _trainer(tiny(tmp_path / "every", steps=6))
    try:
        losses = [m["loss"] for m in every.train()]
    finally:
        every.close()
    first = _trainer(tiny(tmp_path / "run", steps=6, log_every=3))
    try:
        assert [m["step"] for m in first.train(until=5)] == [3, 5]
    finally:
        first.close()
    assert _lines(tmp_path / "run")[1]["loss"] == pytest.approx((losses[3] + losses[4]) / 2, rel=1e-6)


def _inf_loss_at(trainer: Trainer, step: int) -> None:
    loss_fn = trainer.loss_fn
    trainer.loss_fn = lambda output, targets: (
        loss_fn(output, targets) * (math.inf if trainer.step + 1 == step else 1.0)
    )


def test_a_skipped_step_leaves_the_windows_loss_to_the_other_steps(tmp_path):
    """An inf loss in step 2 (skipped): with log_every 3 the line of step 3 has the mean loss of
    steps 1 and 3 (it was null); with log_every 1 the line of step 2 alone is null."""
    lines = {}
    for log_every in (1, 3):
        trainer = _trainer(tiny(tmp_path / str(log_every), steps=3, log_every=log_every))
        _inf_loss_at(trainer, 2)
        try:
            trainer.train()
        finally:
            trainer.close()
        lines[log_every] = _lines(tmp_path / str(log_every))
    each = lines[1]
    assert [m["loss"] is None for m in each] == [False, True, False]
    assert [m["skipped_steps"] for m in each] == [0, 1, 1]
    (window,) = lines[3]
    assert window["skipped_steps"] == 1
    assert window["loss"] == pytest.approx((each[0]["loss"] + each[2]["loss"]) / 2, rel=1e-6)
    assert window["aux_loss"] == pytest.approx((each[0]["aux_loss"] + each[2]["aux_loss"]) / 2, rel=1e-6)


def test_the_lr_reaches_min_lr_ratio_after_the_last_step_as_documented(tmp_path):
    """The cosine decay's multiplier at the last step (0-based steps - 1) is above min_lr_ratio and
    reaches it one step later; the option help says so (it said "at the last step")."""
    config = config_from_dict(TrainConfig, tiny(tmp_path, steps=8, **{"optim.min_lr_ratio": 0.1}))
    assert lr_at(7, config) > 0.1 + 0.01 and lr_at(8, config) == pytest.approx(0.1)
    helps = {f.name: f.metadata["help"] for f in OptimConfig.__dataclass_fields__.values()}
    assert "one step after the last" in helps["warmup_steps"]
    assert "one step after the last" in helps["min_lr_ratio"]
    assert "at the last step" not in (OptimConfig.__doc__ or "")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("model.d_model", 0, "model.d_model must be an integer >= 1, got 0"),
        (
            "dist_timeout_s",
            0.5,
            "dist_timeout_s must be a number in [1, 31536000] (seconds, a year at most), got 0.5",
        ),
        (
            "dist_timeout_s",
            math.inf,
            "dist_timeout_s must be a number in [1, 31536000] (seconds, a year at most), got inf",
        ),
        ("optim.min_lr_ratio", math.nan, "optim.min_lr_ratio must be a number in [0, 1], got nan"),
        ("optim.min_lr_ratio", 1.5, "optim.min_lr_ratio must be a number in [0, 1], got 1.5"),
        (
            "data.source",
            5,
            "data.source must be 'embedded', a file path or a non-empty list of file paths / glob patterns, "
            "got 5",
        ),
    ],
)
def test_config_error_lines_name_the_key_and_the_allowed_values(tmp_path, key, value, message):
    with pytest.raises(ValueError) as error:
        config_from_dict(TrainConfig, tiny(tmp_path, **{key: value}))
    assert str(error.value) == message
