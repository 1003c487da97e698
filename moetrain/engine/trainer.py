"""The :class:`Trainer`: the run's one object, made of the engine's four parts (set-up, step,
metrics, loop), and its life cycle: built (set-up released on any failure), trained, closed or
released after a failure.
"""

from __future__ import annotations

import logging

from moetrain.config import TrainConfig
from moetrain.engine.loop import TrainingLoop
from moetrain.engine.setup import RunSetUp
from moetrain.engine.step import TrainingStep
from moetrain.engine.step_metrics import StepMetrics
from moetrain.failures import RunPosition

log = logging.getLogger(__name__)


class Trainer(TrainingLoop, TrainingStep, StepMetrics, RunSetUp):
    """Builds everything a run needs from a validated :class:`TrainConfig`, then ``train()``.

    ``position`` says where the run is (rank, step, phase), for :func:`moetrain.failures.describe_failure`.

    The methods come from the engine's parts: :class:`~moetrain.engine.setup.RunSetUp` (building
    the run), :class:`~moetrain.engine.step.TrainingStep` (one optimizer step),
    :class:`~moetrain.engine.step_metrics.StepMetrics` (a logging step's metrics) and
    :class:`~moetrain.engine.loop.TrainingLoop` (the loop, checkpoints, resuming).
    """

    def __init__(
        self, config: TrainConfig, position: RunPosition | None = None, on_out_dir_locked=None, auto=None
    ):
        """``on_out_dir_locked(rank)``: called once this run owns ``out_dir`` (the command line
        then starts the rank's log file there). ``auto``: the decision for modules built under
        ``scope.auto()`` (``parallelize``'s ``auto``; the command line passes the planner's
        ``RunAutoSplit`` when ``parallel.auto_gpu`` is set). When set-up fails at any stage (or is
        interrupted: any exception, ``KeyboardInterrupt`` included) what it had started is released before the
        exception propagates: the ``out_dir`` lock, the watchdog, the data loader, the checkpoint
        writer. A watchdog already started first looks at the heartbeats (``look_now``: after a
        lost connection it names the rank that crashed in ``position.stall``) and, stopped, stays
        in ``position.watchdog`` for the caller's error path (:meth:`_release_failed_set_up`)."""
        self.config = config
        self.auto = auto
        self.position = position if position is not None else RunPosition()
        self.lock = self.watchdog = self.writer = self.batches = None
        try:
            self._set_up(config, on_out_dir_locked)
        except BaseException as error:
            self._release_failed_set_up(error)
            raise

    def _release_failed_set_up(self, error: BaseException) -> None:
        """Set-up failed with ``error``: the watchdog (if started) looks at the heartbeats while it
        still runs, as the command line does for a failure in training, so that this rank's error
        line names a rank that crashed during set-up; then :meth:`release`. The stopped watchdog is
        left in ``position.watchdog``: the command line's error path no longer asks it to look (it
        has), but a rank serving the rendezvous store still waits there for the others' look
        (``keep_store_for_the_others``) after destroying its process groups."""
        watchdog = self.watchdog
        if watchdog is not None:
            try:
                watchdog.look_now(error)
            except Exception as caught:  # noqa: BLE001 - set-up has already failed; this is secondary
                log.error("watchdog: could not look at the heartbeats: %s", caught)
        self.release()
        self.position.watchdog = watchdog

    def close(self) -> None:
        """Waits for a checkpoint still being written, then :meth:`release`."""
        try:
            self.writer.close()
        finally:
            self.release()

    def _stop_optimizer_worker(self) -> None:
        """Ends the delayed offloaded update's host thread, if any (``OffloadOptimizer.close``
        writes a pending update first; a checkpoint already recorded it)."""
        stop = getattr(getattr(self, "optimizer", None), "close", None)
        if not callable(stop):
            return
        try:
            stop()
        except Exception as error:  # noqa: BLE001 - releasing after a failure: report, go on
            log.error("optimizer: the delayed update's host thread failed: %s", error)

    def release(self) -> None:
        """After a failure: lets a checkpoint still being written finish (it holds a good state; its
        collectives end within ``dist_timeout_s`` if another rank is gone), stops the data loader's
        workers (batches with a ``close()``) and the watchdog and releases ``out_dir``. The process
        groups can then be destroyed safely. Safe on a trainer whose set-up stopped part-way."""
        try:
            if self.writer is not None:
                self.writer.close()
        except Exception as error:  # noqa: BLE001 - the run has already failed; this is secondary
            log.error("checkpoint in flight when the run failed: %s", error)
        close_batches = getattr(self.batches, "close", None)
        if callable(close_batches):
            close_batches()
        self._stop_optimizer_worker()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = self.position.watchdog = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
