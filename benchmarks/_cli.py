"""What the benchmark scripts share: ``argparse`` types that refuse out-of-range numbers with
argparse's own one-line error naming the flag (``argument --repeats: must be an integer >= 1, got
0``, exit status 2, before any work), and atomic writes of their outputs (a killed run or a full disk
leaves the previous file, never part of a new one). Not a benchmark."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

from moetrain.metrics import replace_text


def int_in(minimum: int, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    """An ``argparse`` type: an integer ``>= minimum`` (and ``<= maximum`` when given); ``why``, when
    given, follows the allowed range in the error."""
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}{why}, got {text}")
        return value

    return parse


def number_at_least(minimum: float, why: str = "") -> Callable[[str], float]:
    """An ``argparse`` type: a finite number ``>= minimum``, written as an int or a float (``2e7``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"must be a number >= {minimum:g}{why}, got {text}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An ``argparse`` type: a finite number ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


positive_int = int_in(1)
nonnegative_int = int_in(0)


def existing_file(text: str) -> str:
    """An ``argparse`` type: the path of a readable file."""
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"no readable file at {text!r}")
    return text


def existing_directory(text: str) -> str:
    """An ``argparse`` type: the path of a directory that exists."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no directory at {text!r}")
    return text


def output_path(text: str) -> str:
    """An ``argparse`` type: a file path whose directory exists (checked before the run, not after)."""
    directory = os.path.dirname(text) or "."
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory!r} does not exist")
    return text


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` through a temporary file in the same directory, fsynced,
    then ``os.replace`` (:func:`moetrain.metrics.replace_text`): ``path`` holds its old content or
    all of the new, never a part. The file keeps its permission bits (a new one gets the umask's)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = None
    replace_text(path, text, mode)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def write_json(path: str | os.PathLike, data, indent: int | None = 2) -> None:
    """``data`` as JSON (and a final newline) to ``path``, atomically (:func:`write_atomic`)."""
    write_atomic(path, json.dumps(data, indent=indent) + "\n")
