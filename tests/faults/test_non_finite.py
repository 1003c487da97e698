"""Fault: non-finite gradients in fp32 / bf16 / fp16 (fp16's overflows on one rank are tested in
test_engine.py).

One rank's loss is inf at one step: every rank skips that step together (their weights stay equal),
it is counted in the metrics (its gradient norm, inf, written as null: metrics.jsonl is standard
JSON), training goes on and ends with exit code 0, every checkpoint is
finite. A loss that stays NaN stops the run after ``max_consecutive_skips`` steps with one line
naming the step, and the last finite checkpoint survives ``keep_last``; under fp16 too (a NaN loss
is not the loss scaler's calibration), while an fp16 gradient overflow with a finite loss is.
"""

from __future__ import annotations

import json

import pytest
import torch

from moe_lm import LMConfig, MoETransformerLM
from moetrain.checkpoint import list_checkpoints, load_checkpoint
from tests.faults.launch import error_lines, finish, start_ranks, tiny_config, write_config


def _lm_config(cfg: dict) -> LMConfig:
    from moetrain.config import MoEConfig

    return LMConfig(
        d_model=cfg["d_model"], num_layers=cfg["num_layers"], num_heads=cfg["num_heads"],
        max_seq_len=cfg["max_seq_len"], moe=MoEConfig(d_model=cfg["d_model"], **cfg["moe"]),
    )  # fmt: skip


def strict_json(line: str) -> dict:
    """A line of standard JSON: ``Infinity`` / ``NaN`` (Python's extension) refused."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_inf_loss_on_one_rank_skips_that_step_on_every_rank(tmp_path, precision):
    out_dir = tmp_path / "run"
    config = write_config(
        tmp_path, tiny_config(out_dir, precision=precision, checkpoint_every=1, keep_last=10, steps=5)
    )
    results = finish(start_ranks([config, config], faults={1: "inf-loss@3"}), timeout=90)
    assert [code for code, _ in results] == [0, 0], results
    metrics = [strict_json(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in metrics] == [0, 0, 1, 1, 1]
    assert metrics[2]["grad_norm"] is None and metrics[3]["lr"] == metrics[2]["lr"]  # inf: written as null
    steps = [step for step, _ in list_checkpoints(out_dir / "checkpoints")]
    assert steps == [1, 2, 3, 4, 5]
    model = MoETransformerLM(_lm_config(tiny_config(out_dir)["model"]))
    for step in (2, 3):  # the skipped step changed nothing
        load_checkpoint(out_dir / "checkpoints", model=model, step=step)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if step == 2:
            before = state
    assert all(torch.equal(before[k], state[k]) for k in state)
    for step in steps:
        load_checkpoint(out_dir / "checkpoints", model=model, step=step)
        assert all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())


def _every_rank_stopped_at_step_6_with_the_weights_of_step_3(results) -> None:
    """Steps 4 to 6 skipped under ``max_consecutive_skips`` 3: each rank exits 1 with one line."""
    for code, err in results:
        lines = error_lines(err)
        assert code == 1 and len(lines) == 1, err
        assert "step 6: 3 consecutive steps had non-finite gradients" in lines[0], lines
        assert "the weights are those of step 3" in lines[0]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_loss_that_stays_nan_stops_the_run_naming_the_step_and_keeps_the_finite_checkpoints(
    tmp_path, precision
):
    """fp16 as fp32: the loss scale (65536 at the start) being above 1 does not excuse a NaN loss."""
    out_dir = tmp_path / "run"
    settings = {"checkpoint_every": 1, "keep_last": 2, "steps": 20, "max_consecutive_skips": 3}
    config = write_config(tmp_path, tiny_config(out_dir, precision=precision, **settings))
    results = finish(start_ranks([config, config], faults={0: "nan-loss-from@4"}), timeout=90)
    _every_rank_stopped_at_step_6_with_the_weights_of_step_3(results)
    steps = [step for step, _ in list_checkpoints(out_dir / "checkpoints")]
    assert steps == [4, 5]  # written after skipped steps: the weights of step 3, finite
    model = MoETransformerLM(_lm_config(tiny_config(out_dir)["model"]))
    load_checkpoint(out_dir / "checkpoints", model=model)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())


def test_a_run_of_skipped_steps_goes_on_counting_across_a_resume(tmp_path):
    """Steps 4 and 5 skipped, the run stopped at 5 and resumed: the NaN at step 6 is the third in a
    row (as without the stop), and the weights named are those of step 3."""
    out_dir = tmp_path / "run"
    settings = {"checkpoint_every": 1, "keep_last": 10, "max_consecutive_skips": 3}
    first = write_config(tmp_path, tiny_config(out_dir, steps=5, **settings))
    results = finish(start_ranks([first, first], faults={0: "nan-loss-from@4"}), timeout=90)
    assert [code for code, _ in results] == [0, 0], results
    resumed = write_config(tmp_path, tiny_config(out_dir, steps=20, **settings), name="resumed.json")
    # the fault counts this process's steps: its first is step 6
    results = finish(start_ranks([resumed, resumed], faults={0: "nan-loss-from@1"}), timeout=90)
    _every_rank_stopped_at_step_6_with_the_weights_of_step_3(results)


@pytest.mark.parametrize("precision,stops", [("fp16", False), ("fp32", True)])
def test_an_fp16_gradient_overflow_with_a_finite_loss_is_calibration(tmp_path, precision, stops):
    """max_consecutive_skips 1: under fp16 a step whose backward overflowed while its loss was finite
    lowers the loss scale and does not count; in fp32 the same step stops the run."""
    out_dir = tmp_path / "run"
    config = write_config(
        tmp_path, tiny_config(out_dir, precision=precision, steps=4, max_consecutive_skips=1)
    )
    ((code, err),) = finish(start_ranks([config], faults={0: "overflow-grad@2"}), timeout=60)
    if stops:
        assert code == 1 and "step 2: 1 consecutive steps had non-finite gradients" in error_lines(err)[0], (
            err
        )
        return
    assert code == 0, err
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 1, 1]
    assert metrics[2]["loss_scale"] == metrics[1]["loss_scale"] / 2
