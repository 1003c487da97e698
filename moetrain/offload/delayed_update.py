"""The one-step delayed parameter update of :class:`moetrain.offload.OffloadOptimizer`
(``overlap="delayed"``, ZeRO-Offload's delayed parameter update, Ren et al. 2021): the host
gradient snapshot, the worker thread that runs the C++ Adam of step t while the device runs step
t + 1, and the writing of its weights into the parameters (``wait_pending``, ``apply_pending``,
``has_pending``, ``close``, and ``zero_grad``'s wait for the snapshot). The timeline and the
memory it costs: the docstring of :mod:`moetrain.offload.optimizer`.

A mixin: it uses the optimizer's ``state``, ``param_groups``, ``device``, ``_segments`` and
``_adam``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from moetrain.offload.cpu_adam import group_hyperparameters


class DelayedUpdateMixin:
    """The delayed-update half of ``OffloadOptimizer``: the worker thread and the pending weights."""

    def _reset_overlap(self) -> None:
        self._executor: ThreadPoolExecutor | None = None  # one worker thread, made at first use
        self._future: Future | None = None  # the update in flight on the worker
        # param -> its host weight copy (flat, the param's dtype) to write, or None: cast ``master``
        self._pending: dict[torch.Tensor, torch.Tensor | None] = {}
        self._host_grads: dict[torch.Tensor, torch.Tensor] = {}  # param -> flat gradient snapshot
        self._host_weights: dict[torch.Tensor, torch.Tensor] = {}  # param -> flat weight copy
        self._weights_written: Any = None  # CUDA event: the last H2D copy from ``_host_weights``
        self._d2h_stream: Any = None  # CUDA: the side stream of the gradient snapshot
        # Seconds of the last update's host work: the whole step() (overlap "none"), or the worker's
        # Adam passes with their waits for the gradients' copies (delayed); None before the first.
        self.last_update_s: float | None = None

    def _start_delayed(
        self, flat_grads: dict[torch.Tensor, torch.Tensor], steps: dict[torch.Tensor, int], grad_scale: float
    ) -> None:
        """Copies the gradients into the host snapshot and starts their update on the worker."""
        cuda = self.device.type == "cuda"
        host_grads = {}
        for param, grad in flat_grads.items():
            buffer = self._host_grads.get(param)
            if buffer is None or buffer.dtype != grad.dtype:
                buffer = torch.empty(grad.numel(), dtype=grad.dtype, pin_memory=cuda)
                self._host_grads[param] = buffer
                self._host_weights.setdefault(
                    param, torch.empty(param.numel(), dtype=param.dtype, pin_memory=cuda)
                )
            host_grads[param] = buffer
        work = self._segments(host_grads)
        copied, weights_written = [], self._weights_written
        if cuda:  # on a side stream after the backward, one event per apply group for the worker
            if self._d2h_stream is None:
                self._d2h_stream = torch.cuda.Stream(self.device)
            stream = self._d2h_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for segments in work:
                    for seg in segments:
                        seg.grad_N.copy_(flat_grads[seg.param][seg.start : seg.end], non_blocking=True)
                    copied.append(stream.record_event())
            keep_alive = list(flat_grads.values())  # the device gradients live until the copies end
        else:
            for param, grad in flat_grads.items():
                host_grads[param].copy_(grad)
            keep_alive = []
        hyper = [group_hyperparameters(group) for group in self.param_groups]  # as of this step()

        def update() -> None:
            if weights_written is not None:  # the last H2D copy out of the weight buffers is done
                weights_written.synchronize()
            start = time.perf_counter()
            for i, segments in enumerate(work):
                if copied:
                    copied[i].synchronize()
                    if i == len(work) - 1:
                        keep_alive.clear()  # every gradient is on the host
                copies = [self._host_weights[seg.param][seg.start : seg.end] for seg in segments]
                grads = [seg.grad_N for seg in segments]
                self._adam(segments, grads, copies, steps, grad_scale, hyper)
            keep_alive.clear()
            self.last_update_s = time.perf_counter() - start

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-adam")
        self._future = self._executor.submit(update)
        self._pending = {param: self._host_weights[param] for param in flat_grads}

    def wait_pending(self) -> None:
        """Blocks until the update in flight (if any) has updated masters and moments; the
        parameters are not written (see :meth:`apply_pending`). Re-raises the worker's error."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def apply_pending(self) -> None:
        """Waits for the update in flight and writes its weights (the cast masters) into the
        parameters; nothing to do without one. ``step()`` calls it first; a trainer calls it when it
        skips a step without calling ``step()`` and before using the final weights (evaluation,
        export, the last checkpoint)."""
        self.wait_pending()
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        cuda = self.device is not None and self.device.type == "cuda"
        with torch.no_grad():
            for param, weights in pending.items():
                source = self.state[param]["master"] if weights is None else weights.view(param.shape)
                param.detach().copy_(source, non_blocking=cuda and weights is not None)
        if cuda:  # the next update may overwrite the weight buffers once these copies are done
            self._weights_written = torch.cuda.current_stream(self.device).record_event()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``. On CUDA, zeroing in place (``set_to_none=False``) first orders the
        compute stream after the gradient snapshot's copies, which read the gradients themselves on
        their side stream (``set_to_none=True`` drops the references; the snapshot keeps its own)."""
        if not set_to_none and self._d2h_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._d2h_stream)
        super().zero_grad(set_to_none=set_to_none)

    @property
    def has_pending(self) -> bool:
        """Whether an update is in flight or its weights are not yet in the parameters."""
        return self._future is not None or bool(self._pending)

    def close(self) -> None:
        """Applies the pending update and stops the worker thread (a later step starts a new one)."""
        self.apply_pending()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
