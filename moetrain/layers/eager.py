"""Methods that a compiled graph calls instead of tracing: the dispatchers' exchanges.

``@runs_eagerly`` marks such a method. Under ``torch.compile`` the call runs eagerly, as
``torch.compiler.disable`` makes it, so a compiled layer breaks its graph around the exchange and
nowhere else; outside a compiled graph the method runs as written.

``torch.compiler.disable`` imports ``torch._dynamo`` (1-3 s, ``python -X importtime``), which
``import moetrain`` must not pay: the wrapping is made when it is first needed, by the first call
or by :func:`prepare_eager_methods` (which an expert-parallel dispatcher calls when it is built, so
that a graph traced before any eager call already meets the wrapped method and breaks at it, with
the method's name in the break reason). The class keeps the same function object throughout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def runs_eagerly(method: Callable) -> Callable:
    """Decorator: ``method`` runs eagerly under ``torch.compile`` (``torch.compiler.disable``, made
    on first need; see the module docstring)."""
    disabled: Callable | None = None

    def prepare() -> Callable:
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(method)
        return disabled

    @functools.wraps(method)
    def call(*args, **kwargs):
        return (disabled or prepare())(*args, **kwargs)

    call.prepare_eager = prepare
    return call


def prepare_eager_methods(cls: type) -> None:
    """Makes the ``torch.compiler.disable`` wrapping of every ``@runs_eagerly`` method of ``cls``
    (and its bases) now, so that dynamo's first trace of them already sees it."""
    for klass in cls.__mro__:
        for value in vars(klass).values():
            prepare = getattr(value, "prepare_eager", None)
            if prepare is not None:
                prepare()
