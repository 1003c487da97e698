"""Seconds spent in the expert-parallel exchanges, for the engine's phase times.

Every blocking all-to-all of this package (the flat and hierarchical exchanges, their counts and
their backward) and every wait for a chunked exchange's message runs inside :func:`exchange_span`.
While :func:`recording_exchanges` is active (the engine wraps each training step in it), each span
is recorded as phase ``all_to_all`` of the given timer, any object with a ``phase(name)`` context
manager (:class:`moetrain.phase_times.PhaseTimer`: CUDA events on a GPU, the wall clock elsewhere),
so ``time/all_to_all_s`` is the time the step spent in, or waiting for, the exchanges: the part of a
chunked exchange hidden behind the experts' compute is not in it. Without a recorder a span costs
one attribute read. The recorder is process-wide, like a profiler, because backward passes may run
on autograd's own threads; it only observes and changes nothing the run computes.
"""

from __future__ import annotations

import contextlib

_recorder = None


@contextlib.contextmanager
def recording_exchanges(timer):
    """Records the exchanges run inside the block as phase ``all_to_all`` of ``timer``."""
    global _recorder
    previous, _recorder = _recorder, timer
    try:
        yield
    finally:
        _recorder = previous


def exchange_span():
    """The context an exchange runs in: a span of the active recorder, or nothing."""
    recorder = _recorder
    return recorder.phase("all_to_all") if recorder is not None else contextlib.nullcontext()
