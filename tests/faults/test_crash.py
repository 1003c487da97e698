"""Fault: a rank crashes (``kill -9``: also a segfault or the OOM killer) in a run of 2 and of 4
ranks started srun-style (issue 27). The survivors' collectives fail at once with "Connection closed
by peer" (or, waiting on another survivor, time out after ``dist_timeout_s``); before its error line
each survivor reads the heartbeats and names the rank whose heartbeat stopped without saying it
ended. Rank 0 serves the rendezvous store under this launch: when it is the one killed, the store is
gone with it and the survivors say so; when another one is, rank 0 stays until the other survivors
have looked. (A stopped rank, ``kill -STOP``, is found the same way: test_distributed.py.)"""

from __future__ import annotations

import time

import pytest

from moetrain.failures import EXIT_RUN_FAILED
from tests.faults.launch import error_lines, finish, start_ranks, tiny_config, write_config

CASES = [(2, 0), (2, 1), (4, 0), (4, 2), (4, 3), (4, 1)]


@pytest.mark.parametrize("world,victim", CASES, ids=[f"world{w}-kill{v}" for w, v in CASES])
@pytest.mark.timeout(240)
def test_a_killed_rank_is_named_by_every_survivor(tmp_path, world, victim):
    out_dir = tmp_path / "run"
    # dist_timeout_s 12: heartbeats every 1.5 s; a survivor waits 3.5 s before it reads them
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, log_every=5, dist_timeout_s=12))
    procs = start_ranks([config] * world)
    try:
        metrics = out_dir / "metrics.jsonl"
        deadline = time.monotonic() + 150  # 4 ranks start slowly on a loaded machine
        while time.monotonic() < deadline and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < 2
        ):
            time.sleep(0.2)
        assert metrics.exists(), "the run did not start"
        time.sleep(2)  # every watchdog has published a training step
        procs[victim].kill()  # SIGKILL
        killed_at = time.monotonic()
        survivors = [p for rank, p in enumerate(procs) if rank != victim]
        results = finish(survivors, timeout=40)
        elapsed = time.monotonic() - killed_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    cause = (
        "rank 0 is gone (it served the rendezvous store, which no longer answers)"
        if victim == 0
        else f"rank {victim} stopped making progress at step "
    )
    ranks = [rank for rank in range(world) if rank != victim]
    for rank, (code, err) in zip(ranks, results, strict=True):
        lines = error_lines(err)
        assert code == EXIT_RUN_FAILED and len(lines) == 1, err
        assert lines[0].startswith(f"moetrain: error: rank {rank}, step "), lines
        assert cause in lines[0], lines
        others = [r for r in ranks if r != rank]
        assert not any(f"rank {r} stopped making" in lines[0] for r in others), lines  # no survivor named
    assert elapsed < 30, elapsed  # not the collective timeout: the connection loss, then one look


SET_UP_CASES = [(2, 1), (2, 0), (3, 1)]


@pytest.mark.parametrize("world,victim", SET_UP_CASES, ids=[f"world{w}-kill{v}" for w, v in SET_UP_CASES])
@pytest.mark.timeout(240)
def test_a_rank_killed_during_set_up_is_named_by_every_survivor(tmp_path, world, victim):
    """A rank SIGKILLed in the model builder (set-up, its watchdog started): each survivor's set-up
    collective fails, and its line names the killed rank as in training (set-up used to release
    the watchdog before the line was written: the line said only "Connection closed by peer")."""
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, log_every=5, dist_timeout_s=12))
    procs = start_ranks([config] * world, faults={victim: f"kill9-setup@{victim}"})
    try:
        results = finish(procs, timeout=150)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert results[victim][0] == -9, results[victim]
    cause = (
        "rank 0 is gone (it served the rendezvous store, which no longer answers)"
        if victim == 0
        else f"rank {victim} stopped making progress"
    )
    for rank, (code, err) in enumerate(results):
        if rank == victim:
            continue
        lines = error_lines(err)
        assert code == EXIT_RUN_FAILED and len(lines) == 1, err
        assert lines[0].startswith(f"moetrain: error: rank {rank}, "), lines
        assert cause in lines[0], lines
        assert "killed or crashed?" in lines[0] or victim == 0, lines
        survivors = [r for r in range(world) if r not in (rank, victim)]
        assert not any(f"rank {r} stopped making" in lines[0] for r in survivors), lines
    assert not (out_dir / "metrics.jsonl").exists()  # set-up, not training
