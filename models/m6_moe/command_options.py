"""What ``moetrain eval`` and ``moetrain generate`` share: decoding options, log output, safe writes.

Both commands are objects with ``add_arguments(parser)`` (their options; ``moetrain`` has added
``--config``, ``--set`` and ``--checkpoint``) and ``run(args, config) -> exit code``; bad input
raises ``ValueError`` / ``CheckpointError`` / ``OSError``, which ``moetrain`` prints as one line
(exit code 2). What a command is asked for goes to stdout (scores, captions, ``--json``);
progress bars and log records (checkpoint loading, decoding settings) go to stderr.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from moetrain.logs import LEVELS

PACKAGE_LOGGER = "m6_moe"
DEFAULT_BEAMS = 4
DEFAULT_LENGTH_PENALTY = 1.0


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
    was given with another strategy than beam."""
    if args.strategy != "beam":
        if args.num_beams is not None or args.length_penalty is not None:
            raise ValueError("only --strategy beam takes --num-beams and --length-penalty")
        return {}
    return {
        "num_beams": DEFAULT_BEAMS if args.num_beams is None else args.num_beams,
        "length_penalty": DEFAULT_LENGTH_PENALTY if args.length_penalty is None else args.length_penalty,
    }


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
