"""A per-process pool of all-to-all buffers, reused across layers and steps.

The chunked all-to-all (:mod:`moetrain.comm.overlap`) takes every send and receive buffer of its
trips from here and gives it back when the trip no longer needs it. A buffer is a flat byte
tensor on one device; a request for ``nbytes`` takes the smallest free buffer of its size class
(``nbytes`` rounded up to a quarter of its power of two, so at most 25% of a buffer is unused)
or a larger free one up to twice that, else allocates a new one. Buffers no request took during
the last ``idle_rounds`` rounds (a round: one layer's forward or backward pipeline, see
:meth:`CommBufferPool.end_round`) are released, so sizes that dropless routing stopped producing do
not stay held.

Figures (bytes): ``in_use`` (what the requests asked for, held now), ``peak`` (most ``in_use``
since :meth:`CommBufferPool.reset_peak`), ``held`` (the buffers' real size, free ones included).
On the CPU a reused buffer also saves the page faults of fresh memory (~9 ms per 32 MiB on the
benchmark VM). Only the thread that runs the layers uses the pool (the collectives' own threads
never touch it); a buffer goes back only after the collective that used it completed.
"""

from __future__ import annotations

import torch


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of a quarter of its power of two (at least 256 bytes)."""
    nbytes = max(int(nbytes), 256)
    step = 1 << max((nbytes - 1).bit_length() - 3, 0)
    return -(-nbytes // step) * step


class CommBufferPool:
    """Send / receive buffers by (device, size class); see the module docstring."""

    def __init__(self, idle_rounds: int = 64):
        self.idle_rounds = idle_rounds
        self._free: dict[str, list[tuple[int, torch.Tensor, int]]] = {}  # device -> (size, buffer, round)
        self._taken: dict[int, tuple[int, int, torch.Tensor]] = {}  # storage -> (bytes asked, size, buffer)
        self._round = 0
        self.in_use = 0
        self.peak = 0
        self.held = 0
        self.allocations = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype`` backed by a pool buffer."""
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * dtype.itemsize
        device = torch.device(device)
        key = str(device)
        wanted = size_class(nbytes)
        free = self._free.setdefault(key, [])
        best = None
        for index, (size, _, _) in enumerate(free):
            if wanted <= size <= 2 * wanted and (best is None or size < free[best][0]):
                best = index
        if best is None:
            buffer = torch.empty(wanted, dtype=torch.uint8, device=device)
            size = wanted
            self.held += size
            self.allocations += 1
        else:
            size, buffer, _ = free.pop(best)
        view = buffer[:nbytes].view(dtype).view(shape)
        self._taken[buffer.untyped_storage().data_ptr()] = (nbytes, size, buffer)
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        return view

    def give(self, tensor: torch.Tensor) -> None:
        """Returns the buffer behind ``tensor`` (a view :meth:`take` returned) to the pool."""
        nbytes, size, buffer = self._taken.pop(tensor.untyped_storage().data_ptr())
        self.in_use -= nbytes
        self._free.setdefault(str(tensor.device), []).append((size, buffer, self._round))

    def reset_peak(self) -> None:
        self.peak = self.in_use

    def end_round(self) -> None:
        """Marks the end of one pipeline and releases buffers idle for ``idle_rounds`` rounds."""
        self._round += 1
        for key, free in self._free.items():
            kept = [entry for entry in free if self._round - entry[2] <= self.idle_rounds]
            self.held -= sum(size for size, _, _ in free) - sum(size for size, _, _ in kept)
            self._free[key] = kept

    def clear(self) -> None:
        """Releases every free buffer (taken ones stay with their users)."""
        for free in self._free.values():
            self.held -= sum(size for size, _, _ in free)
        self._free.clear()


_POOL = CommBufferPool()


def comm_buffer_pool() -> CommBufferPool:
    """This process's pool."""
    return _POOL
