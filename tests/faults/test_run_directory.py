"""Faults of the run directory: a full disk during a save (a real full tmpfs as root; anywhere, a
file layer that runs out of room), a kill while pruning, ``resume: false`` over an existing run,
two runs in one ``out_dir`` (a live lock, a dead one, an old one, two runs that find one stale lock
at once), a corrupt newest checkpoint, changed settings on resume. Each through ``moetrain train`` as
users run it (in-process, one rank), but the race for a stale lock (``RunLock`` in two processes)."""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from moetrain.checkpoint import list_checkpoints
from moetrain.cli import main
from moetrain.logs import detach_handlers
from moetrain.run_dir import LOCK_NAME, STALE_S, RunLock
from tests.faults.launch import error_lines, tiny_config, write_config


def train_file(config: Path, *args: str) -> int:
    """``moetrain train --config config *args`` in this process; its exit code."""
    try:
        return main(["train", "--config", str(config), *args])
    finally:
        detach_handlers()


def train(tmp_path: Path, out_dir: Path, *args: str, **overrides) -> int:
    name = f"config-{len(list(tmp_path.glob('config-*')))}.json"
    return train_file(write_config(tmp_path, tiny_config(out_dir, **overrides), name), *args)


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (root only): room for a few tiny checkpoints, not for a big one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_save_is_one_line_and_earlier_checkpoints_survive(tmp_path, small_disk, capsys):
    out_dir = small_disk / "run"
    assert train(tmp_path, out_dir, steps=2, checkpoint_every=1, keep_last=5) == 0
    before = [step for step, _ in list_checkpoints(out_dir / "checkpoints")]
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "ballast").write_bytes(b"\0" * (free - 200_000))  # less room than one checkpoint
    capsys.readouterr()
    assert train(tmp_path, out_dir, steps=4, checkpoint_every=1, keep_last=5) == 1  # a run failure
    line = one_error(capsys)
    assert "checkpoint step 3 could not be written to" in line and "no space left on device" in line, line
    assert [step for step, _ in list_checkpoints(out_dir / "checkpoints")] == before == [1, 2]
    assert not list((out_dir / "checkpoints").glob("*.tmp"))
    (small_disk / "ballast").unlink()
    assert train(tmp_path, out_dir, steps=4, checkpoint_every=1, keep_last=5) == 0  # space again: resumes


class FullDisk:
    """DCP's file layer on a disk with ``room`` bytes left: files are created for real, and a write
    beyond the room writes what fits and raises ``OSError(ENOSPC)`` naming the file, as a full disk
    does. ``create_stream`` replaces ``FileSystem.create_stream`` (no root, no tmpfs needed)."""

    def __init__(self, original, room: int):
        self.original, self.room, self.paths = original, room, []

    def create_stream(self, fs, path, mode):
        disk = self

        class Stream:
            def __init__(self, stream):
                self._stream = stream

            def write(self, data) -> int:
                size = memoryview(data).nbytes
                if size > disk.room:
                    self._stream.write(memoryview(data).cast("B")[: disk.room])
                    disk.room = 0
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                disk.room -= size
                return self._stream.write(data)

            def __getattr__(self, name):
                return getattr(self._stream, name)

        disk.paths.append(Path(path))
        with self.original(fs, path, mode) as stream:
            yield Stream(stream) if "w" in mode else stream


def test_a_full_disk_during_a_save_without_root(tmp_path, capsys, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=2, checkpoint_every=1, keep_last=5) == 0
    before = [step for step, _ in list_checkpoints(out_dir / "checkpoints")]
    disk = FullDisk(FileSystem.create_stream, room=4096)  # less than one checkpoint
    monkeypatch.setattr(FileSystem, "create_stream", contextlib.contextmanager(disk.create_stream))
    capsys.readouterr()
    assert train(tmp_path, out_dir, steps=4, checkpoint_every=1, keep_last=5) == 1  # a run failure
    line = one_error(capsys)
    tmp_dir = out_dir / "checkpoints" / "step_00000003.tmp"
    assert f"checkpoint step 3 could not be written to {tmp_dir}: no space left on device ({tmp_dir}/" in line
    assert disk.paths and disk.room == 0  # the save did run into the full disk
    assert [step for step, _ in list_checkpoints(out_dir / "checkpoints")] == before == [1, 2]
    assert not list((out_dir / "checkpoints").glob("*.tmp"))  # the partial files were removed
    monkeypatch.undo()
    assert train(tmp_path, out_dir, steps=4, checkpoint_every=1, keep_last=5) == 0  # room again: resumes
    assert [step for step, _ in list_checkpoints(out_dir / "checkpoints")] == [1, 2, 3, 4]


def test_a_kill_while_pruning_is_finished_off_at_the_next_start(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=3, checkpoint_every=1, keep_last=5) == 0
    checkpoints = out_dir / "checkpoints"
    os.replace(checkpoints / "step_00000001", checkpoints / "step_00000001.deleting")  # killed mid-prune
    (checkpoints / "step_00000002" / "manifest.json").unlink()  # an older half-deleted one
    assert [s for s, _ in list_checkpoints(checkpoints)] == [3]
    assert train(tmp_path, out_dir, steps=4, checkpoint_every=1, keep_last=5) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000003", "step_00000004"]


def test_resume_false_over_an_existing_run_fails_before_touching_anything(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=2) == 0
    snapshot = {p: p.read_bytes() for p in out_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert train(tmp_path, out_dir, steps=4, resume=False) == 2
    line = one_error(capsys)
    assert f"out_dir {out_dir} already holds checkpoints (latest: step 2) and resume is false" in line
    assert {p: p.read_bytes() for p in out_dir.rglob("*") if p.is_file()} == snapshot


def test_a_second_run_in_the_same_out_dir_is_refused_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    other = subprocess.Popen(["sleep", "60"])  # a live process on this host holds the lock
    try:
        lock = {"host": socket.gethostname(), "pid": other.pid, "started": 0}
        (out_dir / LOCK_NAME).write_text(json.dumps(lock))
        assert train(tmp_path, out_dir, steps=2) == 2
        line = one_error(capsys)
        assert (
            f"out_dir {out_dir} is in use by another run (host {socket.gethostname()}, pid {other.pid}"
            in line
        )
        assert not (out_dir / "metrics.jsonl").exists() and not (out_dir / "checkpoints").exists()
    finally:
        other.kill()
        other.wait()
    assert train(tmp_path, out_dir, steps=2) == 0  # its process is gone: a stale lock, taken over
    assert "taking over the stale lock" in capsys.readouterr().err
    assert not (out_dir / LOCK_NAME).exists()  # released at the end


def test_a_lock_not_refreshed_for_stale_s_is_taken_over_whatever_its_host(tmp_path, capsys):
    """A lock from another host cannot be checked by its pid: it is live while its run refreshes it
    (every REFRESH_S), stale once it is older than STALE_S."""
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    lock = out_dir / LOCK_NAME
    lock.write_text(json.dumps({"host": "another-node", "pid": 1, "started": 0}))
    assert train(tmp_path, out_dir, steps=2) == 2  # just written: its run may be alive on that host
    assert f"out_dir {out_dir} is in use by another run (host another-node, pid 1" in one_error(capsys)
    assert lock.exists() and not (out_dir / "checkpoints").exists()
    old = time.time() - STALE_S - 30
    os.utime(lock, (old, old))
    assert train(tmp_path, out_dir, steps=2) == 0
    err = capsys.readouterr().err
    age = re.search(rf"taking over the stale lock {re.escape(str(lock))} \(not refreshed for (\d+) s\)", err)
    assert age and STALE_S < int(age.group(1)) < STALE_S + 60, err
    assert not lock.exists()  # released at the end


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _start_together(out_dir: Path, together, results) -> None:
    """One of two starters: tries to take the lock when the other does, reports, and stays alive until
    the other has tried too (a lock naming a finished process would be stale)."""
    lock = RunLock(out_dir)
    together.wait()
    try:
        lock.acquire()
        results.put("took")
    except ValueError:
        results.put("refused")
    together.wait()


def test_two_runs_that_find_one_stale_lock_at_once_do_not_both_take_it(tmp_path):
    """Both judge the lock stale; before, the second one's takeover deleted the first one's new lock
    and both ran (in most of these trials)."""
    context = multiprocessing.get_context("fork")  # fast: the starters only need the lock's code
    host, dead = socket.gethostname(), _dead_pid()
    outcomes = []
    for trial in range(40):
        out_dir = tmp_path / str(trial)
        out_dir.mkdir()
        (out_dir / LOCK_NAME).write_text(json.dumps({"host": host, "pid": dead, "started": 0}))
        together, results = context.Barrier(2, timeout=30), context.Queue()
        starters = [context.Process(target=_start_together, args=(out_dir, together, results)) for _ in "ab"]
        for starter in starters:
            starter.start()
        outcomes.append(sorted(results.get(timeout=30) for _ in starters))
        for starter in starters:
            starter.join(timeout=30)
        assert json.loads((out_dir / LOCK_NAME).read_text())["pid"] in [s.pid for s in starters]
        assert sorted(p.name for p in out_dir.iterdir()) == [LOCK_NAME]  # nothing left aside
    both = outcomes.count(["took", "took"])
    assert outcomes == [["refused", "took"]] * len(outcomes), f"both took it in {both} of {len(outcomes)}"


def test_a_run_that_judged_a_lock_stale_after_another_took_it_over_is_refused(tmp_path, monkeypatch):
    """The late starter moves the other's new lock aside, sees it is not the lock it judged stale,
    puts it back and is refused."""
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    lock, host = out_dir / LOCK_NAME, socket.gethostname()
    lock.write_text(json.dumps({"host": host, "pid": _dead_pid(), "started": 0}))
    winner = {"host": host, "pid": os.getppid(), "started": time.time()}  # a live process
    judge = RunLock._judge

    def judged_then_taken_over(self):
        judged = judge(self)
        lock.unlink()  # the other starter's takeover, between this one's judging and its own
        lock.write_text(json.dumps(winner))
        return judged

    monkeypatch.setattr(RunLock, "_judge", judged_then_taken_over)
    refused = rf"is in use by another run \(host {re.escape(host)}, pid {winner['pid']},"
    with pytest.raises(ValueError, match=refused):
        RunLock(out_dir).acquire()
    assert json.loads(lock.read_text()) == winner
    assert sorted(p.name for p in out_dir.iterdir()) == [LOCK_NAME]


def test_a_corrupt_newest_checkpoint_names_the_intact_one_and_resume_from_picks_it(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=3, checkpoint_every=1, keep_last=5) == 0
    newest = out_dir / "checkpoints" / "step_00000003"
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-10])
    capsys.readouterr()
    assert train(tmp_path, out_dir, steps=5, keep_last=5) == 2
    line = one_error(capsys)
    assert data.name in line and "truncated" in line, line
    assert "step 2 is intact: resume from it with --resume-from 2 (or --resume-from latest-valid)" in line
    assert train(tmp_path, out_dir, "--resume-from", "latest-valid", steps=4, keep_last=5) == 0
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # step 3 redone from step 2
    assert train(tmp_path, out_dir, "--resume-from", "1", steps=2, keep_last=5) == 0
    assert train(tmp_path, out_dir, "--resume-from", "7", steps=9, keep_last=5) == 2
    assert "resume_from = 7: no complete checkpoint of that step" in one_error(capsys)


def test_changed_settings_on_resume_take_effect_and_every_config_is_kept(tmp_path):
    out_dir = tmp_path / "run"
    assert train(tmp_path, out_dir, steps=2, **{"optim.lr": 1e-3, "optim.warmup_steps": 0}) == 0
    assert train(tmp_path, out_dir, steps=4, **{"optim.lr": 0.5, "optim.warmup_steps": 0}) == 0
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[1]["lr"] <= 1e-3
    assert metrics[2]["lr"] == pytest.approx(0.5 * 0.55)  # the new lr, at step 3 of the new 4-step cosine
    log = (out_dir / "logs" / "rank_0.log").read_text()  # the command's INFO records, both runs
    changed = [line for line in log.splitlines() if "config changed since step 2" in line]
    assert len(changed) == 1 and "optim.lr 0.001 -> 0.5" in changed[0] and "steps 2 -> 4" in changed[0]
    history = [json.loads(line) for line in (out_dir / "config_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 2] and history[0]["changes"] is None
    assert history[1]["changes"]["optim.lr"] == {"was": 0.001, "now": 0.5}
    assert json.loads((out_dir / "config.json").read_text())["optim"]["lr"] == 0.5
