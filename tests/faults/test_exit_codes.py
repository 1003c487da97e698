"""Exit codes (issue 27): 0 finished, 75 pre-empted after a checkpoint (SIGTERM; the same from one
process and from ``moetrain launch``: test_sigterm.py), 2 bad input found before training (config,
data, a checkpoint to resume from), 1 a run that failed once steps ran, whatever the kind of error
(before, a full disk or a refused non-finite checkpoint exited 2, as bad input did)."""

from __future__ import annotations

import signal
import time

import pytest
import torch

import moetrain.engine
from moetrain.checkpoint import list_checkpoints
from moetrain.failures import EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_RUN_FAILED
from tests.faults.launch import error_lines, finish, start_ranks, tiny_config, write_config
from tests.faults.test_run_directory import one_error, train


@pytest.mark.timeout(120)
def test_sigterm_to_one_process_checkpoints_and_exits_as_pre_empted(tmp_path):
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, log_every=5))
    (proc,) = start_ranks([config])
    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    ((code, err),) = finish([proc], timeout=60)
    assert code == EXIT_PREEMPTED, err  # before: 0, as if the run had finished
    saved = [line for line in err.splitlines() if line.startswith("SIGTERM: checkpoint saved at step")]
    assert len(saved) == 1 and not error_lines(err), err
    step = int(saved[0].split("step ")[1].split(",")[0])
    assert [s for s, _ in list_checkpoints(out_dir / "checkpoints")][-1] == step


def test_a_refused_non_finite_checkpoint_during_the_run_is_a_run_failure(tmp_path, monkeypatch, capsys):
    original = moetrain.engine.Trainer._build_optimizer

    def poisoned(self):  # the weights turn NaN after the optimizer step of step 2
        optimizer, calls = original(self), {"n": 0}

        def after_step(optimizer, args, kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                with torch.no_grad():
                    next(self.model.parameters()).fill_(float("nan"))

        optimizer.register_step_post_hook(after_step)
        return optimizer

    monkeypatch.setattr(moetrain.engine.Trainer, "_build_optimizer", poisoned)
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=4, checkpoint_every=1) == EXIT_RUN_FAILED
    line = one_error(capsys)
    assert (
        "rank 0, step 2, checkpoint save: CheckpointError: checkpoint step 2 not written: non-finite" in line
    )
    assert [s for s, _ in list_checkpoints(out_dir / "checkpoints")] == [1]


def test_bad_input_before_training_is_2(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, **{"data.source": str(tmp_path / "missing.txt")}) == EXIT_BAD_INPUT
    assert "data.source: cannot read" in one_error(capsys)
