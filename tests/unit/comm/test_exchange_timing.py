"""moetrain.comm.timing: the exchanges' spans reach the recorder the engine sets, and only then."""

from __future__ import annotations

import contextlib

from moetrain.comm.timing import exchange_span, recording_exchanges


class Recorder:
    def __init__(self):
        self.names = []

    @contextlib.contextmanager
    def phase(self, name):
        self.names.append(name)
        yield


def test_spans_are_recorded_only_inside_recording_and_nesting_restores():
    outer, inner = Recorder(), Recorder()
    with exchange_span():
        pass
    with recording_exchanges(outer):
        with exchange_span():
            pass
        with recording_exchanges(inner), exchange_span():
            pass
        with exchange_span():
            pass
    with exchange_span():
        pass
    assert outer.names == ["all_to_all", "all_to_all"] and inner.names == ["all_to_all"]
