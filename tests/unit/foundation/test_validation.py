"""The one set of validation helpers (moetrain.validation) and a guard that keeps it the only one."""

from __future__ import annotations

import math
import re

import pytest

from moetrain.validation import require_bool, require_int, require_number, require_numbers
from tests.helpers.paths import ROOT


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (True, {}, "x must be a finite number, got True"),
        (math.nan, {"low": 0}, "x must be a finite number >= 0, got nan"),
        (math.inf, {"low": 0}, "x must be a finite number >= 0, got inf"),
        (0, {"low": 0, "low_open": True}, "x must be a finite number > 0, got 0"),
        (2, {"high": 1, "high_open": True}, "x must be a finite number < 1, got 2"),
        (1, {"low": 0, "high": 1, "high_open": True}, "x must be a number in [0, 1), got 1"),
        (0, {"low": 0, "high": 1, "low_open": True}, "x must be a number in (0, 1], got 0"),
        ("1", {"low": 0, "note": "(Gbit/s)"}, "x must be a finite number >= 0 (Gbit/s), got '1'"),
        (-1, {"low": 0, "allow_none": True}, "x must be a finite number >= 0 or None, got -1"),
    ],
)
def test_require_number_names_the_allowed_range(value, bounds, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        require_number("x", value, **bounds)


def test_require_number_accepts_ints_floats_and_bounds_inclusive_by_default():
    for value in (0, 0.5, 1, 1.0):
        require_number("x", value, low=0, high=1)
    require_number("x", None, low=0, allow_none=True)


def test_require_numbers_checks_the_count_and_names_the_element():
    assert require_numbers("betas", [0.9, 0], count=2, low=0, high=1, high_open=True) == (0.9, 0.0)
    with pytest.raises(ValueError, match=r"^betas must be a list of 2 numbers, got \(0\.9,\)$"):
        require_numbers("betas", (0.9,), count=2)
    with pytest.raises(ValueError, match=r"^betas must be a list of numbers, got '0.9'$"):
        require_numbers("betas", "0.9")
    with pytest.raises(ValueError, match=r"^speeds\[1\] must be a finite number > 0, got False$"):
        require_numbers("speeds", [1.0, False], low=0, low_open=True)


def test_require_bool_and_int_never_take_one_for_the_other():
    with pytest.raises(ValueError, match=r"^flag must be True or False \(True: on\), got 1$"):
        require_bool("flag", 1, note="(True: on)")
    with pytest.raises(ValueError, match=r"^n must be an integer >= 1, got True$"):
        require_int("n", True, 1)


# The hand-written forms of these checks: a type test for bool, or a negated type test for int /
# float (``isinstance(v, bool) or not isinstance(v, int) or v < 1``). Outside moetrain/validation.py
# they belong in a call of its helpers.
HAND_WRITTEN = re.compile(
    r"isinstance\([^()]*,\s*bool\s*\)|not\s+isinstance\([^()]*,\s*(?:int|float|\(\s*int\s*,\s*float\s*\))\s*\)"
)


def hand_written_checks(text: str) -> list[str]:
    return [m.group(0) for m in HAND_WRITTEN.finditer(text)]


def test_the_guard_recognises_hand_written_checks():
    assert hand_written_checks("if isinstance(n, bool) or not isinstance(n, int) or n < 1:") == [
        "isinstance(n, bool)",
        "not isinstance(n, int)",
    ]
    assert hand_written_checks("ok = not isinstance(v, (int, float))") == ["not isinstance(v, (int, float))"]
    assert hand_written_checks("if isinstance(x, torch.Tensor) and is_int(n):") == []


def test_no_hand_written_validation_outside_the_helpers():
    found = []
    for package in ("moetrain", "models"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "moetrain" / "validation.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if hand_written_checks(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "use moetrain.validation's require_* helpers:\n" + "\n".join(found)
