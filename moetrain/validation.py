"""The checks every option and argument goes through: one line naming the field, what is allowed
and what was given (``ValueError``). ``bool`` is never taken for an ``int``: ``True`` is not a count."""

from __future__ import annotations

import math


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_int(name: str, value, minimum: int, *, allow_none: bool = False, note: str = "") -> None:
    """An integer >= ``minimum`` (or None when ``allow_none``). ``note``: appended to the allowed
    values, e.g. ``"(sequences)"``."""
    if value is None and allow_none:
        return
    if not is_int(value) or value < minimum:
        allowed = f"an integer >= {minimum}{f' {note}' if note else ''}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def require_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def require_nonneg_float(name: str, value, allow_none: bool = False) -> None:
    """A finite number >= 0 (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if not is_number(value) or not math.isfinite(value) or value < 0:
        allowed = "a finite number >= 0" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def require_positive_float(name: str, value, allow_none: bool = False) -> None:
    """A finite number > 0 (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        allowed = "a finite number > 0" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def require_fraction(name: str, value, *, upper_open: bool = True) -> None:
    """A number in [0, 1) (or [0, 1] when not ``upper_open``)."""
    if (
        not is_number(value)
        or not math.isfinite(value)
        or value < 0
        or (value >= 1 if upper_open else value > 1)
    ):
        raise ValueError(f"{name} must be a number in [0, 1{')' if upper_open else ']'}, got {value!r}")


def require_bool(name: str, value, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        raise ValueError(f"{name} must be True or False{' or None' if allow_none else ''}, got {value!r}")
