"""The CUDA ordering of the offloaded optimizer's staging (moetrain/offload/transfers.py), checked
on the CPU: the step runs its real CUDA code path with torch's streams and events stood in for by
a model that records, with vector clocks, what each copy and each host update reads and writes in
the pinned slots. Two accesses to the same bytes, one of them a write, by the host and a stream or
by two streams, must be ordered by a stream's own order, an event a stream waits for, or an event
the host waits for before it issues or does the later one. The CUDA run itself is compared with a
CPU run in tests/unit/machinery/test_offload_optimizer.py on a GPU."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.offload import OffloadOptimizer, transfers
from moetrain.offload import optimizer as offload_optimizer


class Clock(dict):
    """A vector clock: actor -> the count of that actor's operations this one is after."""

    def merged(self, other: dict) -> Clock:
        return Clock({a: max(self.get(a, 0), other.get(a, 0)) for a in {*self, *other}})


class Timeline:
    """Actors (the host, each stream) with their clocks, and every access to the slots."""

    def __init__(self) -> None:
        self.clocks: dict[str, Clock] = {"host": Clock(host=0)}
        self.accesses: list[tuple] = []  # actor, clock, "r"/"w", slot, first byte, end byte
        self.slots: list[torch.Tensor] = []
        self.current = "compute"
        self.names = itertools.count()

    def tick(self, actor: str) -> Clock:
        clock = self.clocks[actor]
        self.clocks[actor] = clock = clock.merged({actor: clock.get(actor, 0) + 1})
        return clock

    def issue(self, stream: str) -> Clock:
        """The host issues an operation to ``stream``: it runs after all the host did so far."""
        self.clocks[stream] = self.clocks[stream].merged(self.clocks["host"])
        return self.tick(stream)

    def access(self, actor: str, clock: Clock, kind: str, tensor: torch.Tensor) -> None:
        for index, slot in enumerate(self.slots):
            start = tensor.data_ptr() - slot.data_ptr()
            if 0 <= start < slot.numel():
                end = start + tensor.numel() * tensor.element_size()
                self.accesses.append((actor, clock, kind, index, start, end))

    def races(self) -> list[tuple]:
        def before(a, b) -> bool:
            return a[1].get(a[0], 0) <= b[1].get(a[0], 0)

        return [
            (a, b)
            for a, b in itertools.combinations(self.accesses, 2)
            if a[0] != b[0] and "w" in (a[2], b[2]) and a[3] == b[3] and a[4] < b[5] and b[4] < a[5]
            and not before(a, b) and not before(b, a)
        ]  # fmt: skip


class FakeEvent:
    def __init__(self, timeline: Timeline, clock: Clock) -> None:
        self.timeline, self.clock = timeline, clock

    def synchronize(self) -> None:
        timeline = self.timeline
        timeline.clocks["host"] = timeline.clocks["host"].merged(self.clock)


class FakeStream:
    def __init__(self, timeline: Timeline, name: str | None = None) -> None:
        self.timeline, self.name = timeline, name or f"stream{next(timeline.names)}"
        timeline.clocks[self.name] = Clock()

    def record_event(self) -> FakeEvent:
        return FakeEvent(self.timeline, self.timeline.issue(self.name))

    def wait_event(self, event: FakeEvent) -> None:
        clocks = self.timeline.clocks
        self.timeline.issue(self.name)
        clocks[self.name] = clocks[self.name].merged(event.clock)

    def wait_stream(self, other: FakeStream) -> None:
        self.wait_event(other.record_event())


class CopyRecorder(TorchDispatchMode):
    """Each ``copy_`` is issued to the current stream: it reads its source, writes its target."""

    def __init__(self, timeline: Timeline) -> None:
        super().__init__()
        self.timeline = timeline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            timeline, (dst, src) = self.timeline, args[:2]
            clock = timeline.issue(timeline.current)
            timeline.access(timeline.current, clock, "r", src)
            timeline.access(timeline.current, clock, "w", dst)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cuda_staging(monkeypatch):
    """The optimizer's transfers take their CUDA path for a CPU model, on the stand-in streams."""
    timeline = Timeline()
    compute = FakeStream(timeline, "compute")

    @contextlib.contextmanager
    def on_stream(stream):
        previous, timeline.current = timeline.current, stream.name
        try:
            yield
        finally:
            timeline.current = previous

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(timeline))
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))

    class CudaTransfers(transfers.Transfers):
        def __init__(self, work, *, staged, device):
            super().__init__(work, staged=True, device=torch.device("cuda"))
            timeline.slots = self.slots

    adam = OffloadOptimizer._adam

    def recorded_adam(self, segments, grads, copies, *args, **kwargs):
        clock = timeline.tick("host")
        for grad in grads:
            timeline.access("host", clock, "r", grad)
        for copy in copies:
            if copy is not None:
                timeline.access("host", clock, "w", copy)
        return adam(self, segments, grads, copies, *args, **kwargs)

    monkeypatch.setattr(offload_optimizer, "Transfers", CudaTransfers)
    monkeypatch.setattr(OffloadOptimizer, "_adam", recorded_adam)
    return timeline


def bf16_params() -> list[torch.nn.Parameter]:
    """Small 1-D parameters then matrices, as a model lists them: the apply groups' slot layouts
    differ, so group i + 2's gradients land on bytes where group i's weights were staged."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(64,)] * 4 + [(256, 64)] * 3
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).bfloat16()) for shape in shapes]


def step_twice(params: list[torch.nn.Parameter]) -> None:
    optimizer = OffloadOptimizer(params, lr=1e-2, weight_decay=0.1, num_apply_groups=4)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).bfloat16()
        optimizer.step()


def test_every_staged_copy_and_host_update_is_ordered_against_the_others(cuda_staging):
    params = bf16_params()
    with CopyRecorder(cuda_staging):
        step_twice(params)
    slots = {(slot, start) for actor, _, _, slot, start, _ in cuda_staging.accesses if actor != "host"}
    assert len(cuda_staging.accesses) > 50 and len(slots) > 10  # every group's copies were seen
    assert cuda_staging.races() == []


def test_the_stand_in_cuda_path_updates_as_the_cpu_path_does(cuda_staging):
    staged, plain = bf16_params(), bf16_params()
    with CopyRecorder(cuda_staging):
        step_twice(staged)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offload_optimizer, "Transfers", transfers.Transfers)
        step_twice(plain)
    for a, b in zip(staged, plain, strict=True):
        assert torch.equal(a, b)
