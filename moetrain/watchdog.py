"""Heartbeats: every rank says where it is; a rank that waits too long, or loses a connection,
says who stopped.

When one rank stops (a hung data loader, a killed or stopped process, a deadlock), the others wait
in their next collective until ``dist_timeout_s`` and then fail with a transport error that names
no one. Here each rank's :class:`Watchdog` thread writes ``(step, phase, progress, time)`` into the
rendezvous store every ``interval_s`` seconds (``progress``: the phase changes since the step began,
:class:`moetrain.failures.RunPosition`). When its own rank has been in the same step and phase for
``stall_s`` seconds, it reads every rank's heartbeat (one ``multi_get``) and logs one error line
naming the ranks that are silent (no heartbeat for ``stall_s``: stopped or gone) or behind (an
earlier ``(step, progress)``: at the same step, a rank in forward is behind one in backward, not the
other way round); when no rank is silent or behind it only logs that they all wait at the same place
(a long phase), or that the others are ahead of it (this rank is the slow one): not a fault.
Until it has found a silent rank it looks again every ``stall_s / 2`` (a rank stopped just after
this one started waiting is not yet silent at the first look), logging again only when the
finding changes. The finding is kept on the run's position
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

Store traffic: one small ``set`` per rank every ``interval_s``; one ``check`` and one ``multi_get``
of ``world`` keys per rank every ``stall_s / 2`` of a stall (a ``check`` per key while a rank has
never beaten), until a silent rank is found, and once per failing rank after a lost connection.
The watchdog has a store connection of its own (:meth:`Watchdog.connection_to`):
a client serialises its calls, so on the process groups' connection a heartbeat would wait behind a
``get`` of the main thread (a group's rendezvous) and a healthy rank would look silent.

Every store call has a deadline (``store_deadline_s``): against a server that is stopped (``kill
-STOP`` of rank 0 serving the store, or of the launcher's agent) a client's ``get`` / ``multi_get``
/ ``set`` wait forever whatever the store's timeout. A call past its deadline is left behind (its
thread blocked) and the later ones fail at once until it returns; a look that cannot read the
heartbeats in time says so in its finding (``the rendezvous store did not answer within N s: rank
0, which serves it, is stopped or gone``). No store call is made while the thread and
:meth:`Watchdog.look_now` share state (``_lock``), so a failing rank's last look always ends.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time

from moetrain.parallel import DeadlineExceeded, call_with_deadline

log = logging.getLogger(__name__)

_FINAL = ("silent", "store")  # findings after which the thread stops looking (until this rank moves)


def _key(rank: int) -> str:
    return f"heartbeat/{rank}"


class StoreTimeout(TimeoutError):
    """A store call of the watchdog that did not return within its deadline."""

    def __init__(self, deadline_s: float):
        super().__init__(f"the rendezvous store did not answer within {deadline_s:.0f} s")
        self.deadline_s = deadline_s


def _with_deadline(call, deadline_s: float):
    """``call()`` within ``deadline_s`` (:func:`moetrain.parallel.call_with_deadline`), else
    :class:`StoreTimeout`."""
    try:
        return call_with_deadline(call, deadline_s, "moetrain-watchdog-store")
    except DeadlineExceeded:
        raise StoreTimeout(deadline_s) from None


class Watchdog:
    """Publishes ``position`` (a :class:`moetrain.failures.RunPosition`) and reports stalls and
    crashed ranks. ``store``: a connection of its own (:meth:`connection_to`). ``store_served_by``:
    the rank whose process serves the store (0 under a per-task launch; None when a launcher's agent
    serves it), named when the store cannot be reached."""

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
        self._lock = threading.Lock()  # the thread and look_now() share where/since/finding (no store I/O)
        self._io = threading.Lock()  # held by the store call in flight (released by its helper thread)
        self._stuck = False  # a store call is past its deadline and has not returned yet
        self._seen, self._since, self._finding = None, time.monotonic(), None
        self._ended: str | None = None  # "failed" / "stopped": said in every heartbeat from then on
        self._looked = False  # after a lost connection: this rank has read the heartbeats
        self.reports: list[str] = []

    @staticmethod
    def connection_to(store, deadline_s: float = 30.0):
        """A connection of the watchdog's own to ``store`` (``store.clone()``: same server, same
        prefix), so that its heartbeats do not wait behind the process groups' calls on ``store``.
        ``store`` itself, with a warning, when it cannot be cloned within ``deadline_s``."""
        try:
            return _with_deadline(store.clone, deadline_s)
        except Exception as error:  # noqa: BLE001 - AttributeError (an older torch), a refused connection
            log.warning(
                "watchdog: no store connection of its own (%s); it shares the process groups' (a rank "
                "waiting in a store call may then look silent)",
                " ".join(str(error).split())[:200],
            )
            return store

    @property
    def lost_margin_s(self) -> float:
        """After a lost connection: how much longer than ``interval_s`` a rank must be silent to be
        taken for crashed (the slack for a live rank's late heartbeat)."""
        return max(2.0, self.interval_s / 2)

    @property
    def store_deadline_s(self) -> float:
        """How long a store call may take before the store is taken for stopped or gone."""
        return max(5.0, min(self.interval_s, 30.0))

    def start(self) -> Watchdog:
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread; the last heartbeat says this rank ended (unless it already did)."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + self.store_deadline_s + 5)
        if self._ended is None:
            self._ended = "stopped"
            try:
                self._publish()
            except Exception as error:  # noqa: BLE001 - the store may be gone at shutdown
                log.debug("watchdog: %s", error)

    def _call(self, method: str, *args):
        """``store.<method>(*args)`` within ``store_deadline_s``, one call at a time; raises
        :class:`StoreTimeout` past it, and at once while an earlier call is still stuck."""
        deadline_s = self.store_deadline_s
        if not self._io.acquire(timeout=0 if self._stuck else deadline_s):
            raise StoreTimeout(deadline_s)

        def call():
            try:
                return getattr(self.store, method)(*args)
            finally:
                self._stuck = False
                self._io.release()

        try:
            return _with_deadline(call, deadline_s)
        except StoreTimeout:
            self._stuck = True
            raise

    def _where(self) -> tuple:
        """``(step, phase, progress)`` of this rank now."""
        position = self.position
        return (position.step, position.phase, position.progress)

    def _publish(self) -> None:
        step, phase, progress = self._where()
        beat = {"step": step, "phase": phase, "progress": progress, "time": time.time()}
        if self._ended is not None:
            beat["ended"] = self._ended
        if self._looked:
            beat["looked"] = True
        self._call("set", _key(self.rank), json.dumps(beat))

    def _run(self) -> None:
        with self._lock:
            self._seen, self._since = self._where(), time.monotonic()
        next_look = self.stall_s
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
            except Exception as error:  # noqa: BLE001 - the store may be gone at shutdown, or stopped
                log.debug("watchdog: %s", error)
                if self._stop.is_set():
                    return
            moved, due = self._due(next_look)
            if moved:
                next_look = self.stall_s
            elif due is not None:
                self._look(*due)
                next_look = due[1] + self.stall_s / 2

    def _due(self, after_s: float) -> tuple[bool, tuple | None]:
        """``(moved, look)``: whether this rank has moved since the last call (which resets the
        finding); look ``(where, waited_s)`` when it has been at the same place for
        ``after_s`` or more and no final finding is known, else None."""
        with self._lock:
            where, waited = self._where(), time.monotonic() - self._since
            if where != self._seen:
                self._seen, self._since, self._finding = where, time.monotonic(), None
                self.position.stall = None
                return True, None
            if self._finding in _FINAL or waited < after_s:
                return False, None
            return False, (where, waited)

    def _look(self, where: tuple, waited_s: float) -> None:
        """Reads every heartbeat (outside the lock), then keeps the finding if this rank is still
        where it was; logs it unless it is the finding already kept (by a look made meanwhile)."""
        try:
            finding, line, cause = self._report(where, waited_s)
        except StoreTimeout as error:
            finding, line, cause = "store", *self._store_silent(where, waited_s, error)
        except Exception as error:  # noqa: BLE001 - the store may be gone
            log.debug("watchdog: %s", error)
            return
        with self._lock:
            if self._where() != where or self._seen != where:
                return  # this rank moved on while it looked: the finding is stale
            previous, self._finding = self._finding, finding
            if cause is not None:
                self.position.stall = cause
            self.reports.append(line)
        if finding != previous:
            log.log(logging.INFO if cause is None else logging.ERROR, "%s", line)

    def _store_silent(self, where: tuple, waited_s: float, error: StoreTimeout) -> tuple[str, str]:
        """``(line, cause)`` of a look that could not read the heartbeats in time."""
        owner = self.store_served_by
        if owner is None:
            server = "the launcher's agent serving it (on the rendezvous host) is stopped or gone"
        elif owner != self.rank:
            server = f"rank {owner}, which serves it, is stopped or gone"
        else:
            server = "this rank serves it and cannot answer (overloaded?)"
        cause = f"{error}: {server}"
        return f"rank {self.rank} has waited {waited_s:.0f} s at step {where[0]}, {where[1]}; {cause}", cause

    def look_now(self, error: BaseException | None = None) -> None:
        """Called by a failing rank before it writes its error line. ``error`` a lost connection
        (:func:`moetrain.failures.is_lost_connection`): names the rank that stopped beating (see
        the module docstring; waits up to ``interval_s + lost_margin_s``). Otherwise: reads every
        heartbeat now if this rank has been in the same place for ``stall_s`` or more and no silent
        rank is known yet, so ``position.stall`` names the cause when a failing collective's error
        line is written before the next periodic look. Bounded: at most twice ``store_deadline_s``
        when the store does not answer (the finding then says so)."""
        from moetrain.failures import is_lost_connection

        if error is not None and is_lost_connection(error):
            self._look_after_lost_connection()
            return
        if not self._lock.acquire(timeout=self.store_deadline_s):
            log.debug("watchdog: the watchdog's state stayed locked; no last look")
            return
        try:
            where, waited = self._where(), time.monotonic() - self._since
            due = where == self._seen and self._finding not in _FINAL and waited >= self.stall_s
        finally:
            self._lock.release()
        if due:
            self._look(where, waited)

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
        """``(rank, heartbeat or None, age in s)`` of every other rank (one ``check`` and one
        ``multi_get``, each within ``store_deadline_s``). ``multi_get`` waits for a key that does not
        exist: when one is missing (a rank that never started beating), each key is checked and only
        the present ones are read, so the look names that rank instead of timing out on the store."""
        keys = [_key(r) for r in range(self.world_size)]
        if not self._call("check", keys):
            keys = [key for key in keys if self._call("check", [key])]
        beats = dict(zip(keys, self._call("multi_get", keys) if keys else [], strict=True))
        now = time.time()
        found = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                beat = json.loads(bytes(beats.get(_key(rank), b"")).decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                found.append((rank, None, math.inf))
                continue
            found.append((rank, beat, now - beat["time"]))
        return found

    def _report(self, where: tuple, waited_s: float) -> tuple[str, str, str | None]:
        """Reads every heartbeat: ``(finding, line, cause)``; finding ``"silent"``, ``"behind"``,
        ``"ahead"`` (no rank silent or behind, some further on: this rank is the slow one, cause None)
        or ``"waiting"`` (every rank at the same place, cause None), cause for ``position.stall``."""
        silent, behind, ahead, causes, ended, lagging = [], [], [], [], [], []
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
            elif is_behind(beat, where):
                behind.append(f"rank {rank} ({place})")
                lagging.append(f"rank {rank} is behind at {place}")
            elif (beat["step"], beat["phase"]) != where[:2]:
                ahead.append(f"rank {rank} ({place})")
        here = f"step {where[0]}, {where[1]}"
        finding = "silent" if silent else "behind" if behind else "ahead" if ahead else "waiting"
        if finding == "waiting":
            line = f"rank {self.rank}: every rank has been at {here} for {waited_s:.0f} s (a long phase)"
            return finding, line, None
        if finding == "ahead":
            line = f"rank {self.rank} has been at {here} for {waited_s:.0f} s; ahead of it: {_first(ahead)}"
            return finding, line, None
        parts = [f"rank {self.rank} has waited {waited_s:.0f} s at {here}"]
        if silent:
            parts.append(f"stopped or gone: {_first(silent)}")
        if behind:
            parts.append(f"behind: {_first(behind)}")
        return finding, "; ".join(parts), _first(causes + ended + lagging)  # a crashed or stopped rank first


def is_behind(beat: dict, where: tuple) -> bool:
    """Whether the rank of heartbeat ``beat`` is behind ``where`` (``(step, phase, progress)`` of
    this rank): an earlier step, or at the same step fewer phase changes (``progress``). Phase names
    are not compared: at one step a rank in forward is behind one in backward, whatever the names'
    order. Steps before training (None) count as 0."""
    theirs = (beat["step"] or 0, beat.get("progress", 0))
    return theirs < (where[0] or 0, where[2])


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
