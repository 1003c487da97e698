"""Launch and fault handling, round 4 of the review (/tmp/review_launch):

- a rank that has stopped (pre-empted) ignores a later SIGTERM (srun ``--kill-on-bad-exit`` and
  torchrun send one to the ranks still running when the first exits): it still exits 75;
- ``moetrain launch`` that loses the rendezvous store once its ranks run says so in one line, and
  exits 75 when a rank reported a checkpoint;
- the watchdog's "behind" compares ``(step, progress)``: at the same step the slow rank (forward)
  does not blame the one waiting for it (backward);
- the c10d port check joins only a store holding this job's rendezvous (``--rdzv-id``);
- ``kill -9`` of the launcher stops its ranks (they checkpoint and exit) instead of leaving orphans;
- a rank the launcher SIGKILLs at the end of its shutdown timeout (a stopped rank) is named so.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.failures import EXIT_PREEMPTED, EXIT_RUN_FAILED, RunPosition
from moetrain.launch import LAUNCHER_PID, _ForcedKills, failure_line, report_to_launcher
from moetrain.watchdog import Watchdog, is_behind
from tests.faults.launch import ROOT, finish, start_ranks, tiny_config, write_config
from tests.helpers.dist_utils import free_port
from tests.unit.engine.test_watchdog import DictStore

LOCK = ".lock"


def _sleep_in_the_loss(victim: int, at_step: int, seconds: float) -> None:
    """A forked rank's ``prepare``: the process of RANK ``victim`` sleeps ``seconds`` in the loss of
    step ``at_step`` (its forward phase), with its watchdog thread beating; the others run as usual."""
    from moetrain.registry import get_model, register_model

    spec = get_model("moe_lm")
    original = spec.builder

    def builder(config, shard):
        model, batches, loss_fn = original(config, shard)
        calls = {"n": 0}

        def loss(logits, targets):
            calls["n"] += 1
            if int(os.environ["RANK"]) == victim and (calls["n"] - 1) // config.grad_accum + 1 == at_step:
                time.sleep(seconds)
            return loss_fn(logits, targets)

        return model, batches, loss

    register_model("moe_lm", spec.config_class, builder, describe=spec.describe, strategy=spec.strategy)


def _wait_for_metrics(path: Path, lines: int, procs, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() or len(path.read_text().splitlines()) < lines:
        assert time.monotonic() < deadline, f"no {lines} metrics lines in {timeout} s"
        assert all(p.poll() is None for p in procs), "a process ended before training"
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; its parent (gone) did not reap it yet
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def _kill_all(pids) -> None:
    for pid in pids:
        for sent in (signal.SIGKILL, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sent)


# ---- 1. a second SIGTERM after the stop ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_sigterm_after_the_stop_decision_does_not_kill_the_rank(tmp_path):
    """Both ranks (per-task, as srun starts them) get SIGTERM; from the moment the first one exits,
    the other gets SIGTERM again and again (srun --kill-on-bad-exit treats exit 75 as a bad exit and
    SIGTERMs the rest). Each still exits 75 (before: the last rank died of the SIGTERM, 143, after
    its handler had been restored on the way out), with out_dir's lock released and summary.json."""
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, log_every=5, dist_timeout_s=30))
    procs = start_ranks([config, config])
    try:
        _wait_for_metrics(out_dir / "metrics.jsonl", 4, procs)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 90
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                for proc in procs:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
            time.sleep(0.01)
    finally:
        results = finish(procs, timeout=30)
    assert [code for code, _ in results] == [EXIT_PREEMPTED, EXIT_PREEMPTED], results
    assert "SIGTERM: checkpoint saved at step" in results[0][1], results[0][1]
    assert not (out_dir / LOCK).exists()
    assert json.loads((out_dir / "summary.json").read_text())["preempted"] is True


# ---- 2. the store lost once the ranks run -------------------------------------------------------


def _launch_losing_the_store(tmp_path, monkeypatch, capsys, *, ranks_started: bool, checkpoint: bool):
    """``moetrain launch`` with torchrun replaced by what it does when the store goes: its ranks
    (stopped by its SIGTERM) have written their reply files, then the agent's store call raises."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    log_dir = tmp_path / "launch-logs"

    def torchrun(argv):
        if ranks_started:
            error_file = log_dir / "job_x" / "attempt_0" / "0" / "error.json"
            if checkpoint:
                monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
                report_to_launcher("SIGTERM: checkpoint saved at step 17", EXIT_PREEMPTED)
            else:
                error_file.parent.mkdir(parents=True)
        raise RendezvousConnectionError(
            "The connection to the C10d store has failed. See inner exception for details."
        )

    monkeypatch.setattr("torch.distributed.run.main", torchrun)
    monkeypatch.setenv(LAUNCHER_PID, "")  # main sets it for its ranks; restored after the test
    code = main(["launch", "--nproc-per-node", "1", "--log-dir", str(log_dir), "-m", "moetrain.cli"])
    lines = capsys.readouterr().err.strip().splitlines()
    return code, lines, log_dir / "launcher.log"


def test_a_store_lost_after_a_checkpoint_is_one_line_and_exit_75(tmp_path, monkeypatch, capsys):
    code, lines, detail = _launch_losing_the_store(
        tmp_path, monkeypatch, capsys, ranks_started=True, checkpoint=True
    )
    assert code == EXIT_PREEMPTED
    assert lines == [
        "moetrain: pre-empted: the launcher lost the rendezvous store (its host is gone?); "
        f"SIGTERM: checkpoint saved at step 17 (launcher detail: {detail})"
    ]
    assert "RendezvousConnectionError" in detail.read_text()  # the traceback went to the file


def test_a_store_lost_without_a_checkpoint_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    code, lines, detail = _launch_losing_the_store(
        tmp_path, monkeypatch, capsys, ranks_started=True, checkpoint=False
    )
    assert code == EXIT_RUN_FAILED
    assert lines == [
        "moetrain: error: the launcher lost the rendezvous store (its host is gone?); no rank reported "
        f"a checkpoint (launcher detail: {detail})"
    ]


def test_a_store_that_fails_before_any_rank_started_is_a_rendezvous_that_could_not_start(
    tmp_path, monkeypatch, capsys
):
    code, lines, _ = _launch_losing_the_store(
        tmp_path, monkeypatch, capsys, ranks_started=False, checkpoint=False
    )
    assert code == 1
    assert lines == [
        "moetrain: the launcher could not start the rendezvous: The connection to the C10d store has "
        "failed. See inner exception for details."
    ]


# ---- 3. behind: (step, progress), not the phase's name --------------------------------------------


def test_run_position_counts_phase_changes_within_a_step():
    position = RunPosition(rank=0, step=8, phase="checkpoint")
    assert position.progress == 0
    position.phase = "data loading"
    position.phase = "forward"
    position.phase = "forward"  # the same phase again: no change
    assert position.progress == 2
    position.phase = "backward"
    assert position.progress == 3
    position.step = 9
    assert position.progress == 0


def test_at_the_same_step_the_rank_in_forward_is_behind_the_rank_in_backward():
    backward = {"step": 8, "phase": "backward", "progress": 3}
    forward = {"step": 8, "phase": "forward", "progress": 2}
    assert is_behind(forward, (8, "backward", 3))
    assert not is_behind(backward, (8, "forward", 2))
    assert not is_behind(backward, (8, "backward", 3))
    assert is_behind({"step": 7, "phase": "optimizer step", "progress": 6}, (8, "data loading", 1))
    assert not is_behind({"step": None, "phase": "model set-up", "progress": 3}, (None, "start-up checks", 2))


def test_the_slow_rank_does_not_name_the_waiting_rank_as_behind():
    """Rank 1 is slow in forward at step 8; rank 0 waits for it in backward. Rank 1's look names
    rank 0 as ahead (no cause for its error line); rank 0's names rank 1 as behind."""
    store = DictStore()
    slow = RunPosition(rank=1, step=8, phase="checkpoint")
    slow.phase, slow.phase = "data loading", "forward"
    waiting = RunPosition(rank=0, step=8, phase="checkpoint")
    waiting.phase, waiting.phase, waiting.phase = "data loading", "forward", "backward"
    dogs = [
        Watchdog(store, rank, 2, position, interval_s=3600.0, stall_s=0.1).start()
        for rank, position in ((0, waiting), (1, slow))
    ]
    try:
        time.sleep(0.15)  # both have waited stall_s at their place
        for dog in dogs:
            dog._publish()  # a fresh heartbeat each: neither is silent
        for dog in dogs:
            dog.look_now()
        assert "behind: rank 1 (step 8, forward)" in dogs[0].reports[-1], dogs[0].reports
        assert waiting.stall == "rank 1 is behind at step 8, forward"
        assert dogs[1].reports and "behind" not in dogs[1].reports[-1], dogs[1].reports
        assert "ahead of it: rank 0 (step 8, backward)" in dogs[1].reports[-1]
        assert slow.stall is None
    finally:
        for dog in dogs:
            dog.stop()


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(150)
def test_a_slow_rank_logs_the_others_as_ahead_not_behind(tmp_path):
    """Real ranks (per-task): rank 1 sleeps 15 s in the forward of step 6 (stall_s = 10 s), rank 0
    waits for it in backward. Both look while they wait; rank 1 must not say rank 0 is behind."""
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=8, dist_timeout_s=20))
    procs = start_ranks([config, config], prepare=functools.partial(_sleep_in_the_loss, 1, 6, 15))
    results = finish(procs, timeout=120)
    assert [code for code, _ in results] == [0, 0], results
    logs = [(out_dir / "logs" / f"rank_{rank}.log").read_text() for rank in range(2)]
    assert "behind: rank 1 (step 6, forward)" in logs[0], logs[0]  # the look happened while it waited
    assert "behind: rank 0" not in logs[1], logs[1]
    assert "ahead of it: rank 0 (step 6, " in logs[1], logs[1]


# ---- 4. the c10d port check: only this job's store ----------------------------------------------


def _c10d_launch(port: int, run_id: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "moetrain.cli", "launch", "--nnodes", "1", "--nproc-per-node", "1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", "--no-python",
        sys.executable, "-c", "import os; print('rank', os.environ['RANK'])",
    ]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_another_jobs_store_on_the_port_is_refused_and_this_jobs_is_joined(tmp_path):
    """A store without this job's rendezvous (``--rdzv-id``) is another job's: refused with the
    one line, no rank started (before: joined, and the run ended when that job's store went). A
    store holding it (the first launcher of the same job on this host) is joined."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=30))
    C10dRendezvousBackend(store, "thisjob")  # what the launcher that created the store writes first
    refused = _c10d_launch(port, "otherjob")
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "moetrain: the launcher could not start the rendezvous: the rendezvous port is already in use "
        "(another job?): choose a free --master-port / --rdzv-endpoint port"
    ]
    assert "rank" not in refused.stdout
    joined = _c10d_launch(port, "thisjob")
    assert joined.returncode == 0 and "rank 0" in joined.stdout, joined.stderr


# ---- 5. kill -9 of the launcher -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_ranks_stop_when_their_launcher_is_killed(tmp_path):
    """``kill -9`` of ``moetrain launch``: its ranks get SIGTERM from the kernel (PR_SET_PDEATHSIG),
    checkpoint and exit, releasing out_dir (before: they trained on as orphans, holding the lock)."""
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, log_every=5, dist_timeout_s=30))
    command = [
        sys.executable, "-m", "moetrain.cli", "launch", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "--log-dir", str(tmp_path / "launch-logs"),
        "-m", "moetrain.cli", "train", "--config", str(config),
    ]  # fmt: skip
    with open(tmp_path / "launcher.err", "w") as err:  # the orphans would hold a pipe open
        launcher = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=err, stderr=err
        )
    ranks = []
    try:
        _wait_for_metrics(out_dir / "metrics.jsonl", 4, [launcher])
        ranks = _children(launcher.pid)
        assert len(ranks) == 2, ranks
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), (tmp_path / "launcher.err").read_text()[-3000:]
    finally:
        launcher.kill()
        _kill_all(ranks)
    assert not (out_dir / LOCK).exists()
    assert json.loads((out_dir / "summary.json").read_text())["preempted"] is True


# ---- 6. a rank the launcher killed after its shutdown timeout -----------------------------------


def _failure(exitcode, record=None, message=None, pid=100, timestamp=0):
    from types import SimpleNamespace

    data = {} if record is None else {"message": message, "timestamp": timestamp, "moetrain": record}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data, pid=pid, timestamp=timestamp)


def test_a_rank_the_launcher_killed_at_its_shutdown_timeout_is_named_so():
    forced = _ForcedKills()
    logger = logging.getLogger("test_launch_round4.torch")
    logger.addHandler(forced)
    try:  # torchrun's own warning, as torch.distributed.elastic.multiprocessing.api logs it
        logger.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 42, 15, 9)
    finally:
        logger.removeHandler(forced)
    assert forced.pids == {42}
    lost = {"exit_code": 1, "time": 1.0, "caused_by_others": True}
    said = "rank 0, step 8, backward: rank 1 stopped making progress at step 8 (last heard 13 s ago); E: x"
    failures = {0: _failure(1, lost, said), 1: _failure(-9, pid=42, timestamp=5)}
    assert failure_line(failures, frozenset(forced.pids)) == (
        "moetrain: error: rank 1 (pid 42) stopped responding and was killed by the launcher (SIGKILL) "
        f"after its shutdown timeout; rank 0 said: {said}",
        EXIT_RUN_FAILED,
    )
    assert failure_line(failures)[0].startswith("moetrain: error: rank 1 (pid 42) was killed by signal 9")
    # a rank killed by something else (the OOM killer) comes first: the launcher's kill came after it
    failures[2] = _failure(-9, pid=43, timestamp=9)
    assert failure_line(failures, frozenset({42}))[0].startswith(
        "moetrain: error: rank 2 (pid 43) was killed by signal 9 (SIGKILL)"
    )


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_stopped_rank_killed_by_the_launcher_is_named_so(tmp_path):
    """``kill -STOP`` of rank 1 under ``moetrain launch``: rank 0 times out (dist_timeout_s), the
    launcher SIGTERMs rank 1, which cannot act on it, and SIGKILLs it 30 s later (torchrun's fixed
    wait after a rank failed; ``--shutdown-timeout`` is for the launcher's own signal)."""
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, log_every=5, dist_timeout_s=10))
    command = [
        sys.executable, "-m", "moetrain.cli", "launch", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "--log-dir", str(tmp_path / "launch-logs"),
        "-m", "moetrain.cli", "train", "--config", str(config),
    ]  # fmt: skip
    launcher = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ranks = []
    try:
        _wait_for_metrics(out_dir / "metrics.jsonl", 4, [launcher])
        ranks = _children(launcher.pid)
        rank_1 = [pid for pid in ranks if b"RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()]
        assert len(rank_1) == 1, ranks
        os.kill(rank_1[0], signal.SIGSTOP)
        _, err = launcher.communicate(timeout=100)
    finally:
        launcher.kill()
        _kill_all(ranks)
    assert launcher.returncode == EXIT_RUN_FAILED, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"moetrain: error: rank 1 (pid {rank_1[0]}) stopped responding and was killed by the launcher "
        "(SIGKILL) after its shutdown timeout; rank 0 said: rank 0, step "
    ), last
    assert "rank 1 stopped making progress" in last, last
