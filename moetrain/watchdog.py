"""Heartbeats: every rank says where it is; a rank that waits too long, or loses a connection,
says who stopped.

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
periodic look.

A crashed rank (``kill -9``, a segfault, the OOM killer) closes its connections: the others fail
at once with "Connection closed by peer", long before any stall. ``look_now(error)`` with such an
error first marks this rank's heartbeat as ended (so that the others do not take it for the crashed
one once it exits), waits until every live rank has beaten since this rank saw the connection go
(``interval_s`` plus a margin), then reads the heartbeats once: a rank whose heartbeat stopped,
without saying it ended, is the one that crashed. Ranks that end (an error of their own, or
:meth:`stop`) say so in their last heartbeat. When the store itself is gone (served by rank 0 under
a per-task launch), rank 0 is gone and the line says so; so that rank 0's own exit does not take
the store away from survivors still to look, rank 0, when it serves the store, stays after its own
line until every other live rank has looked or ended (:meth:`keep_store_for_the_others`). A
survivor waiting on another survivor (not on the crashed rank) fails when that one exits, or times
out (``dist_timeout_s``, twice ``stall_s``): its stall look then names the crashed rank first among
the silent ones.

A heartbeat's step can be old (steps are faster than ``interval_s``), so a finding names the step
the run had reached (this rank's) and the silent rank's last heartbeat beside it.

Store traffic: one small ``set`` per rank every ``interval_s``; one ``multi_get`` of ``world`` keys
per rank every ``stall_s / 2`` of a stall, until a silent rank is found, and once per failing rank
after a lost connection.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time

log = logging.getLogger(__name__)


def _key(rank: int) -> str:
    return f"heartbeat/{rank}"


class Watchdog:
    """Publishes ``position`` (a :class:`moetrain.failures.RunPosition`) and reports stalls and
    crashed ranks. ``store_served_by``: the rank whose process serves the store (0 under a per-task
    launch; None when a launcher's agent serves it), named when the store cannot be reached."""

    def __init__(
        self, store, rank: int, world_size: int, position, interval_s: float, stall_s: float,
        store_served_by: int | None = None,
    ):  # fmt: skip
        self.store, self.rank, self.world_size = store, rank, world_size
        self.position = position
        self.interval_s, self.stall_s = interval_s, stall_s
        self.store_served_by = store_served_by
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moetrain-watchdog", daemon=True)
        self._lock = threading.Lock()  # the thread and look_now() share where/since/finding
        self._seen, self._since, self._finding = None, time.monotonic(), None
        self._ended: str | None = None  # "failed" / "stopped": said in every heartbeat from then on
        self._looked = False  # after a lost connection: this rank has read the heartbeats
        self.reports: list[str] = []

    @property
    def lost_margin_s(self) -> float:
        """After a lost connection: how much longer than ``interval_s`` a rank must be silent to be
        taken for crashed (the slack for a live rank's late heartbeat)."""
        return max(2.0, self.interval_s / 2)

    def start(self) -> Watchdog:
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread; the last heartbeat says this rank ended (unless it already did)."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        if self._ended is None:
            self._ended = "stopped"
            try:
                self._publish()
            except Exception as error:  # noqa: BLE001 - the store may be gone at shutdown
                log.debug("watchdog: %s", error)

    def _where(self) -> tuple:
        return (self.position.step, self.position.phase)

    def _publish(self) -> None:
        step, phase = self._where()
        beat = {"step": step, "phase": phase, "time": time.time()}
        if self._ended is not None:
            beat["ended"] = self._ended
        if self._looked:
            beat["looked"] = True
        self.store.set(_key(self.rank), json.dumps(beat))

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

    def look_now(self, error: BaseException | None = None) -> None:
        """Called by a failing rank before it writes its error line. ``error`` a lost connection
        (:func:`moetrain.failures.is_lost_connection`): names the rank that stopped beating (see
        the module docstring; waits up to ``interval_s + lost_margin_s``). Otherwise: reads every
        heartbeat now if this rank has been in the same place for ``stall_s`` or more and no silent
        rank is known yet, so ``position.stall`` names the cause when a failing collective's error
        line is written before the next periodic look."""
        from moetrain.failures import is_lost_connection

        if error is not None and is_lost_connection(error):
            self._look_after_lost_connection()
            return
        with self._lock:
            waited = time.monotonic() - self._since
            if self._where() == self._seen and self._finding != "silent" and waited >= self.stall_s:
                try:
                    self._finding = self._report(self._where(), waited, self._finding)
                except Exception as caught:  # noqa: BLE001 - the store may be gone
                    log.debug("watchdog: %s", caught)

    def _look_after_lost_connection(self) -> None:
        lost_at = time.monotonic()
        self._ended = "failed"
        try:
            self._publish()
            self._stop.wait(max(0.0, lost_at + self.interval_s + self.lost_margin_s - time.monotonic()))
            beats = self._read()
        except Exception as caught:  # noqa: BLE001 - the store is unreachable
            log.debug("watchdog: %s", caught)
            owner = self.store_served_by
            self.position.stall = (
                f"rank {owner} is gone (it served the rendezvous store, which no longer answers)"
                if owner is not None and owner != self.rank
                else "the heartbeats could not be read (the rendezvous store no longer answers)"
            )
            log.error("rank %d lost a connection; %s", self.rank, self.position.stall)
            return
        run_step = self.position.step
        gone, ended = [], []
        for rank, beat, age in beats:
            if beat is None:
                gone.append(f"rank {rank} (no heartbeat ever)")
            elif beat.get("ended") == "stopped":
                ended.append(str(rank))
            elif not beat.get("ended") and age > self.interval_s + self.lost_margin_s - 0.5:
                gone.append(_silent(rank, beat, age, run_step) + ": killed or crashed?")
        if gone:
            cause = _first(gone)
        else:
            cause = "no rank stopped making progress" + (
                f" (ended on their own: ranks {_first(ended)})" if ended else ""
            )
        self.position.stall = cause
        line = f"rank {self.rank} lost a connection at step {run_step}; {cause}"
        log.error("%s", line)
        self.reports.append(line)
        self._looked = True
        try:
            self._publish()
        except Exception as caught:  # noqa: BLE001 - the store may be gone
            log.debug("watchdog: %s", caught)

    def keep_store_for_the_others(self) -> None:
        """Call once a failing rank has written its line and destroyed its process groups (which
        releases the ranks waiting on it in a collective). When this process serves the store
        (``store_served_by``), it stays until every other rank still beating has looked at the
        heartbeats or ended, so that the store does not go with it while a survivor is still to
        look; at most ``2 * stall_s`` (``dist_timeout_s``: the others' collectives have failed by
        then) plus one look after a lost connection. Elsewhere it returns at once."""
        if self.store_served_by != self.rank or self.world_size == 1:
            return
        deadline = time.monotonic() + 2 * self.stall_s + self.interval_s + 2 * self.lost_margin_s
        alive_s = self.interval_s + self.lost_margin_s  # a rank beating less recently is gone
        try:
            while time.monotonic() < deadline:
                waiting = [
                    rank
                    for rank, beat, age in self._read()
                    if beat is not None
                    and not beat.get("looked")
                    and beat.get("ended") != "stopped"
                    and age < alive_s
                ]
                if not waiting:
                    return
                time.sleep(min(0.5, self.interval_s))
        except Exception as caught:  # noqa: BLE001 - the store may be gone
            log.debug("watchdog: %s", caught)

    def _read(self) -> list[tuple[int, dict | None, float]]:
        """``(rank, heartbeat or None, age in s)`` of every other rank (one ``multi_get``)."""
        beats = self.store.multi_get([_key(r) for r in range(self.world_size)])
        now = time.time()
        found = []
        for rank, raw in enumerate(beats):
            if rank == self.rank:
                continue
            try:
                beat = json.loads(bytes(raw).decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                found.append((rank, None, math.inf))
                continue
            found.append((rank, beat, now - beat["time"]))
        return found

    def _report(self, where: tuple, waited_s: float, previous: str | None = None) -> str:
        """Reads every heartbeat; logs (unless the finding is ``previous`` again) and returns the
        finding: ``"silent"``, ``"behind"`` or ``"waiting"`` (every rank at the same place)."""
        silent, behind, causes, ended, lagging = [], [], [], [], []
        for rank, beat, age in self._read():
            if beat is None:
                silent.append(f"rank {rank} (no heartbeat)")
                causes.append(f"rank {rank} never sent a heartbeat")
                continue
            place = f"step {beat['step']}, {beat['phase']}"
            if beat.get("ended"):
                silent.append(f"rank {rank} (ended at {place})")
                ended.append(f"rank {rank} ended at {place}")
            elif age >= self.stall_s:
                silent.append(f"rank {rank} (last heard {age:.0f} s ago at {place})")
                causes.append(_silent(rank, beat, age, where[0]))
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
            self.position.stall = _first(causes + ended + lagging)  # a crashed or stopped rank first
        else:
            line = f"rank {self.rank}: every rank has been at {here} for {waited_s:.0f} s (a long phase)"
            if finding != previous:
                log.info("%s", line)
        self.reports.append(line)
        return finding


def _silent(rank: int, beat: dict, age: float, run_step: int | None) -> str:
    """``rank R stopped making progress at step S, <phase> (last heard N s ago)`` when its last
    heartbeat was at the step the run had reached (``run_step``, this rank's); else the run's step,
    then where the heartbeat was (a heartbeat is older than the steps when steps are fast)."""
    verb = "stopped making progress"
    if run_step is None or beat["step"] == run_step:
        return f"rank {rank} {verb} at step {beat['step']}, {beat['phase']} (last heard {age:.0f} s ago)"
    return (
        f"rank {rank} {verb} at step {run_step} (last heard {age:.0f} s ago, at step {beat['step']}, "
        f"{beat['phase']})"
    )


def _first(items: list[str], shown: int = 8) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
