"""The engine's batches object for M6: one data stream split between ranks and loader workers.

The stream is the sequence of samples of :class:`~m6_moe.tasks.TaskSampler`, global position
``p = epoch * epoch_size + offset``. Micro-step ``s`` (counted from where the stream was started)
takes the ``G = sum(batches)`` positions after ``start + s * G``, rank ``r`` the slice of
``batches[r]`` of them after the slices of ranks ``0 .. r - 1`` (:func:`rank_positions`), so
ranks read disjoint parts of every epoch and every rank, expert-parallel ones included, gets its
own data. With ``W`` loader workers, worker ``w`` makes micro-steps ``w, w + W, w + 2W, ...`` in
its own process (``torch.utils.data.DataLoader``, prefetching ``prefetch_factor`` batches each):
reading the record, decoding and resizing the image, tokenizing, the task and collation, so the
training process only receives tensors. A sample depends on its position alone, so the split
changes nothing in the data.

The data position is ``(epoch, offset)``, the same on every rank (each rank advances by ``G`` per
micro-step): it is what :meth:`M6Batches.state_dict` saves, with counters; no generator state is
needed. Resumed with another world size, ranks that loaded a saved position check they agree, and
ranks the saved run did not have (:meth:`M6Batches.reseed`) take rank 0's: the stream goes on
from the same position, so the rest of the epoch is still seen once. The ranks' micro-batch sizes
(unequal under hardware-aware balancing) and position are exchanged once, at the first draw after
construction, a change of ``batch`` or a resume (one ``all_gather_object`` over the world).

Bad records found by a worker (skip mode) are reported with the batch and counted by the training
process's dataset (``skipped_records``); with ``skip_bad_records`` off, the worker's one-line
``ValueError`` is raised in the training process.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from m6_moe.tasks import TASKS, TaskSampler, collate
from moetrain.validation import require_int

log = logging.getLogger("moetrain.m6_moe.loader")


def rank_positions(start: int, batches: tuple[int, ...], rank: int, step: int) -> range:
    """The global positions rank ``rank`` reads at micro-step ``step`` of a stream started at
    ``start`` whose ranks read ``batches[r]`` samples each per micro-step:
    ``start + step * sum(batches) + sum(batches[:rank]) + [0, batches[rank])``."""
    first = start + step * sum(batches) + sum(batches[:rank])
    return range(first, first + batches[rank])


@dataclass(frozen=True)
class StreamFailure:
    """A bad record that stops the run (skip mode off), found by a loader worker."""

    message: str
    traceback: str


class BatchStream(IterableDataset):
    """Rank ``rank``'s micro-batches from position ``start`` on: ``(inputs, labels, report)`` with
    ``report`` = ``{"step", "worker", "positions", "records", "tasks", "truncated", "bad"}``
    (``bad``: the ``(record, reason)`` of images this process found bad since its last report,
    ``reason`` None past the first ``MAX_STORED_REASONS``).
    Under a DataLoader, worker ``w`` of ``W`` yields micro-steps ``w, w + W, ...``."""

    def __init__(
        self, sampler: TaskSampler, start: int, batches: tuple[int, ...], rank: int, image_shape, length=None
    ):
        self.sampler, self.start, self.batches, self.rank = sampler, start, batches, rank
        self.image_shape, self.length = image_shape, length

    def micro_batch(self, step: int) -> tuple[dict, torch.Tensor, list]:
        size = self.sampler.epoch_size
        positions = rank_positions(self.start, self.batches, self.rank, step)
        samples = [self.sampler.sample_at(*divmod(p, size)) for p in positions]
        return (*collate(samples, self.sampler.tokenizer, self.image_shape, self.length), samples)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        dataset = self.sampler.dataset
        reported = len(dataset.bad_images_since(0))
        step = worker
        while True:
            try:
                inputs, labels, samples = self.micro_batch(step)
            except ValueError as error:
                yield StreamFailure(str(error), traceback.format_exc())
                return
            bad = dataset.bad_images_since(reported)
            reported += len(bad)
            report = {
                "step": step,
                "worker": worker,
                "positions": list(rank_positions(self.start, self.batches, self.rank, step)),
                "records": [s.record for s in samples],
                "tasks": [s.task for s in samples],
                "truncated": sum(s.truncated for s in samples),
                "bad": bad,
            }
            yield inputs, labels, report
            step += workers


class M6Batches:
    """The engine's batches object (see the module docstring): ``next() -> (inputs, labels)`` with
    ``batch`` samples (the engine may set ``batch`` per rank when it balances the global batch).

    ``rank`` / ``world_size``: this rank's data stream of ``world_size`` streams, and ``group`` the
    process group of one rank per stream in which it has rank ``rank`` (None: the world group;
    ``torch.distributed`` initialised when ``world_size > 1``). ``num_workers``: loader worker
    processes (0: load in this process).
    ``fixed_length``: every batch padded to ``L = T = seq_len`` (pipeline stages, which exchange
    fixed-shape tensors; the padding changes no loss). ``tokens_per_batch``: real (non-padding)
    positions per batch, image patches included, averaged over the batches drawn so far (before
    the first: the most a batch can hold, ``batch * (P + 2 * seq_len)``)."""

    def __init__(
        self,
        sampler: TaskSampler,
        batch: int,
        num_patches: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        group=None,
        fixed_length: bool = False,
    ):
        for name, value, low in (("batch", batch, 1), ("num_workers", num_workers, 0), ("rank", rank, 0)):
            require_int(name, value, low)
        if not rank < world_size:
            raise ValueError(f"rank must be in [0, world_size = {world_size}), got {rank}")
        self.sampler = sampler
        self.num_patches = num_patches
        self.rank, self.world_size, self.group = rank, world_size, group
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.length = sampler.seq_len if fixed_length else None
        dataset = sampler.dataset
        self.image_shape = (dataset.image_channels, dataset.image_size, dataset.image_size)
        self._batch = batch
        self.epoch = 0
        self.offset = 0
        self._position_known = True  # False after reseed(): rank 0's position is taken
        self._batches: tuple[int, ...] | None = None  # every rank's micro-batch, agreed at first draw
        self._iterator = None
        self._steps_since_start = 0
        self.batches_drawn = 0
        self.positions_drawn = 0
        self.truncated_samples = 0
        self.task_counts = dict.fromkeys(TASKS, 0)
        self.last_report: dict | None = None

    # ------------------------------------------------------------------------------- position
    @property
    def batch(self) -> int:
        return self._batch

    @batch.setter
    def batch(self, value: int) -> None:
        require_int("batch", value, 1)
        if value != self._batch:
            self._batch = value
            self._restart()

    @property
    def position(self) -> int:
        """Global position of the next micro-step's first sample: ``epoch * epoch_size + offset``."""
        return self.epoch * self.sampler.epoch_size + self.offset

    def _restart(self) -> None:
        """Drops the running stream (its workers stop); the next draw agrees on the layout again."""
        self.close()
        self._batches = None

    def _agree(self) -> tuple[int, ...]:
        """Every rank's micro-batch, and rank 0's position for ranks without one (one collective)."""
        if self.world_size == 1:
            self._position_known = True
            return (self._batch,)
        mine = (self._batch, self.epoch, self.offset, self._position_known, self.sampler.epoch_size)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        _, epoch, offset, known, size = everyone[0]
        for rank, (_, e, o, k, n) in enumerate(everyone):
            if n != size:
                raise ValueError(
                    f"rank {rank} has {n} records per epoch, rank 0 has {size}: every rank must read the "
                    "same manifests with the same task weights"
                )
            if known and k and (e, o) != (epoch, offset):
                raise ValueError(
                    f"data positions differ: rank 0 is at epoch {epoch} sample {offset}, rank {rank} at "
                    f"epoch {e} sample {o}"
                )
        self.epoch, self.offset, self._position_known = epoch, offset, True
        return tuple(b for b, *_ in everyone)

    def _start(self):
        stream = BatchStream(
            self.sampler, self.position, self._batches, self.rank, self.image_shape, self.length
        )
        self._steps_since_start = 0
        if self.num_workers == 0:
            return iter(stream)
        loader = DataLoader(
            stream,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            generator=torch.Generator(),  # leaves the training process's RNG untouched
        )
        return iter(loader)

    def _advance(self, samples: int) -> None:
        size = self.sampler.epoch_size
        epoch, self.offset = divmod(self.offset + samples, size)
        if epoch and self.rank == 0:
            log.debug("data: epoch %d begins (%d records per epoch)", self.epoch + epoch, size)
        self.epoch += epoch

    # ---------------------------------------------------------------------------------- draws
    def next(self) -> tuple[dict, torch.Tensor]:
        if self._batches is None:
            self._batches = self._agree()
        if self._iterator is None:
            self._iterator = self._start()
        try:
            item = next(self._iterator)
        except BaseException:
            # A dead worker leaves the iterator broken; the position has not moved, so the next
            # draw restarts the workers there.
            self.close()
            raise
        if isinstance(item, StreamFailure):
            self.close()
            log.debug("data loading failed:\n%s", item.traceback)
            raise ValueError(item.message)
        inputs, labels, report = item
        if report["step"] != self._steps_since_start:
            self.close()
            raise RuntimeError(
                f"loader returned micro-step {report['step']}, expected {self._steps_since_start}"
            )
        self._steps_since_start += 1
        dataset = self.sampler.dataset
        for record, reason in report["bad"]:
            dataset.note_bad(record, reason)
        for task in report["tasks"]:
            self.task_counts[task] += 1
        self.truncated_samples += report["truncated"]
        self.last_report = report
        self._advance(sum(self._batches))
        self.batches_drawn += 1
        self.positions_drawn += int(
            inputs["prefix_mask"].sum()
            + inputs["target_mask"].sum()
            + inputs["image_mask"].sum() * self.num_patches
        )
        return inputs, labels

    def draw(self, start: int, count: int, sampler: TaskSampler | None = None) -> tuple[dict, torch.Tensor]:
        """The batch of the ``count`` samples at global positions ``start ..`` (in this process; the
        position and the counters do not move)."""
        sampler = sampler or self.sampler
        samples = [sampler.sample_at(*divmod(p, sampler.epoch_size)) for p in range(start, start + count)]
        return collate(samples, sampler.tokenizer, self.image_shape, self.length)

    def probe(self, sequences: int, seed: int) -> tuple[dict, torch.Tensor]:
        """A batch of ``sequences`` samples from a separate stream seeded with ``seed`` (profiling,
        calibration) at the largest shape a batch can take: padded to ``L = T = seq_len`` with every
        position and image marked real (``prefix_mask``, ``target_mask``, ``image_mask`` all True;
        the labels of padding stay ignored), so the memory measured on it (the engine's recompute
        plan) bounds every training batch, whose padding is neither attended nor routed. The data
        position and the counters do not move."""
        sampler = self.sampler.with_seed(seed)
        samples = [sampler.sample_at(*divmod(p, sampler.epoch_size)) for p in range(sequences)]
        inputs, labels = collate(samples, sampler.tokenizer, self.image_shape, sampler.seq_len)
        for name in ("prefix_mask", "target_mask", "image_mask"):
            inputs[name] = torch.ones_like(inputs[name])
        return inputs, labels

    def reseed(self, seed: int, rank: int, step: int) -> None:
        """For a rank the saved run did not have (resuming with more ranks): it takes rank 0's
        position at the next draw, so the stream goes on where the saved run stopped."""
        self._position_known = False
        self._restart()

    @property
    def tokens_per_batch(self) -> int:
        if self.batches_drawn == 0:
            return self._batch * (self.num_patches + 2 * self.sampler.seq_len)
        return round(self.positions_drawn / self.batches_drawn)

    @property
    def skipped_records(self) -> int:
        """Bad records skipped so far (manifest lines, and images found by this rank's loader)."""
        return self.sampler.dataset.skipped_records

    def skip_summary(self, max_reasons: int = 3) -> str:
        """One line for the logs: the count of skipped bad records and the first ``max_reasons``
        reasons (:meth:`ManifestDataset.skip_summary`). The count grows during the run as images
        are first loaded, so it is worth reporting at the end as well as at the start."""
        return self.sampler.dataset.skip_summary(max_reasons)

    # --------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "epoch_size": self.sampler.epoch_size,
            "seed": self.sampler.seed,
            "batches_drawn": self.batches_drawn,
            "positions_drawn": self.positions_drawn,
            "task_counts": dict(self.task_counts),
            "truncated_samples": self.truncated_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resumes at the saved position. A position saved for another number of records per epoch
        or another seed (the manifests, task weights or seed changed) is kept as ``(epoch,
        offset)``, with a warning: the rest of that epoch is then not the saved run's."""
        if "epoch" not in state:
            log.warning("data position saved by an older version (no epoch / offset): starting at epoch 0")
            self.epoch = self.offset = 0
        else:
            size = self.sampler.epoch_size
            if (state["epoch_size"], state["seed"]) != (size, self.sampler.seed):
                log.warning(
                    "data position saved for %d records per epoch and seed %d, now %d and %d: resuming at "
                    "epoch %d sample %d of the new order",
                    state["epoch_size"], state["seed"], size, self.sampler.seed,
                    state["epoch"], state["offset"],
                )  # fmt: skip
            self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
            if self.offset >= size:
                self.epoch, self.offset = self.epoch + 1, 0
        self.batches_drawn = int(state["batches_drawn"])
        self.positions_drawn = int(state["positions_drawn"])
        self.task_counts = {task: int(state["task_counts"].get(task, 0)) for task in TASKS}
        self.truncated_samples = int(state["truncated_samples"])
        self._position_known = True
        self._restart()

    def close(self) -> None:
        """Stops the loader workers (a later draw starts them again)."""
        self._iterator = None  # the DataLoader iterator shuts its workers down when released

    def __del__(self) -> None:
        self._iterator = None
