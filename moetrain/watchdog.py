"""Heartbeats: every rank says where it is; a rank that waits too long says who stopped.

When one rank stops (a hung data loader, a killed or stopped process, a deadlock), the others wait
in their next collective until ``dist_timeout_s`` and then fail with a transport error that names
no one. Here each rank's :class:`Watchdog` thread writes ``(step, phase, time)`` into the rendezvous
store every ``interval_s`` seconds. When its own rank has been in the same step and phase for
``stall_s`` seconds, it reads every rank's heartbeat (one ``multi_get``) and logs one error line
naming the ranks that are silent (no heartbeat for ``stall_s``: stopped or gone) or behind (an
earlier step or phase); when every rank is in the same place it only logs that they all wait there
(a long phase, not a fault). Until it has found a silent rank it looks again every ``stall_s / 2``
(a rank stopped just after this one started waiting is not yet silent at the first look), logging
again only when the finding changes. The finding is kept on the run's position
(``RunPosition.stall``) while the rank stays stuck, so the error line of the collective's timeout
names the cause (:func:`moetrain.failures.describe_failure`); a failing rank calls
:meth:`Watchdog.look_now` before it writes that line, as the timeout may come before the next
periodic look. Nothing is read while training makes progress.

Store traffic: one small ``set`` per rank every ``interval_s``; one ``multi_get`` of ``world`` keys
per rank every ``stall_s / 2`` of a stall, until a silent rank is found.
"""

from __future__ import annotations

import json
import logging
import threading
import time

log = logging.getLogger(__name__)


def _key(rank: int) -> str:
    return f"heartbeat/{rank}"


class Watchdog:
    """Publishes ``position`` (a :class:`moetrain.failures.RunPosition`) and reports stalls."""

    def __init__(self, store, rank: int, world_size: int, position, interval_s: float, stall_s: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.position = position
        self.interval_s, self.stall_s = interval_s, stall_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moetrain-watchdog", daemon=True)
        self._lock = threading.Lock()  # the thread and look_now() share where/since/finding
        self._seen, self._since, self._finding = None, time.monotonic(), None
        self.reports: list[str] = []

    def start(self) -> Watchdog:
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)

    def _where(self) -> tuple:
        return (self.position.step, self.position.phase)

    def _publish(self) -> None:
        step, phase = self._where()
        self.store.set(_key(self.rank), json.dumps({"step": step, "phase": phase, "time": time.time()}))

    def _run(self) -> None:
        with self._lock:
            self._seen, self._since = self._where(), time.monotonic()
        next_look = self.stall_s
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
                with self._lock:
                    now_where = self._where()
                    waited = time.monotonic() - self._since
                    if now_where != self._seen:
                        next_look = self.stall_s
                        self._seen, self._since, self._finding = now_where, time.monotonic(), None
                        self.position.stall = None
                    elif self._finding != "silent" and waited >= next_look:
                        self._finding = self._report(now_where, waited, self._finding)
                        next_look = waited + self.stall_s / 2
            except Exception as error:  # noqa: BLE001 - the store may be gone at shutdown
                log.debug("watchdog: %s", error)
                if self._stop.is_set():
                    return

    def look_now(self) -> None:
        """Reads every heartbeat now if this rank has been in the same place for ``stall_s`` or
        more and no silent rank is known yet, so ``position.stall`` names the cause when a failing
        collective's error line is written before the next periodic look."""
        with self._lock:
            waited = time.monotonic() - self._since
            if self._where() == self._seen and self._finding != "silent" and waited >= self.stall_s:
                try:
                    self._finding = self._report(self._where(), waited, self._finding)
                except Exception as error:  # noqa: BLE001 - the store may be gone
                    log.debug("watchdog: %s", error)

    def _report(self, where: tuple, waited_s: float, previous: str | None = None) -> str:
        """Reads every heartbeat; logs (unless the finding is ``previous`` again) and returns the
        finding: ``"silent"``, ``"behind"`` or ``"waiting"`` (every rank at the same place)."""
        keys = [_key(r) for r in range(self.world_size)]
        beats = self.store.multi_get(keys)
        now = time.time()
        silent, behind, causes, lagging = [], [], [], []
        for rank, raw in enumerate(beats):
            if rank == self.rank:
                continue
            try:
                beat = json.loads(bytes(raw).decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                silent.append(f"rank {rank} (no heartbeat)")
                causes.append(f"rank {rank} never sent a heartbeat")
                continue
            age = now - beat["time"]
            place = f"step {beat['step']}, {beat['phase']}"
            if age >= self.stall_s:
                silent.append(f"rank {rank} (last heard {age:.0f} s ago at {place})")
                causes.append(f"rank {rank} stopped making progress at {place} (last heard {age:.0f} s ago)")
            elif (beat["step"], beat["phase"]) != where and (beat["step"] or 0) <= (where[0] or 0):
                behind.append(f"rank {rank} ({place})")
                lagging.append(f"rank {rank} is behind at {place}")
        here = f"step {where[0]}, {where[1]}"
        finding = "silent" if silent else "behind" if behind else "waiting"
        if silent or behind:
            parts = [f"rank {self.rank} has waited {waited_s:.0f} s at {here}"]
            if silent:
                parts.append(f"stopped or gone: {_first(silent)}")
            if behind:
                parts.append(f"behind: {_first(behind)}")
            line = "; ".join(parts)
            if finding != previous:
                log.error("%s", line)
            self.position.stall = _first(causes + lagging)
        else:
            line = f"rank {self.rank}: every rank has been at {here} for {waited_s:.0f} s (a long phase)"
            if finding != previous:
                log.info("%s", line)
        self.reports.append(line)
        return finding


def _first(items: list[str], shown: int = 8) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
