"""Fault: a run is suspended (SIGSTOP, a paused VM) for longer than the lock's staleness, another run
takes ``out_dir`` over, then the first one wakes up. Before, the woken run refreshed the new run's
lock, kept training and wrote its checkpoints among the new run's, and deleted the new run's lock
when it ended. Now it never touches a lock that is not its own and stops, one line naming the run
that holds ``out_dir``, before it writes another checkpoint."""

from __future__ import annotations

import json
import os
import time

import moetrain.run_dir
from moetrain.checkpoint import list_checkpoints
from moetrain.engine import Trainer
from moetrain.failures import EXIT_RUN_FAILED
from moetrain.run_dir import LOCK_NAME, RunLock
from tests.faults.test_run_directory import one_error, train

OTHER_RUN = {"host": "another-node", "pid": 4242, "started": 1.0}


def _take_over(lock_path) -> None:
    """What a run that judged this lock stale does: moves it aside and creates its own."""
    os.rename(lock_path, lock_path.with_name(f"{LOCK_NAME}.old.stale"))
    lock_path.write_text(json.dumps(OTHER_RUN))


def test_a_run_whose_lock_was_taken_over_stops_before_its_next_checkpoint(tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "run"
    lock_path = out_dir / LOCK_NAME
    step = Trainer.train_step

    def step_then_suspended_past_the_staleness(self):
        metrics = step(self)
        if self.step == 3:
            _take_over(lock_path)
        return metrics

    monkeypatch.setattr(Trainer, "train_step", step_then_suspended_past_the_staleness)
    assert train(tmp_path, out_dir, steps=6, checkpoint_every=2, keep_last=5) == EXIT_RUN_FAILED
    line = one_error(capsys)
    assert f"out_dir {out_dir} was taken over by another run (host another-node, pid 4242)" in line, line
    assert "stopped at step 4 without writing a checkpoint" in line, line
    assert [s for s, _ in list_checkpoints(out_dir / "checkpoints")] == [2]
    assert json.loads(lock_path.read_text()) == OTHER_RUN  # the new run's lock is left in place


def test_the_refresh_thread_does_not_refresh_a_lock_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr(moetrain.run_dir, "REFRESH_S", 0.02)
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert lock.lost() is None
        _take_over(lock.path)
        old = time.time() - 3600
        os.utime(lock.path, (old, old))
        deadline = time.monotonic() + 10
        while lock.lost(look=False) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "taken over by another run (host another-node, pid 4242)" in lock.lost(look=False)
        time.sleep(0.1)
        assert abs(lock.path.stat().st_mtime - old) < 1  # not refreshed by this run
    finally:
        lock.release()
    assert json.loads(lock.path.read_text()) == OTHER_RUN  # not deleted either


def test_a_deleted_lock_is_lost_and_not_recreated(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        lock.path.unlink()
        assert lock.lost() == f"out_dir {tmp_path}: the lock {lock.path} was deleted"
    finally:
        lock.release()
    assert not lock.path.exists()
