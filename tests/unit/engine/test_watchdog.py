"""The watchdog's finding on demand: a failing rank asks once more before writing its error line."""

import json
import threading
import time

import pytest

from moetrain.failures import RunPosition
from moetrain.watchdog import Watchdog

pytestmark = pytest.mark.serial  # times real waits and rates: run alone (tests/README.md)


class DictStore:
    """The store calls the watchdog makes (``set``, ``check`` and ``multi_get``), on a dict; like
    a TCPStore's, ``multi_get`` of a missing key fails (the real one waits for it)."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode("utf-8") if isinstance(value, str) else value

    def check(self, keys):
        return all(key in self.values for key in keys)

    def multi_get(self, keys):
        return [self.values[key] for key in keys]


def _beat(store, rank, step, phase, age_s):
    store.set(f"heartbeat/{rank}", json.dumps({"step": step, "phase": phase, "time": time.time() - age_s}))


def _watchdog(store, position, stall_s):
    # interval_s is long: only look_now() reads heartbeats in these tests
    return Watchdog(store, 0, 2, position, interval_s=3600.0, stall_s=stall_s).start()


def test_look_now_names_a_silent_rank_once_this_rank_has_waited_stall_s():
    store, position = DictStore(), RunPosition(rank=0, step=3, phase="forward")
    watchdog = _watchdog(store, position, stall_s=0.2)
    try:
        _beat(store, 1, 3, "forward", age_s=5.0)
        watchdog.look_now()
        assert position.stall is None  # waited less than stall_s: no finding yet
        time.sleep(0.25)
        watchdog.look_now()
        assert position.stall is not None
        expected = "rank 1 stopped making progress at step 3, forward (last heard 5 s ago"
        assert position.stall.startswith(expected)
    finally:
        watchdog.stop()


def test_look_now_finds_nothing_while_every_rank_is_alive_at_the_same_place():
    store, position = DictStore(), RunPosition(rank=0, step=3, phase="forward")
    watchdog = _watchdog(store, position, stall_s=0.1)
    try:
        time.sleep(0.15)
        _beat(store, 1, 3, "forward", age_s=0.0)
        watchdog.look_now()
        assert position.stall is None
        assert watchdog.reports and "a long phase" in watchdog.reports[-1]
    finally:
        watchdog.stop()


def test_a_finding_names_the_step_the_run_reached_not_the_stale_heartbeats():
    """Steps are faster than heartbeats: rank 1's last heartbeat says step 3 while the run (this
    rank) is at step 7; the finding says step 7, with the heartbeat's place beside it."""
    store, position = DictStore(), RunPosition(rank=0, step=7, phase="gradient sync")
    watchdog = _watchdog(store, position, stall_s=0.1)
    try:
        _beat(store, 1, 3, "forward", age_s=5.0)
        time.sleep(0.15)
        watchdog.look_now()
        assert position.stall.startswith(
            "rank 1 stopped making progress at step 7 (last heard 5 s ago, at step 3, forward)"
        ), position.stall
    finally:
        watchdog.stop()


LOST = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4711"
)


def test_a_lost_connection_names_the_rank_that_stopped_beating_not_one_that_ended(monkeypatch):
    """Rank 1 was killed (its heartbeat stopped), rank 2 failed on its own and said so; this rank
    looks once, right away, however short its wait: no stall_s needed."""
    store, position = DictStore(), RunPosition(rank=0, step=4, phase="forward")
    monkeypatch.setattr(Watchdog, "lost_margin_s", 0.6)
    watchdog = Watchdog(store, 0, 3, position, interval_s=0.2, stall_s=3600.0).start()
    try:
        _beat(store, 1, 4, "forward", age_s=0.0)
        store.set(
            "heartbeat/2",
            json.dumps({"step": 4, "phase": "backward", "time": time.time(), "ended": "failed"}),
        )
        watchdog.look_now(LOST)
        assert (
            position.stall
            == "rank 1 stopped making progress at step 4, forward (last heard 1 s ago): killed or crashed?"
        )
        assert json.loads(store.values["heartbeat/0"])["ended"] == "failed"  # the others will not name rank 0
    finally:
        watchdog.stop()


def test_a_lost_connection_with_every_rank_beating_names_none(monkeypatch):
    store, position = DictStore(), RunPosition(rank=1, step=4, phase="forward")
    monkeypatch.setattr(Watchdog, "lost_margin_s", 0.6)
    watchdog = Watchdog(store, 1, 3, position, interval_s=0.2, stall_s=3600.0).start()
    store.set(
        "heartbeat/2", json.dumps({"step": 4, "phase": "forward", "time": time.time(), "ended": "stopped"})
    )
    try:
        stop = threading.Event()
        beating = threading.Thread(
            target=lambda: [_beat(store, 0, 4, "forward", 0.0) for _ in iter(lambda: stop.wait(0.05), True)]
        )
        beating.start()
        watchdog.look_now(LOST)
        stop.set()
        beating.join()
        assert position.stall == "no rank stopped making progress (ended on their own: ranks 2)"
    finally:
        watchdog.stop()


def test_a_lost_connection_with_the_store_gone_names_the_rank_that_served_it():
    class GoneStore(DictStore):
        def multi_get(self, keys):
            raise RuntimeError("Connection reset by peer")

    position = RunPosition(rank=1, step=4, phase="forward")
    watchdog = Watchdog(
        GoneStore(), 1, 2, position, interval_s=0.01, stall_s=3600.0, store_served_by=0
    ).start()
    try:
        watchdog.look_now(LOST)
        assert position.stall == "rank 0 is gone (it served the rendezvous store, which no longer answers)"
    finally:
        watchdog.stop()


def test_a_stopped_watchdog_says_its_rank_ended():
    store = DictStore()
    Watchdog(store, 0, 1, RunPosition(), interval_s=3600.0, stall_s=3600.0).start().stop()
    assert json.loads(store.values["heartbeat/0"])["ended"] == "stopped"


def test_the_rank_serving_the_store_stays_until_the_others_have_looked(monkeypatch):
    """Rank 0 serves the store (per-task launch): after its own look and line it stays until rank 1,
    still beating (it noticed the loss later), has looked too, so the store outlives every look."""
    store, position = DictStore(), RunPosition(rank=0, step=4, phase="forward")
    monkeypatch.setattr(Watchdog, "lost_margin_s", 0.6)
    watchdog = Watchdog(store, 0, 2, position, interval_s=0.2, stall_s=3600.0, store_served_by=0).start()
    looked = {}

    def rank_1():
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            _beat(store, 1, 4, "forward", 0.0)
            time.sleep(0.05)
        beat = {"step": 4, "phase": "forward", "time": time.time(), "ended": "failed", "looked": True}
        store.set("heartbeat/1", json.dumps(beat))
        looked["at"] = time.monotonic()

    other = threading.Thread(target=rank_1)
    other.start()
    try:
        watchdog.look_now(LOST)
        assert position.stall == "no rank stopped making progress"
        watchdog.stop()
        watchdog.keep_store_for_the_others()
        returned = time.monotonic()
        other.join()
        assert returned >= looked["at"]
    finally:
        watchdog.stop()


class StoppedStore(DictStore):
    """A store whose server is stopped once ``stopped`` is set: every call then waits forever, as a
    TCPStore client's do against a stopped server (whatever the store's timeout)."""

    def __init__(self):
        super().__init__()
        self.stopped = threading.Event()

    def set(self, key, value):
        if self.stopped.is_set():
            threading.Event().wait()
        super().set(key, value)

    def multi_get(self, keys):
        if self.stopped.is_set():
            threading.Event().wait()
        return super().multi_get(keys)


def test_a_stopped_store_server_is_named_and_look_now_does_not_hang(monkeypatch):
    """Rank 0 serves the store and is stopped: the thread's store calls never return. The look
    still ends (the store calls have a deadline, no call is made under the shared lock) and the
    finding says the store did not answer and who serves it."""
    monkeypatch.setattr(Watchdog, "store_deadline_s", 1.0, raising=False)
    store, position = StoppedStore(), RunPosition(rank=1, step=4, phase="forward")
    watchdog = Watchdog(store, 1, 2, position, interval_s=0.05, stall_s=0.3, store_served_by=0).start()
    try:
        _beat(store, 0, 4, "forward", age_s=0.0)
        store.stopped.set()
        time.sleep(0.5)  # the thread is now blocked in a store call (for good, before the fix)
        looked = threading.Thread(target=watchdog.look_now, args=(RuntimeError("Timed out waiting"),))
        started = time.monotonic()
        looked.start()
        looked.join(10)
        assert not looked.is_alive(), "look_now hung"
        assert time.monotonic() - started < 2 * 1.0 + 1
        assert position.stall == (
            "the rendezvous store did not answer within 1 s: rank 0, which serves it, is stopped or gone"
        )
    finally:
        stopper = threading.Thread(target=watchdog.stop, daemon=True)
        stopper.start()
        stopper.join(10)
    assert not stopper.is_alive(), "stop hung"


def test_heartbeats_go_on_while_the_process_groups_connection_waits_in_a_get():
    """A TCPStore client serialises its calls: on the connection of the process groups, whose
    main thread waits in a ``get`` (a group's rendezvous), a heartbeat would wait too and the
    healthy rank look silent. The watchdog's own connection publishes at once."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=4))
    shared = dist.PrefixStore("moetrain/0", client)

    def in_get():
        with pytest.raises(dist.DistStoreError):
            shared.get("never-set")

    waiting = threading.Thread(target=in_get, daemon=True)
    waiting.start()
    time.sleep(0.3)  # the groups' connection is now busy in its get
    position = RunPosition(rank=0, step=2, phase="model set-up")
    watchdog = Watchdog(Watchdog.connection_to(shared), 0, 1, position, interval_s=0.1, stall_s=3600.0)
    started = time.monotonic()
    watchdog.start()
    try:
        assert time.monotonic() - started < 1.0
        beat = json.loads(server.get("moetrain/0/heartbeat/0"))
        assert (beat["step"], beat["phase"]) == (2, "model set-up")
    finally:
        watchdog.stop()
        waiting.join(10)


def test_a_store_that_cannot_be_cloned_is_shared():
    store = DictStore()
    assert Watchdog.connection_to(store) is store


def test_a_rank_that_never_beat_is_named_not_the_store():
    """Rank 1 never published a heartbeat (stuck before its watchdog started): a real TCPStore's
    ``multi_get`` waits for its key, so the look used to time out and blame the store; it names the
    rank."""
    import datetime

    from torch.distributed import TCPStore

    from moetrain.launch import free_port

    store = TCPStore("127.0.0.1", free_port(), 2, is_master=True, timeout=datetime.timedelta(seconds=30),
                     wait_for_workers=False)  # fmt: skip
    position = RunPosition(rank=0, step=3, phase="forward")
    watchdog = Watchdog(store, 0, 2, position, interval_s=0.2, stall_s=0.5, store_served_by=0).start()
    try:
        deadline = time.monotonic() + 20
        while position.stall is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        watchdog.stop()
    assert position.stall is not None and "rank 1 never sent a heartbeat" in position.stall, position.stall
