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


def is_finite_number(value) -> bool:
    return is_number(value) and math.isfinite(value)


def _number_range(low, high, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"a finite number {'>' if low_open else '>='} {low}"
    if high is not None:
        return f"a finite number {'<' if high_open else '<='} {high}"
    return "a finite number"


def require_number(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
    note: str = "",
) -> None:
    """A finite number with ``value >= low`` (``>`` when ``low_open``) and ``value <= high`` (``<``
    when ``high_open``), each bound only when given; or None when ``allow_none``. ``note``:
    appended to the allowed values, e.g. ``"(Gbit/s)"``."""
    if value is None and allow_none:
        return
    ok = (
        is_finite_number(value)
        and (low is None or (value > low if low_open else value >= low))
        and (high is None or (value < high if high_open else value <= high))
    )
    if not ok:
        allowed = _number_range(low, high, low_open, high_open) + (f" {note}" if note else "")
        raise ValueError(f"{name} must be {allowed}{' or None' if allow_none else ''}, got {value!r}")


def require_numbers(name: str, values, *, count: int | None = None, **bounds) -> tuple[float, ...]:
    """A list or tuple of numbers (exactly ``count`` when given), each checked by
    :func:`require_number` with ``bounds`` as ``name[i]``; returns them as floats."""
    if not isinstance(values, (list, tuple)) or (count is not None and len(values) != count):
        raise ValueError(
            f"{name} must be a list of {'' if count is None else f'{count} '}numbers, got {values!r}"
        )
    for i, value in enumerate(values):
        require_number(f"{name}[{i}]", value, **bounds)
    return tuple(float(value) for value in values)


def require_nonneg_float(name: str, value, allow_none: bool = False) -> None:
    """A finite number >= 0 (or None when ``allow_none``)."""
    require_number(name, value, low=0, allow_none=allow_none)


def require_positive_float(name: str, value, allow_none: bool = False) -> None:
    """A finite number > 0 (or None when ``allow_none``)."""
    require_number(name, value, low=0, low_open=True, allow_none=allow_none)


def require_fraction(name: str, value, *, upper_open: bool = True) -> None:
    """A number in [0, 1) (or [0, 1] when not ``upper_open``)."""
    require_number(name, value, low=0, high=1, high_open=upper_open)


def require_bool(name: str, value, allow_none: bool = False, note: str = "") -> None:
    """True or False (or None when ``allow_none``). ``note``: appended, e.g. ``"(True: AdamW)"``."""
    if not (isinstance(value, bool) or (allow_none and value is None)):
        allowed = "True or False" + (" or None" if allow_none else "") + (f" {note}" if note else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
