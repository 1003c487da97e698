"""Autocast helpers that also work on devices without autocast (``meta``: building and tracing a
model without memory)."""

from __future__ import annotations

import contextlib

import torch

from moetrain._torch_compat import assume_constant_result


@assume_constant_result
def autocast_available(device_type: str) -> bool:
    """``torch.amp.is_autocast_available``, a constant while tracing: torch 2.11's dynamo cannot
    trace the call itself (``fullgraph=True`` fails), and the answer depends only on the device type."""
    return torch.amp.is_autocast_available(device_type)


def autocast_enabled(device_type: str) -> bool:
    return autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on ``x`` run in: autocast's dtype for ``x``'s device when autocast is on
    there and ``x`` is not fp64 (torch's autocast casts every other float dtype and leaves fp64
    alone), else ``x.dtype``."""
    device_type = x.device.type
    if x.dtype == torch.float64 or not autocast_enabled(device_type):
        return x.dtype
    return torch.get_autocast_dtype(device_type)


def autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)``, or nothing where autocast does not exist."""
    if autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()
