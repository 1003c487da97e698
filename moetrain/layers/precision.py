"""Autocast helpers that also work on devices without autocast (``meta``: building and tracing a
model without memory)."""

from __future__ import annotations

import contextlib

import torch


def autocast_enabled(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on ``x`` run in: autocast's dtype for ``x``'s device when autocast is on
    there, else ``x.dtype``."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if autocast_enabled(device_type) else x.dtype


def autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)``, or nothing where autocast does not exist."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()
