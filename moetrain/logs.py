"""Where moetrain's log records go when a command runs (library modules only log).

Every module logs through ``logging.getLogger("moetrain.<module>")``; nothing in the package adds a
handler or prints, so a user of the library controls the output with ``logging`` as usual. The
command line calls :func:`configure_console` once and, when a run has an output directory,
:func:`attach_rank_log`:

- console: rank 0 writes records of ``level`` and above to stderr; every other rank only errors
  (so that a failure on any rank is seen, and 480 ranks do not repeat rank 0's progress);
- file: every rank appends every record of ``level`` and above to ``out_dir/logs/rank_<r>.log``,
  tracebacks included, with a timestamp and the logger's name.

stdout is left to what a command is asked to print (``moetrain plan --json``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
PACKAGE_LOGGER = "moetrain"
_HANDLER_MARK = "_moetrain_cli_handler"


def _loggers() -> list[logging.Logger]:
    """``moetrain`` and the top-level packages of the registered models (``m6_moe``, a user's
    package): the command line shows their records alike."""
    from moetrain.registry import registered_models

    names = {spec.builder.__module__.split(".")[0] for spec in registered_models().values()}
    return [logging.getLogger(name) for name in [PACKAGE_LOGGER, *sorted(names - {PACKAGE_LOGGER})]]


def _drop_our_handlers(logger: logging.Logger, kind: str) -> None:
    for handler in list(logger.handlers):
        if getattr(handler, _HANDLER_MARK, None) == kind:
            logger.removeHandler(handler)
            handler.close()


class OneLineFormatter(logging.Formatter):
    """The message alone: tracebacks attached to a record go to the log file, not the console."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage()


def configure_console(level: str = "INFO", rank: int = 0) -> None:
    """Sends the package's records to stderr: ``level`` and above on rank 0, errors elsewhere."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(getattr(logging, level) if rank == 0 else logging.ERROR)
    handler.setFormatter(OneLineFormatter())
    setattr(handler, _HANDLER_MARK, "console")
    for logger in _loggers():
        _drop_our_handlers(logger, "console")
        logger.addHandler(handler)
        logger.setLevel(min(getattr(logging, level), logger.level or logging.WARNING))
        logger.propagate = False


def attach_rank_log(out_dir: str | Path, rank: int, level: str = "INFO") -> Path:
    """Appends this rank's records to ``out_dir/logs/rank_<rank>.log``; returns the file's path."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    path = Path(out_dir) / "logs" / f"rank_{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(getattr(logging, level))
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
    setattr(handler, _HANDLER_MARK, "file")
    for logger in _loggers():
        _drop_our_handlers(logger, "file")
        logger.addHandler(handler)
        logger.setLevel(min(getattr(logging, level), logger.level or logging.WARNING))
    return path


def detach_handlers() -> None:
    """Removes the handlers the command line added (tests and repeated in-process runs)."""
    for logger in _loggers():
        for kind in ("console", "file"):
            _drop_our_handlers(logger, kind)
