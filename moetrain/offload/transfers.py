"""Moving one apply group's slices between the model's device and host memory during a step.

For a CPU model nothing moves: the kernel reads the gradient in place and writes the weight copy
straight into the parameter. For a CUDA model, per group ``N * (grad bytes + weight bytes)`` of
pinned staging in each of two slots, so that the copies of one group (on two side streams, one per
direction) overlap the CPU step of the next.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

_STAGING_ALIGN = 64  # bytes; every staged slice starts on a cache line


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, end)`` of one parameter's flat view and its gradient's."""

    group_index: int  # param group
    param: torch.Tensor
    start: int
    end: int
    grad_N: torch.Tensor  # flat gradient slice, on the param's device
    param_N: torch.Tensor  # flat slice of the model's parameter (written back)

    @property
    def numel(self) -> int:
        return self.end - self.start


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _STAGING_ALIGN) * _STAGING_ALIGN


class Transfers:
    """Moves the gradients of apply group ``i`` to the host and its updated weights back.

    Unstaged (a CPU model): nothing moves; the kernel reads ``grad_N`` where it is and writes its
    weight copy straight into ``param_N`` (or nothing when the master is the parameter itself).

    Staged: a slot of host memory (pinned for CUDA) per group in flight, two slots in all; group i
    uses slot ``i % 2``, each segment a gradient slice then a weight slice, 64-byte aligned. CUDA:
    D2H copies run on ``d2h_stream``, H2D on ``h2d_stream`` (both first wait for the compute stream,
    whose backward wrote the gradients and read the weights). Group i's D2H copies wait on the
    device for the H2D event of group i - 2 (the last reader of the slot, whose layout differs), so
    the host, waiting for group i's D2H event before stepping it, also knows the slot's weight
    slices free. Group i + 1's D2H is issued before group i's step, group i's H2D right after it,
    so both directions overlap the next step. ``finish`` waits for the last H2D copies and makes the
    compute stream wait for both side streams. On the CPU the same code copies synchronously.
    """

    def __init__(self, work: list[list[Segment]], *, staged: bool, device: torch.device) -> None:
        self.work = work
        self.staged = staged
        self.cuda = staged and device.type == "cuda"
        self.layouts: list[list[tuple[int, int]]] = []
        self.slots: list[torch.Tensor] = []
        if staged and work:
            slot_bytes = 0
            for segments in work:
                layout, size = [], 0
                for seg in segments:
                    grad_offset = size
                    size = _aligned(size + seg.numel * seg.grad_N.element_size())
                    layout.append((grad_offset, size))
                    size = _aligned(size + seg.numel * seg.param_N.element_size())
                self.layouts.append(layout)
                slot_bytes = max(slot_bytes, size)
            self.slots = [
                torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=self.cuda)
                for _ in range(min(2, len(work)))
            ]
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream.wait_stream(self.compute_stream)
            self.h2d_stream.wait_stream(self.compute_stream)
            self.d2h_done: list[Any] = [None] * len(work)
            self.h2d_done: list[Any] = [None] * len(work)

    def _on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def fetch(self, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Starts the D2H copies of group i; returns (host gradient, weight copy target) per segment."""
        segments = self.work[i]
        if not self.staged:
            return [seg.grad_N for seg in segments], [seg.param_N for seg in segments]
        slot = self.slots[i % 2]
        grads, copies = [], []
        if self.cuda and i >= 2:  # group i - 2's H2D copies still read this slot's weight slices
            self.d2h_stream.wait_event(self.h2d_done[i - 2])
        with self._on(self.d2h_stream if self.cuda else None):
            for seg, (grad_offset, copy_offset) in zip(segments, self.layouts[i], strict=True):
                grad_N = slot[grad_offset : grad_offset + seg.numel * seg.grad_N.element_size()]
                grad_N = grad_N.view(seg.grad_N.dtype)
                grad_N.copy_(seg.grad_N, non_blocking=self.cuda)
                copy_N = slot[copy_offset : copy_offset + seg.numel * seg.param_N.element_size()]
                grads.append(grad_N)
                copies.append(copy_N.view(seg.param_N.dtype))
            if self.cuda:
                self.d2h_done[i] = self.d2h_stream.record_event()
        return grads, copies

    def wait(self, i: int) -> None:
        """Blocks until group i's gradients are on the host; its D2H copies ran after group i - 2's
        H2D copies, so the slot's weight slices are free too."""
        if self.cuda:
            self.d2h_done[i].synchronize()

    def write_back(self, i: int, copies: list[torch.Tensor | None]) -> None:
        """Starts the H2D copies of group i's updated weights into the model's parameters."""
        if not self.staged:
            return
        with self._on(self.h2d_stream if self.cuda else None):
            for seg, copy_N in zip(self.work[i], copies, strict=True):
                seg.param_N.copy_(copy_N, non_blocking=self.cuda)
            if self.cuda:
                self.h2d_done[i] = self.h2d_stream.record_event()

    def finish(self) -> None:
        """Waits for every copy still in flight (also after an error) and orders the compute stream
        after them; the slots may be freed afterwards."""
        if self.cuda:
            for event in (*self.d2h_done, *self.h2d_done):
                if event is not None:
                    event.synchronize()
            self.compute_stream.wait_stream(self.d2h_stream)
            self.compute_stream.wait_stream(self.h2d_stream)


# ------------------------------------------------------------------------------------------------
# OffloadOptimizer
