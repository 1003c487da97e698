"""PhaseTimer: seconds per phase everywhere, and on CUDA the allocator's peak of each phase (nested
phases included), from a fake allocator that records what a step allocates."""

from __future__ import annotations

import pytest
import torch

from moetrain.phase_times import PHASES, PhaseTimer


class FakeAllocator:
    """torch.cuda's peak statistics over a running count of allocated and reserved bytes."""

    def __init__(self):
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated + 10)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def reset(self, device=None) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


class FakeEvent:
    def __init__(self, enable_timing=False):
        self.time = 0.0

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 2.0  # ms


@pytest.fixture
def allocator(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.peak_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: fake.peak_reserved)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return fake


def test_each_phase_gets_its_own_peak_and_the_window_the_largest(allocator):
    timer = PhaseTimer(torch.device("cuda", 0))
    allocator.alloc(100)  # weights, before any phase
    with timer.phase("forward"):
        allocator.alloc(50)
        with timer.phase("all_to_all"):  # nested: its peak is also the forward's
            allocator.alloc(30)
            allocator.free(30)
        allocator.alloc(5)
    with timer.phase("backward"):
        allocator.alloc(20)
        allocator.free(75)
    allocator.alloc(1000)  # outside every phase: the window's, no phase's
    allocator.free(1000)
    with timer.phase("optimizer"):
        allocator.alloc(60)
        allocator.free(60)
    peaks = timer.window_peaks()
    assert peaks["memory/peak_forward_bytes"] == 180
    assert peaks["memory/peak_all_to_all_bytes"] == 180
    assert peaks["memory/peak_backward_bytes"] == 175
    assert peaks["memory/peak_optimizer_bytes"] == 160
    assert peaks["memory/peak_allocated_bytes"] == 1100 and peaks["memory/peak_reserved_bytes"] == 1110
    assert [k for k in peaks if k.startswith("memory/peak_") and k[12:-6] in PHASES] == [
        f"memory/peak_{name}_bytes" for name in PHASES
    ]  # every phase, in one order on every rank
    assert peaks["memory/peak_grad_sync_bytes"] == peaks["memory/peak_pipeline_bytes"] == 0
    seconds = timer.window_means(1)
    assert seconds == {f"time/{name}_s": 0.002 for name in ("forward", "all_to_all", "backward", "optimizer")}
    # the next window starts from what is allocated now
    with timer.phase("forward"):
        allocator.alloc(1)
    peaks = timer.window_peaks()
    assert peaks["memory/peak_forward_bytes"] == 101 and peaks["memory/peak_backward_bytes"] == 0
    assert peaks["memory/peak_allocated_bytes"] == 101


def test_a_phase_that_raises_still_closes(allocator):
    timer = PhaseTimer(torch.device("cuda", 0))
    with pytest.raises(RuntimeError), timer.phase("backward"):
        allocator.alloc(7)
        raise RuntimeError("out of memory")
    with timer.phase("optimizer"):
        allocator.alloc(1)
    peaks = timer.window_peaks()
    assert peaks["memory/peak_backward_bytes"] == 7 and peaks["memory/peak_optimizer_bytes"] == 8


def test_on_the_cpu_only_seconds():
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("forward"):
        pass
    assert set(timer.window_means(1)) == {"time/forward_s"}
