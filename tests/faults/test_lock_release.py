"""Fault: set-up fails (or is interrupted) after the run took ``out_dir``'s lock (issue 27). The lock
is released on every exit path, so a fixed resubmission, from this host or another (the lock
records host and pid: from another host a live-looking lock is refused until it is STALE_S old),
starts at once. Before, a failure while building the model or the data (a missing data file, a
bad manifest) left the lock behind for 10 minutes."""

from __future__ import annotations

import signal
import socket
import time

import pytest

import moetrain.engine
import moetrain.engine.setup
from moetrain.failures import EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_RUN_FAILED
from moetrain.run_dir import LOCK_NAME
from tests.faults.launch import error_lines, finish, start_ranks, tiny_config, write_config
from tests.faults.test_run_directory import train


def _raise(*args, **kwargs):
    raise RuntimeError("injected set-up failure")


# (name, where the failure is injected, the config overrides it needs, expected exit code)
STAGES = [
    ("log file", lambda mp: mp.setattr("moetrain.cli.attach_rank_log", _raise), {}, EXIT_RUN_FAILED),
    ("threads", lambda mp: mp.setattr(moetrain.engine.Trainer, "_choose_threads", _raise), {"threads": None},
     EXIT_RUN_FAILED),
    ("missing data file", None, {"data.source": "/nonexistent/corpus.txt"}, EXIT_BAD_INPUT),
    ("parallelize", lambda mp: mp.setattr(moetrain.engine.setup, "parallelize", _raise), {}, EXIT_RUN_FAILED),
    ("optimizer", lambda mp: mp.setattr(moetrain.engine.Trainer, "_build_optimizer", _raise), {},
     EXIT_RUN_FAILED),
    ("checkpoint writer", lambda mp: mp.setattr(moetrain.engine.setup, "CheckpointWriter", _raise), {},
     EXIT_RUN_FAILED),
    ("batch balancing", lambda mp: mp.setattr(moetrain.engine.Trainer, "_balance_batches", _raise),
     {"balance.speeds": [1.0]}, EXIT_RUN_FAILED),
    ("recompute planning", lambda mp: mp.setattr(moetrain.engine.Trainer, "_plan_recompute", _raise),
     {"recompute_budget_mb": 0}, EXIT_RUN_FAILED),
]  # fmt: skip


@pytest.mark.parametrize("stage,inject,overrides,code", STAGES, ids=[s[0] for s in STAGES])
def test_a_failed_set_up_releases_the_lock_for_a_resubmission_from_another_host(
    tmp_path, monkeypatch, capsys, stage, inject, overrides, code
):
    out_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        if inject is not None:
            inject(patch)
        assert train(tmp_path, out_dir, steps=1, **overrides) == code
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1, err
    assert not (out_dir / LOCK_NAME).exists(), f"{stage}: the lock was left behind"
    monkeypatch.setattr(socket, "gethostname", lambda: "another-node")  # the resubmission's host
    assert train(tmp_path, out_dir, steps=1) == 0, capsys.readouterr().err


def test_an_interrupt_during_set_up_releases_the_lock(tmp_path, monkeypatch):
    out_dir = tmp_path / "run"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(moetrain.engine.setup, "parallelize", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(tmp_path, out_dir, steps=1)
    assert not (out_dir / LOCK_NAME).exists()


@pytest.mark.timeout(120)
def test_sigterm_during_set_up_releases_the_lock_and_exits_as_pre_empted(tmp_path):
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=2))
    (proc,) = start_ranks([config], faults={0: "slow-build@30"})  # the builder sleeps 30 s, lock held
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (tmp_path / "slow-build.started").exists():
        time.sleep(0.1)  # the lock is taken in the start-up checks; the builder comes after them
    assert (tmp_path / "slow-build.started").exists(), "set-up did not reach the model builder"
    assert (out_dir / LOCK_NAME).exists(), "set-up did not take the lock"
    proc.send_signal(signal.SIGTERM)
    ((code, err),) = finish([proc], timeout=30)
    assert code == EXIT_PREEMPTED, err
    assert not (out_dir / LOCK_NAME).exists()
    stopped = [
        line for line in err.splitlines() if line.startswith("moetrain: stopped: rank 0, model set-up")
    ]
    assert len(stopped) == 1 and "SIGTERM before training started" in stopped[0], err
    assert "Traceback" not in err
