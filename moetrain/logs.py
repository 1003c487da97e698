"""Where moetrain's log records go when a command runs (library modules only log).

Every module logs through ``logging.getLogger("moetrain.<module>")``; nothing in the package adds a
handler or prints, so a user of the library controls the output with ``logging`` as usual. The
command line calls :func:`configure_console` once and, when a run has an output directory,
:func:`attach_rank_log`:

- console: rank 0 writes records of ``level`` and above to stderr; every other rank only errors
  (so that a failure on any rank is seen, and 480 ranks do not repeat rank 0's progress); progress
  bars (``moetrain.progress``) are redrawn in place when stderr is a terminal, plain lines otherwise;
- file: every rank appends every record of ``level`` and above to ``out_dir/logs/rank_<r>.log``,
  tracebacks included, with a timestamp and the logger's name (a progress bar's lines, not its
  redraws).

stdout is left to what a command is asked to print (``moetrain plan --json``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

from moetrain.progress import progress_kind

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
PACKAGE_LOGGER = "moetrain"
PROGRESS_LOGGER = "moetrain.progress"
_HANDLER_MARK = "_moetrain_cli_handler"
_SAVED_MARK = "_moetrain_saved_settings"


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


def _configure(logger: logging.Logger, level: int, propagate: bool | None = None) -> None:
    """Lowers ``logger``'s level to ``level`` (and sets ``propagate``), remembering the settings it
    had before the command line first touched it, which :func:`detach_handlers` restores."""
    if not hasattr(logger, _SAVED_MARK):
        setattr(logger, _SAVED_MARK, (logger.level, logger.propagate))
    logger.setLevel(min(level, logger.level or logging.WARNING))
    if propagate is not None:
        logger.propagate = propagate


class OneLineFormatter(logging.Formatter):
    """The message alone: tracebacks attached to a record go to the log file, not the console."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage()


def _drop_progress_redraws(record: logging.LogRecord) -> bool:
    return progress_kind(record) not in ("redraw", "end")


class ConsoleHandler(logging.StreamHandler):
    """Records of ``level`` and above on ``stream``, the message alone, one line each. The lines of a
    :class:`moetrain.progress.ProgressBar` are plain lines too, unless ``stream`` is a terminal and
    ``level`` is INFO or DEBUG: then the bar is redrawn in place on every update (``\\r``), and a
    record logged while a bar is shown clears the bar's line, is written, and the bar is drawn again
    below it; the bar's ``close()`` ends its line."""

    def __init__(self, stream: TextIO, level: int):
        super().__init__(stream)
        self.show_level = level
        self.redraws = level <= logging.INFO and hasattr(stream, "isatty") and stream.isatty()
        self.setLevel(logging.DEBUG if self.redraws else level)  # the bar's redraws are DEBUG records
        self.setFormatter(OneLineFormatter())
        self._bar = ""  # the bar line shown now (terminal), "" when none

    def filter(self, record: logging.LogRecord) -> bool:
        kind = progress_kind(record)
        if kind in ("redraw", "end"):
            return self.redraws
        return record.levelno >= self.show_level and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        if not self.redraws:
            super().emit(record)
            return
        try:
            kind = progress_kind(record)
            stream = self.stream
            if kind == "end":
                if self._bar:
                    stream.write("\n")
                self._bar = ""
            elif kind is not None:
                line = self.format(record)
                stream.write("\r" + line + " " * max(0, len(self._bar) - len(line)))
                self._bar = line
            else:
                if self._bar:
                    stream.write("\r" + " " * len(self._bar) + "\r")
                stream.write(self.format(record) + "\n" + self._bar)
            self.flush()
        except Exception:  # noqa: BLE001 - logging's convention: report through handleError
            self.handleError(record)


def configure_console(level: str = "INFO", rank: int = 0) -> None:
    """Sends the package's records to stderr: ``level`` and above on rank 0, errors elsewhere
    (a :class:`ConsoleHandler`: progress bars redrawn in place on a terminal)."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = ConsoleHandler(sys.stderr, getattr(logging, level) if rank == 0 else logging.ERROR)
    setattr(handler, _HANDLER_MARK, "console")
    for logger in _loggers():
        _drop_our_handlers(logger, "console")
        logger.addHandler(handler)
        _configure(logger, getattr(logging, level), propagate=False)
    if handler.redraws:
        _configure(logging.getLogger(PROGRESS_LOGGER), logging.DEBUG)


def attach_rank_log(out_dir: str | Path, rank: int, level: str = "INFO") -> Path:
    """Appends this rank's records to ``out_dir/logs/rank_<rank>.log``; returns the file's path."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    path = Path(out_dir) / "logs" / f"rank_{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(getattr(logging, level))
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_drop_progress_redraws)
    setattr(handler, _HANDLER_MARK, "file")
    for logger in _loggers():
        _drop_our_handlers(logger, "file")
        logger.addHandler(handler)
        _configure(logger, getattr(logging, level))
    return path


def detach_handlers() -> None:
    """Removes the handlers the command line added and restores the levels and propagation it
    changed (tests and repeated in-process runs)."""
    for logger in [*_loggers(), logging.getLogger(PROGRESS_LOGGER)]:
        for kind in ("console", "file"):
            _drop_our_handlers(logger, kind)
        if hasattr(logger, _SAVED_MARK):
            logger.setLevel(getattr(logger, _SAVED_MARK)[0])
            logger.propagate = getattr(logger, _SAVED_MARK)[1]
            delattr(logger, _SAVED_MARK)
