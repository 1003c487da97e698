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
    """Test files with a test marked ``slow`` run first (otherwise in collection order): ``make
    test`` spreads whole files over its workers (``--dist loadfile``), and a minutes-long file that
    starts last keeps one worker busy after the other has finished."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items[:] = sorted(items, key=lambda item: item.path not in slow_files)  # stable: order kept within
