"""What ``moetrain eval`` and ``moetrain generate`` share: decoding options, log output, safe writes.

Both commands are objects with ``add_arguments(parser)`` (their options; ``moetrain`` has added
``--config``, ``--set`` and ``--checkpoint``) and ``run(args, config) -> exit code``; bad input
raises ``ValueError`` / ``CheckpointError`` / ``OSError``, which ``moetrain`` prints as one line
(exit code 2). What a command is asked for goes to stdout (scores, captions, ``--json``);
progress bars and log records (checkpoint loading, decoding settings) go to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from moetrain.logs import LEVELS
from moetrain.metrics import replace_text

PACKAGE_LOGGER = "m6_moe"
DEFAULT_BEAMS = 4
DEFAULT_LENGTH_PENALTY = 1.0
# What torch.Generator.manual_seed takes: a signed or an unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_decoding_options(parser: argparse.ArgumentParser, config_help: str) -> None:
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        metavar="N",
        help=f"most tokens generated per input, eos included (default: {config_help})",
    )
    parser.add_argument(
        "--num-beams", type=positive_int, help=f"--strategy beam: beams per input (default {DEFAULT_BEAMS})"
    )
    parser.add_argument(
        "--length-penalty",
        type=float,
        help="--strategy beam: a hypothesis scores logprob / length ** this (default "
        f"{DEFAULT_LENGTH_PENALTY})",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute the whole sequence at every step instead of using the key/value cache "
        "(same output, slower)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--log-level", choices=LEVELS, default="INFO", help="records shown on stderr (default INFO)"
    )


def beam_options(args) -> dict:
    """``num_beams`` and ``length_penalty`` for the library; a ``ValueError`` when either option
    was given with another strategy than beam, or ``--length-penalty`` is not finite."""
    if args.strategy != "beam":
        if args.num_beams is not None or args.length_penalty is not None:
            raise ValueError("only --strategy beam takes --num-beams and --length-penalty")
        return {}
    if args.length_penalty is not None and not math.isfinite(args.length_penalty):
        raise ValueError(f"--length-penalty must be a finite number, got {args.length_penalty}")
    return {
        "num_beams": DEFAULT_BEAMS if args.num_beams is None else args.num_beams,
        "length_penalty": DEFAULT_LENGTH_PENALTY if args.length_penalty is None else args.length_penalty,
    }


def check_seed(seed: int | None) -> None:
    """One-line ``ValueError`` unless ``--seed`` is None or in :data:`SEED_RANGE`."""
    low, high = SEED_RANGE
    if seed is not None and not low <= seed <= high:
        raise ValueError(f"--seed must be an integer in [-2**63, 2**64 - 1] = [{low}, {high}], got {seed}")


def check_output_file(option: str, path: Path) -> None:
    """One-line ``ValueError`` naming ``option`` unless :func:`write_atomically` can write
    ``path``: it is not an existing directory or other non-regular file, and its nearest existing
    ancestor is a writable directory (the missing ones are created when it is written)."""
    try:
        if path.exists() and not path.is_file():
            kind = "a directory" if path.is_dir() else "not a regular file"
            raise ValueError(f"{option} {path}: is {kind}; give the path of a file to write")
        parent = path.absolute().parent
        while not parent.exists():
            parent = parent.parent
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot be checked ({error})") from None
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: directory {parent} is not writable")


def write_output(option: str, path: Path, text: str) -> None:
    """:func:`write_atomically`, an ``OSError`` reworded as one line naming ``option`` and ``path``."""
    try:
        write_atomically(path, text)
    except OSError as error:
        raise OSError(f"{option} {path}: {error.strerror or error}") from None


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` (its missing directories created) through a temporary file synced and
    renamed over it, mode ``0o666 & ~umask`` as ``open`` gives (:func:`moetrain.metrics.replace_text`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, text)
