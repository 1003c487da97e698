"""Saying where a run failed, in one line: rank, step, phase and the module that raised; and the
exit code a run ends with.

The module is found from the exception's traceback, not from hooks: the innermost frame whose
``self`` is a module of the model names it (``blocks.2.ffn (MoELayer)``), so nothing runs on the
hot path. Errors raised inside autograd's backward have no such frame; the phase says "backward".

Exit codes (``moetrain train``, and ``moetrain launch`` passing on its ranks'):

- ``EXIT_FINISHED`` 0: the run reached ``steps``;
- ``EXIT_RUN_FAILED`` 1: the run failed once it had started training (a full disk, a refused
  non-finite checkpoint, a lost rank, ``max_consecutive_skips``), or anything unexpected;
- ``EXIT_BAD_INPUT`` 2: bad input found before training started: the config, a data file, a
  manifest, a checkpoint to resume from, a taken ``out_dir``;
- ``EXIT_PREEMPTED`` 75 (``EX_TEMPFAIL``: "try again later"): stopped by SIGTERM, after
  checkpointing the step reached (or during set-up, before there was anything new to save);
  resubmitting resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

from torch import nn

EXIT_FINISHED = 0
EXIT_RUN_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 75

# What a collective says when a peer's process is gone (its sockets closed): gloo, NCCL, TCPStore.
LOST_CONNECTION_TEXT = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "ncclremoteerror",
)


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) arrived outside the training loop (set-up, resuming), where there is
    nothing to checkpoint: raised by the command line's handler so that every ``finally`` runs
    (the ``out_dir`` lock is released). A ``BaseException``, like ``KeyboardInterrupt``, so that no
    ``except Exception`` on the way swallows it."""


def is_lost_connection(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says that a peer process went away."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).lower()
        if any(marker in text for marker in LOST_CONNECTION_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def exit_code(error: BaseException, position: RunPosition, input_errors: tuple[type, ...]) -> int:
    """The exit code of a run that raised ``error``: ``EXIT_PREEMPTED`` for :class:`Interrupted`;
    ``EXIT_BAD_INPUT`` for one of ``input_errors`` raised before training started (no step begun:
    ``position.step`` is None); ``EXIT_RUN_FAILED`` otherwise (the same kinds of error once steps
    run are failures of the run: a full disk, a refused save)."""
    if isinstance(error, Interrupted):
        return EXIT_PREEMPTED
    if position.step is None and isinstance(error, input_errors):
        return EXIT_BAD_INPUT
    return EXIT_RUN_FAILED


@dataclass
class RunPosition:
    """Where a run is: updated by the engine as it goes (``step`` is the step being run: the
    number of completed optimizer steps + 1 inside a step, None before training starts).
    ``stall``: the watchdog's finding while this rank is stuck where it is (the ranks that stopped
    or lag behind; :class:`moetrain.watchdog.Watchdog`), None once it moves on. ``watchdog``: that
    watchdog while it runs, asked to look once more (``look_now()``) before an error line is written;
    after a failed set-up, stopped, having looked already (:class:`moetrain.engine.Trainer`).
    ``progress``: how many times ``phase`` changed since ``step`` began (kept by ``__setattr__``)."""

    rank: int = 0
    step: int | None = None
    phase: str = "set-up"
    model: nn.Module | None = None  # the model once built (to name the module that raised)
    stall: str | None = None
    watchdog: object | None = None
    progress: int = 0

    def __setattr__(self, name: str, value) -> None:
        """Counts ``progress``: a new ``step`` resets it to 0, a new ``phase`` adds 1. Ranks pass
        the same phases in the same order, so at one step the larger count is the rank further on
        (:mod:`moetrain.watchdog` compares ``(step, progress)``, not phase names)."""
        if name == "step" and value != getattr(self, "step", value):
            object.__setattr__(self, "progress", 0)
        elif name == "phase" and value != getattr(self, "phase", value):
            object.__setattr__(self, "progress", getattr(self, "progress", 0) + 1)
        object.__setattr__(self, name, value)


def module_in_traceback(traceback: TracebackType | None, model: nn.Module | None) -> str | None:
    """``"name (Class)"`` of the innermost module of ``model`` whose method is on the traceback."""
    if traceback is None or model is None:
        return None
    names = {id(module): name for name, module in model.named_modules()}
    found = None
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = f"{names[id(owner)] or '<model>'} ({type(owner).__name__})"
        traceback = traceback.tb_next
    return found


def first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def describe_failure(
    error: BaseException, position: RunPosition, model: nn.Module | None = None, log_path=None
) -> str:
    """``rank R, step S, <phase> of module M: [<stall>; ]<Error>: <first line>; full traceback in
    <log>``; ``<stall>``: the watchdog's finding when this rank was stuck waiting for others
    (``rank 1 stopped making progress at step 5, forward (last heard 7 s ago)``), which a
    collective's timeout error does not name."""
    where = [f"rank {position.rank}"]
    if position.step is not None:
        where.append(f"step {position.step}")
    module = module_in_traceback(error.__traceback__, model)
    where.append(f"{position.phase} of module {module}" if module else position.phase)
    stall = f"{position.stall}; " if position.stall else ""
    text = f"{', '.join(where)}: {stall}{first_line(error)}"
    if log_path is not None:
        text += f"; full traceback in {log_path}"
    return text
