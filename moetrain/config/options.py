"""``option()``: the dataclass field every config key is declared with, carrying the key's one-line
meaning (the reference ``moetrain train --help`` prints is generated from these); ``short_repr()``:
a value as the config's error lines show it."""

from __future__ import annotations

import reprlib
from dataclasses import MISSING, field


def option(default=MISSING, help: str = ""):  # noqa: A002 - the name the reference shows
    """A config field with its one-line meaning (``moetrain train --help`` lists every key from these)."""
    return field(default=default, metadata={"help": help})


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 400  # a long path stays whole
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT.maxlevel = 2


def short_repr(value) -> str:
    """``repr(value)`` cut for an error line (:mod:`reprlib`): strings to 400 characters (paths stay
    whole), the first 6 items of a container, 2 levels deep; ``...`` marks what is left out."""
    return _SHORT.repr(value)
