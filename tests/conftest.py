import io
import logging

import pytest
import torch

from moetrain._ext import ops
from moetrain.logs import ConsoleHandler


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def available_simd_levels() -> list[str]:
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(ops.detected_simd_level()) + 1]


@pytest.fixture(params=available_simd_levels())
def simd_level(request):
    """Runs a test once per SIMD code path this CPU can execute, restoring the best one after."""
    ops.set_max_simd_level(request.param)
    yield request.param
    ops.set_max_simd_level("avx512")


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def progress_log():
    """``attach(terminal=False, level=INFO) -> stream``: a :class:`ConsoleHandler` writing to a new
    ``StringIO`` (a ``Terminal`` when ``terminal``) on the ``moetrain.progress`` logger, so that a
    test reads what progress bars show as the command line would; removed after the test."""
    logger = logging.getLogger("moetrain.progress")
    saved = logger.level, logger.propagate
    attached = []

    def attach(terminal: bool = False, level: int = logging.INFO) -> io.StringIO:
        stream = Terminal() if terminal else io.StringIO()
        handler = ConsoleHandler(stream, level)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if handler.redraws else level)
        logger.propagate = False
        attached.append(handler)
        return stream

    yield attach
    for handler in attached:
        logger.removeHandler(handler)
    logger.setLevel(saved[0])
    logger.propagate = saved[1]


def pytest_collection_modifyitems(config, items):
    """Test files with a test marked ``slow`` run first, the one whose longest test is allowed the
    longest (its ``timeout`` mark, a test's own estimate of its worst case) first; the other files
    follow in collection order. ``make test`` spreads whole files over its workers (``--dist
    loadfile``, with xdist's reordering by test count turned off: ``--no-loadscope-reorder``), and a
    minutes-long file that starts last keeps one worker busy after the others have finished (xdist's
    own order had put the 4-minute demo-accuracy file, 3 tests, last)."""
    longest: dict = {}
    for item in items:
        if item.get_closest_marker("slow") is not None:
            timeout = item.get_closest_marker("timeout")
            seconds = float(timeout.args[0]) if timeout is not None and timeout.args else 0.0
            longest[item.path] = max(longest.get(item.path, 0.0), seconds)
    rank = {path: index for index, path in enumerate(sorted(longest, key=lambda path: -longest[path]))}
    items[:] = sorted(items, key=lambda item: rank.get(item.path, len(rank)))  # stable within a file
