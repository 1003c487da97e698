"""``option()``: the dataclass field every config key is declared with, carrying the key's one-line
meaning (the reference ``moetrain train --help`` prints is generated from these)."""

from __future__ import annotations

from dataclasses import MISSING, field


def option(default=MISSING, help: str = ""):  # noqa: A002 - the name the reference shows
    """A config field with its one-line meaning (``moetrain train --help`` lists every key from these)."""
    return field(default=default, metadata={"help": help})
