"""Peak memory of a piece of work on any device, as the planner models it: the live bytes of the
tensor storages it creates.

:class:`PeakStorageBytes` is a ``TorchDispatchMode``: every storage an operator returns inside it
that is not one of the operator's inputs' storages (views and in-place results are not new
memory) is counted once (by its address) from its creation until it is freed (a ``weakref.finalize`` on the
storage object, which torch preserves for the storage's lifetime), so ``peak`` is the most bytes
held at once by storages created inside the block, whatever held them (autograd's saved tensors,
recomputed segments, gradients, MoE replay records, all-to-all buffers). What existed before the
block (weights, optimizer states) is not counted; scratch memory an operator allocates and frees
within itself is not seen. The CPU has no allocator statistics (``torch.cuda.max_memory_allocated``
is the CUDA equivalent, which also counts the allocator's rounding); this works on CPU and meta.
"""

from __future__ import annotations

import weakref

import torch

from moetrain._torch_compat import TorchDispatchMode, tree_flatten


class PeakStorageBytes(TorchDispatchMode):
    """``with PeakStorageBytes() as memory: ...``; then ``memory.peak`` and ``memory.live`` (bytes)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        nbytes = storage.nbytes()
        if key in self._tracked or nbytes == 0 or tensor.device.type == "meta":
            return
        self._tracked.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            value.untyped_storage().data_ptr()
            for value in tree_flatten((args, kwargs))
            if isinstance(value, torch.Tensor) and value.device.type != "meta"
        }
        for value in tree_flatten(out):
            # a view or an in-place result shares an input's storage: not a new allocation
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in inputs:
                self._track(value)
        return out
