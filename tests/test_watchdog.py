"""The watchdog's finding on demand: a failing rank asks once more before writing its error line."""

import json
import time

from moetrain.failures import RunPosition
from moetrain.watchdog import Watchdog


class DictStore:
    """The two store calls the watchdog makes (``set`` and ``multi_get``), on a dict."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode("utf-8") if isinstance(value, str) else value

    def multi_get(self, keys):
        return [self.values.get(key, b"") for key in keys]


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
