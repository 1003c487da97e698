"""The output directory of a run (``out_dir``): checks before anything is written, one run at a time,
and every config the run was trained with.

- :func:`check_out_dir` (every rank, before anything is written): ``out_dir`` must not be a file;
  with ``resume: false`` it must hold no checkpoint (a new run would overwrite the old run's
  metrics and config, and its checkpoints would be mixed with the old ones).
- :class:`RunLock` (rank 0): ``out_dir/.lock`` created exclusively, holding the host, pid and start
  time of the run that owns the directory; refreshed every ``REFRESH_S`` seconds while it runs. A
  second run is refused naming the owner. A lock is stale, and taken over with a warning, when its
  process is gone (same host) or it was not refreshed for ``STALE_S`` seconds (any host). The
  takeover is atomic: of runs that find one stale lock at once, one takes it and the others are
  refused. A run whose lock was taken over (it was suspended for longer than ``STALE_S``) or deleted
  finds out (:meth:`RunLock.lost`): it never refreshes nor deletes another run's lock, and the engine
  stops it before it writes another checkpoint.
- :func:`record_config` (rank 0): ``config.json`` is the config now in use; ``config_history.jsonl``
  gets one line per start: the step it starts at, what changed from the config saved in the
  checkpoint it resumes from, and the whole config.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from moetrain.validation import is_int

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
REFRESH_S = 60.0
STALE_S = 600.0


def _parse_holder(content: bytes) -> dict[str, Any]:
    """The run a lock file names (``{}`` when it is empty or not a JSON object)."""
    try:
        holder = json.loads(content.decode("utf-8"))
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _pid_max() -> int:
    """The largest process id this system gives (``/proc/sys/kernel/pid_max``; 2**22 when unreadable)."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 2**22


def _is_pid(value: Any) -> bool:
    """Whether ``value`` can be a process id (an integer in 1..pid_max): 0 and -1 would make
    ``os.kill`` signal a process group or every process, and a huge one overflows it."""
    return is_int(value) and 0 < value <= _pid_max()


def _identity(status: os.stat_result, content: bytes) -> tuple:
    """Tells one lock file from another: its inode and what it holds (a refresh changes neither)."""
    return status.st_dev, status.st_ino, content


def check_out_dir(out_dir: str | os.PathLike, resume: bool) -> None:
    """Raises ``ValueError`` (one line naming the path) when ``out_dir`` cannot take this run."""
    from moetrain.checkpoint import list_checkpoints

    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"out_dir {path} is a file, not a directory: give a directory path")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"out_dir {path}: {parent} is a file, not a directory")
    if not resume:
        found = list_checkpoints(path / "checkpoints")
        if found:
            raise ValueError(
                f"out_dir {path} already holds checkpoints (latest: step {found[-1][0]}) and resume is "
                "false: use another out_dir, set resume: true to continue that run, or delete its checkpoints"
            )


class RunLock:
    """``out_dir/.lock``: one run per output directory (see the module docstring)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / LOCK_NAME
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None

    def acquire(self) -> None:
        """Takes the lock or raises ``ValueError`` naming the run that holds it. A stale lock is taken
        over atomically: of several starters that judge it stale at once, one takes it and the others
        are refused as by a live lock (see :meth:`_take_over`)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            if self._create():
                return
            judged = self._judge()
            if judged is None:
                continue  # released since the create failed: try again
            holder, stale, seen = judged
            if stale is None:
                raise self._in_use(holder)
            log.log(
                logging.DEBUG if "this process" in stale else logging.WARNING,
                "taking over the stale lock %s (%s)", self.path, stale,
            )  # fmt: skip
            aside = self._take_over(seen)
            try:
                if self._create():
                    return
            finally:  # only now: while the stale file exists, the new one cannot get its inode
                with contextlib.suppress(FileNotFoundError):
                    aside.unlink()
            raise self._in_use(self._read_holder())  # another starter created it after the takeover
        raise ValueError(f"out_dir {self.path.parent}: could not take the lock {self.path}")

    def _create(self) -> bool:
        """Creates the lock exclusively, writes this run into it and starts refreshing it; False when a
        lock file is there already."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            json.dump(self.owner, stream)
        self._thread = threading.Thread(target=self._refresh, name="moetrain-lock", daemon=True)
        self._thread.start()
        return True

    def _in_use(self, holder: dict[str, Any]) -> ValueError:
        return ValueError(
            f"out_dir {self.path.parent} is in use by another run (host {holder.get('host')}, "
            f"pid {holder.get('pid')}, lock {self.path}); use another out_dir, or delete the "
            "lock if that run is gone"
        )

    def _judge(self) -> tuple[dict[str, Any], str | None, tuple] | None:
        """``(holder, why it is stale or None, what was seen)`` of the lock file there now, or None
        when there is none. What was seen (inode, content) tells this file from a later one."""
        try:
            with open(self.path, "rb") as stream:
                status, content = os.fstat(stream.fileno()), stream.read()
        except FileNotFoundError:
            return None
        holder = _parse_holder(content)
        return holder, self._stale_reason(holder, time.time() - status.st_mtime), _identity(status, content)

    def _take_over(self, seen: tuple) -> Path:
        """Moves the stale lock judged from ``seen`` aside and returns where to (the caller creates the
        new lock, then deletes it), or raises ``ValueError`` (in use) when another starter took it
        over first. The lock is renamed to a name of this process's own: a rename is atomic, so one
        starter moves the stale lock and the others find it gone. A starter that judged it stale late
        may move the new lock of the one that took over: it sees that the file it moved is not the one
        it judged, and puts it back."""
        aside = self.path.with_name(f"{LOCK_NAME}.{uuid.uuid4().hex}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            raise self._in_use(self._read_holder()) from None
        try:
            with open(aside, "rb") as stream:
                status, content = os.fstat(stream.fileno()), stream.read()
            moved = _identity(status, content)
        except OSError:
            moved = None
        if moved != seen:
            os.rename(aside, self.path)  # another starter's new lock: back to its place
            raise self._in_use(self._read_holder())
        return aside

    def _read_holder(self) -> dict[str, Any]:
        try:
            return _parse_holder(self.path.read_bytes())
        except OSError:
            return {}

    def _stale_reason(self, holder: dict[str, Any], age: float) -> str | None:
        """Why the lock held by ``holder``, last refreshed ``age`` seconds ago, is stale, or None when its
        run may be alive."""
        if age > STALE_S:
            return f"not refreshed for {age:.0f} s"
        if holder.get("host") == self.owner["host"] and holder.get("pid") == self.owner["pid"]:
            return "held by this process (an earlier run in it that was not closed)"
        if not _is_pid(holder.get("pid")):
            return "unreadable" if age > 5 else None
        if holder.get("host") == self.owner["host"]:
            try:
                os.kill(holder["pid"], 0)
            except ProcessLookupError:
                return f"process {holder['pid']} on this host is gone"
            except (PermissionError, OverflowError):
                return None
        return None

    def lost(self, look: bool = True) -> str | None:
        """None while the lock file still names this run; else one line saying who holds ``out_dir``
        now (a run that found this one's lock stale: this process was suspended for longer than
        ``STALE_S``) or that the lock was deleted. ``look=False`` answers from the last look (the
        refresh thread looks every ``REFRESH_S``) without reading the file. Once lost, always lost."""
        if self._lost is None and look:
            try:
                holder = _parse_holder(self.path.read_bytes())
            except FileNotFoundError:
                holder = None
            except OSError:  # unreadable for now (a network file system's hiccup): judged next time
                return None
            if holder is None or not self._is_ours(holder):
                self._lost = (
                    f"out_dir {self.path.parent}: the lock {self.path} was deleted"
                    if holder is None
                    else f"out_dir {self.path.parent} was taken over by another run (host "
                    f"{holder.get('host')}, pid {holder.get('pid')}) while this one did not refresh its lock "
                    f"for {STALE_S:.0f} s (suspended?)"
                )
                log.error("%s: this run stops before it writes another checkpoint", self._lost)
        return self._lost

    def _is_ours(self, holder: dict[str, Any]) -> bool:
        return all(holder.get(key) == value for key, value in self.owner.items())

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            if self.lost() is not None:
                return  # never refreshes another run's lock
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Stops refreshing and deletes the lock file when it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
            if self._is_ours(self._read_holder()):
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"optim.lr": 0.001, ...}`` of nested dicts (lists and tuples are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_changes(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, current value)}`` of the keys that differ."""
    old, new = flatten(saved), flatten(current)
    normalise = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - JSON has no tuples
    return {
        key: (old.get(key), new.get(key))
        for key in sorted(set(old) | set(new))
        if normalise(old.get(key)) != normalise(new.get(key))
    }


def record_config(out_dir: str | os.PathLike, config: dict, step: int, changes: dict | None) -> None:
    """Writes ``config.json`` (the config in use) and appends this start to ``config_history.jsonl``
    (``changes``: None for a new run, else the differences from the resumed checkpoint's config)."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    temporary = path / "config.json.tmp"
    temporary.write_text(json.dumps(config, indent=2, default=str), encoding="utf-8")
    os.replace(temporary, path / "config.json")
    record = {
        "step": step,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "changes": None if changes is None else {k: {"was": a, "now": b} for k, (a, b) in changes.items()},
        "config": config,
    }
    with open(path / "config_history.jsonl", "a", encoding="utf-8") as stream:
        stream.write(json.dumps(record, default=str) + "\n")
