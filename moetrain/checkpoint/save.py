"""Writing checkpoints: atomically, and optionally in the background while training goes on.

Save protocol (a collective: every rank calls it):

1. every rank builds its entries (:mod:`moetrain.checkpoint.entries`) and checks that no weight or
   optimizer state is inf / NaN (such a checkpoint is never written);
2. rank 0 creates ``step_XXXXXXXX.tmp/``;
3. asynchronous only: every rank copies its entries into host memory (*staging*, the only part
   the training loop waits for) and hands them to a background thread;
4. DCP writes the files (fsynced); the ranks checksum them (each a share); rank 0 writes
   ``manifest.json`` and renames the directory to ``step_XXXXXXXX/`` (the commit point), then
   prunes old checkpoints.

A crash at any point before the rename leaves only a ``.tmp`` directory, never a checkpoint that
looks complete. A failure (a full disk, an unwritable directory) ends with a
:class:`CheckpointError` naming the path and the cause on every rank, and the ``.tmp`` directory is
removed; earlier checkpoints are untouched.

In the background the collectives run on a process group of their own (gloo), so they never
interleave with the training step's collectives; at most one save is in flight
(:meth:`CheckpointWriter.save` first waits for the previous one).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from moetrain.checkpoint.directory import checkpoint_path, prune, publish, tmp_path
from moetrain.checkpoint.entries import (
    encode_objects,
    expert_key,
    expert_params,
    model_entries,
    non_finite_entries,
    optimizer_entries,
    parameter_names,
    rng_state,
    unwrap,
)
from moetrain.checkpoint.integrity import FORMAT, VERSION, checksum_share, write_manifest
from moetrain.checkpoint.ranks import CheckpointError, RankLayout, agree, broadcast, rank_layout
from moetrain.validation import require_int

log = logging.getLogger(__name__)

# DCP warns on every call without a process group; here that case is chosen explicitly (no_dist).
NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _require_step(step: Any) -> None:
    require_int("step", step, 0)


def _require_keep_last(keep_last: Any) -> None:
    require_int("keep_last", keep_last, 1, allow_none=True)


def _os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: itself, its cause or context, or one rank's failure inside a
    DCP ``CheckpointException``."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        if isinstance(current, CheckpointException):
            pending += [
                failure[0] if isinstance(failure, tuple) else failure for failure in current.failures.values()
            ]
        pending += [current.__cause__, current.__context__]
    return None


def describe_save_failure(error: BaseException, step: int, tmp_dir: Path) -> CheckpointError:
    """One line: which checkpoint, where, and why (a full disk named as such)."""
    if isinstance(error, CheckpointError):
        return error
    os_error = _os_error_in(error)
    if os_error is not None and os_error.errno == errno.ENOSPC:
        cause = f"no space left on device ({os_error.filename or tmp_dir})"
    elif os_error is not None:
        cause = f"{os_error.strerror or os_error} ({os_error.filename or tmp_dir})"
    else:
        first = str(error).strip().splitlines()
        cause = f"{type(error).__name__}: {first[-1] if first else ''}"
    return CheckpointError(
        f"checkpoint step {step} could not be written to {tmp_dir}: {cause}; the partial files were removed "
        "and earlier checkpoints are intact"
    )


@dataclass
class SaveResult:
    """What a finished save reports: its path, bytes written, the seconds the caller was blocked
    (``blocking_s``: building and staging the entries, or the whole save when synchronous) and the
    seconds of the whole save (``total_s``)."""

    step: int
    path: Path
    total_bytes: int
    blocking_s: float
    total_s: float


class CheckpointWriter:
    """Saves the checkpoints of one run into ``directory``.

    ``asynchronous``: the caller returns after staging (a host-memory copy of its entries), the
    write and commit run on a background thread with their own process group; ``wait()`` returns
    the last save's :class:`SaveResult` (raising its error, if any). ``last_blocking``: ``(step,
    seconds)`` of the newest ``save()``, how long it held its caller (as ``SaveResult.blocking_s``),
    known as soon as ``save()`` returns. ``keep_last``: complete checkpoints kept (an integer >= 1,
    or None: keep all). ``timeout_s``: timeout of the background process group (None: torch's
    default). Construct it on every rank (it creates a process group when torch.distributed is
    initialised).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        parallel=None,
        keep_last: int | None = 3,
        asynchronous: bool = False,
        timeout_s: float | None = None,
    ):
        _require_keep_last(keep_last)
        self.directory = Path(directory)
        self.parallel = parallel
        self.keep_last = keep_last
        self.asynchronous = bool(asynchronous)
        self.group = None
        if self.asynchronous and dist.is_available() and dist.is_initialized():
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._thread: threading.Thread | None = None
        self._outcome: SaveResult | BaseException | None = None
        self.last_result: SaveResult | None = None
        self.last_blocking: tuple[int, float] | None = None

    # --------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """A background save has started and not been waited for."""
        return self._thread is not None

    def failed(self) -> bool:
        """The background save has finished with an error (not yet raised by :meth:`wait`)."""
        return (
            self._thread is not None
            and not self._thread.is_alive()
            and isinstance(self._outcome, BaseException)
        )

    def wait(self) -> SaveResult | None:
        """Waits for the background save; returns its result or raises its error."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, BaseException):
            raise outcome
        self.last_result = outcome
        return outcome

    def close(self) -> None:
        """Waits for a save in flight and releases the process group."""
        try:
            self.wait()
        finally:
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None

    def _expert_counts(self, experts: dict) -> dict[str, int]:
        """``{expert parameter: total experts}`` of the whole model (over pipeline stages: one
        ``all_gather_object`` over this rank's pipeline)."""
        counts = {name: total for name, (_, _, total) in experts.items()}
        if getattr(self.parallel, "pp_size", 1) > 1:
            gathered: list[Any] = [None] * self.parallel.pp_size
            dist.all_gather_object(gathered, counts, group=self.parallel.pp_group)
            counts = {name: total for stage in gathered for name, total in stage.items()}
        return counts

    # --------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        extra_state: Any = None,
    ) -> Path:
        """Saves ``directory/step_XXXXXXXX``; a collective (every rank calls it). Returns the path
        the checkpoint will have once complete. ``extra_state``: a tree of dicts, lists, tuples,
        numbers, strings, None and tensors, saved per rank. Raises ``ValueError`` when the step's
        checkpoint already exists, :class:`CheckpointError` when a weight or optimizer state is
        not finite or the write fails."""
        self.wait()
        started = time.perf_counter()
        rng = rng_state()  # before anything here could draw a random number
        _require_step(step)
        model = unwrap(model)
        layout = rank_layout(self.parallel, model, self.group)
        final_dir = checkpoint_path(self.directory, step)
        tmp_dir = tmp_path(final_dir)

        experts = expert_params(model)
        entries = model_entries(model, experts)
        if optimizer is not None:
            entries.update(optimizer_entries(optimizer, parameter_names(model), experts))
            if getattr(self.parallel, "pp_size", 1) > 1:
                entries["optim/param_groups"] = pipeline_param_groups(
                    entries["optim/param_groups"], self.parallel
                )
        error = None
        bad = non_finite_entries(entries)
        if bad:
            error = CheckpointError(
                f"checkpoint step {step} not written: non-finite values (inf or NaN) in {', '.join(bad)}; "
                "the weights or optimizer state are damaged, earlier checkpoints are kept"
            )
        agree(error, layout)
        if scheduler is not None:
            entries["scheduler"] = scheduler.state_dict()
        entries[f"extra_state/rank_{layout.rank}"] = extra_state
        entries[f"rng/rank_{layout.rank}"] = rng
        try:
            entries = encode_objects(entries)
        except TypeError as caught:
            error = ValueError(f"checkpoint step {step}: {caught}")
        agree(error, layout)

        if layout.is_coordinator:
            log.info(
                "checkpoint: saving step %d to %s (world %d, ep_size %d, tp_size %d%s)",
                step, final_dir, layout.world_size, layout.ep_size, layout.tp_size,
                ", in the background" if self.asynchronous else "",
            )  # fmt: skip
            try:
                if final_dir.exists():
                    raise ValueError(f"step {step}: checkpoint {final_dir} already exists")
                final_dir.parent.mkdir(parents=True, exist_ok=True)
                if tmp_dir.exists():  # debris of a crashed save of this step
                    shutil.rmtree(tmp_dir)
                tmp_dir.mkdir()
            except (OSError, ValueError) as caught:
                error = (
                    caught if isinstance(caught, ValueError) else describe_save_failure(caught, step, tmp_dir)
                )
        agree(error, layout)

        job = _SaveJob(
            step=step,
            entries=entries,
            layout=layout,
            tmp_dir=tmp_dir,
            final_dir=final_dir,
            expert_counts=self._expert_counts(experts),
            has_optimizer=optimizer is not None,
            has_scheduler=scheduler is not None,
            keep_last=self.keep_last,
            started=started,
        )
        if not self.asynchronous:
            job.blocking_s = None
            self.last_result = job.run()
            self.last_blocking = (step, self.last_result.blocking_s)
            return final_dir
        job.entries = _stage(entries)
        job.blocking_s = time.perf_counter() - started
        self.last_blocking = (step, job.blocking_s)

        def background() -> None:
            try:
                _yield_cpu_to_training()
                self._outcome = job.run()
            except BaseException as caught:  # noqa: BLE001 - handed to wait()
                self._outcome = caught

        self._thread = threading.Thread(target=background, name=f"moetrain-checkpoint-{step}", daemon=True)
        self._thread.start()
        return final_dir


def pipeline_param_groups(groups: list[dict], parallel) -> list[dict]:
    """The optimizer's param groups of the whole model under pipeline stages: each group's
    parameter names of every stage, in stage order (one ``all_gather_object`` over the ranks of
    this rank's pipeline), so every rank saves the same entry as a ``pp = 1`` run would."""
    gathered: list[Any] = [None] * parallel.pp_size
    dist.all_gather_object(gathered, [group["params"] for group in groups], group=parallel.pp_group)
    return [
        {**group, "params": [name for stage in gathered for name in stage[g]]}
        for g, group in enumerate(groups)
    ]


def _yield_cpu_to_training() -> None:
    """Lowers this thread's scheduling priority (Linux: niceness is per thread), so that the
    background write takes the CPU time the training step leaves over."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux / not allowed: it just competes
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _stage(entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host-memory copy of every entry (the training step may change the originals in place;
    a DTensor's copy is a DTensor of the same layout holding a host copy of its shard)."""
    return {key: value.detach().to("cpu", copy=True) for key, value in entries.items()}


@dataclass
class _SaveJob:
    step: int
    entries: dict[str, torch.Tensor]
    layout: RankLayout
    tmp_dir: Path
    final_dir: Path
    expert_counts: dict[str, int]
    has_optimizer: bool
    has_scheduler: bool
    keep_last: int | None
    started: float
    blocking_s: float | None = None

    def run(self) -> SaveResult:
        """Writes, checks and commits; on any failure removes the ``.tmp`` directory and raises
        the same one-line :class:`CheckpointError` on every rank."""
        layout = self.layout
        try:
            error = None
            try:
                metadata = self._dcp_save()
            except (Exception, CheckpointException) as caught:  # noqa: BLE001 - agreed below
                error, metadata = describe_save_failure(caught, self.step, self.tmp_dir), None
            agree(error, layout)
            agree(_check_saved_experts(metadata, self.expert_counts), layout)
            listing = sorted(p.name for p in self.tmp_dir.iterdir()) if layout.is_coordinator else None
            names = broadcast(listing, layout)
            files = checksum_share(self.tmp_dir, names, layout)
            total = sum(info["bytes"] for info in files.values())
            error = None
            if layout.is_coordinator:
                try:
                    write_manifest(self.tmp_dir, self._manifest(files, total))
                    publish(self.tmp_dir, self.final_dir)
                    prune(self.final_dir.parent, self.keep_last, self.final_dir)
                except Exception as caught:  # noqa: BLE001 - re-raised on every rank by agree
                    error = describe_save_failure(caught, self.step, self.tmp_dir)
            agree(error, layout)
        except BaseException:
            if layout.is_coordinator and self.tmp_dir.exists():
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
            raise
        elapsed = time.perf_counter() - self.started
        if layout.is_coordinator:
            log.info(
                "checkpoint: saved step %d: %s in %.2f s (%s)",
                self.step,
                format_bytes(total),
                elapsed,
                self.final_dir,
            )
        blocking = elapsed if self.blocking_s is None else self.blocking_s
        return SaveResult(self.step, self.final_dir, total, blocking, elapsed)

    def _dcp_save(self):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NO_DIST_WARNING, category=UserWarning)
            return dcp.save(
                self.entries,
                storage_writer=dcp.FileSystemWriter(self.tmp_dir, sync_files=True, single_file_per_rank=True),
                planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                process_group=self.layout.group,
                no_dist=not self.layout.distributed,
            )

    def _manifest(self, files: dict, total: int) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "world_size": self.layout.world_size,
            "ep_size": self.layout.ep_size,
            "tp_size": self.layout.tp_size,
            "experts": self.expert_counts,
            "optimizer": self.has_optimizer,
            "scheduler": self.has_scheduler,
            "total_bytes": total,
            "files": files,
            "torch_version": torch.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }


def _check_saved_experts(metadata, expert_counts: dict[str, int]) -> ValueError | None:
    """Every global expert of every expert parameter was written by some rank (checked on the
    global DCP metadata, which every rank receives)."""
    saved = metadata.state_dict_metadata
    for name, count in expert_counts.items():
        missing = [g for g in range(count) if "model/" + expert_key(name, g) not in saved]
        if missing:
            return ValueError(
                f"save: experts {missing} of parameter {name!r} were written by no rank (expected global "
                f"experts 0..{count - 1}); the ParallelContext does not match the model's expert layout"
            )
    return None


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    extra_state: Any = None,
    parallel=None,
    keep_last: int | None = 3,
) -> Path:
    """Saves ``directory/step_XXXXXXXX`` atomically and synchronously; a collective.

    ``model``: the model (a ``DistributedDataParallel`` wrapper is unwrapped); ``optimizer``: any
    torch optimizer over the model's parameters, its state stored by parameter name;
    ``scheduler``: anything with ``state_dict()``; ``extra_state``: a tree of plain values and
    tensors, saved per rank (e.g. the data position); ``parallel``: the ``ParallelContext`` the
    model was built with (required when its experts are sharded); ``keep_last``: complete
    checkpoints kept in ``directory``. Returns the checkpoint's path."""
    writer = CheckpointWriter(directory, parallel=parallel, keep_last=keep_last)
    return writer.save(step, model=model, optimizer=optimizer, scheduler=scheduler, extra_state=extra_state)
