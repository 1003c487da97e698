"""Hardware-aware batch balancing (Whale, Jia et al. 2022): faster ranks take more of the batch.

On a cluster of mixed GPUs, synchronous data parallelism with equal micro-batches runs at the
pace of the slowest GPU. Balancing gives data-parallel rank r a micro-batch ``n_r`` (sequences)
proportional to its speed ``s_r`` (sequences/s), within its memory limit ``m_r`` (sequences), with
``sum_r n_r = N`` (the global batch) so that every rank finishes at about the same time:

    minimise  max_r (o_r + n_r / s_r)   subject to  sum_r n_r = N,  1 <= n_r <= m_r,  n_r integer

(``o_r``: optional fixed time per step). Greedy water-filling solves it exactly: start from
``n_r = 1`` and give each further sequence to the rank whose time after taking it,
``o_r + (n_r + 1) / s_r``, is least (ties: lowest rank). Without limits this is ``n_r`` about
``N * s_r / sum s``.

The gradient must still be that of the global batch. Each rank averages its loss over its own
``n_r`` sequences, and DDP (and ``ExpertGradReducer``) average over the W ranks, so rank r must
scale its mean loss by

    w_r = W * n_r / N        (equivalently: sum its per-sequence losses and divide by N, times W)

which makes ``(1 / W) * sum_r w_r * grad(mean_r) = (1 / N) * sum_samples grad(loss)``, the
gradient of the mean loss of the global batch, whatever the split. Per-token losses: use token
counts instead of sequence counts (``n_r`` = tokens of rank r, N = all tokens).

Use::

    speeds = calibrate_speeds(lambda n: train_step_on(n), sizes=(2, 4, 8), group=dp_group)
    plan = balance_batch(global_batch=256, speeds=[s.samples_per_s for s in speeds],
                         memory_limits=[16, 16, 8, 8], overheads=[s.overhead_s for s in speeds])
    n, w = plan.micro_batches[rank], plan.loss_weights[rank]
    set_aux_loss_scale(model, w)                      # aux losses weighted alike, before the forward
    (loss_fn(model(batch[:n])) * w).backward()        # DDP averages as usual

:func:`moetrain.planner.mixed.plan_mixed_cluster` predicts the speed-up for a mixed cluster.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetrain.validation import require_int, require_numbers


@dataclass(frozen=True)
class BatchAssignment:
    """Result of :func:`balance_batch`.

    ``micro_batches[r]``: sequences for rank r (sum = ``global_batch``); ``loss_weights[r]`` =
    ``W * n_r / N``: the factor rank r multiplies its mean loss by; ``step_time``: the predicted
    ``max_r (o_r + n_r / s_r)`` (seconds when speeds are sequences/s); ``uniform_step_time``: the
    same with equal micro-batches ``N / W`` (inf when N is not divisible by W or a rank's memory
    limit is below ``N / W``)."""

    global_batch: int
    micro_batches: tuple[int, ...]
    loss_weights: tuple[float, ...]
    speeds: tuple[float, ...]
    step_time: float
    uniform_step_time: float

    @property
    def speedup(self) -> float:
        """``uniform_step_time / step_time`` (inf when uniform batches are impossible)."""
        return self.uniform_step_time / self.step_time

    def to_dict(self) -> dict:
        return {
            "global_batch": self.global_batch,
            "micro_batches": list(self.micro_batches),
            "loss_weights": list(self.loss_weights),
            "speeds": list(self.speeds),
            "step_time": self.step_time,
            "uniform_step_time": self.uniform_step_time,
            "speedup": self.speedup,
        }


def balance_batch(
    global_batch: int,
    speeds: Sequence[float],
    memory_limits: Sequence[int] | None = None,
    overheads: Sequence[float] | None = None,
) -> BatchAssignment:
    """Micro-batch per data-parallel rank for ``global_batch`` sequences (see the module docstring).

    ``speeds[r]``: sequences/s of rank r (any common unit works: relative speeds give relative
    times); ``memory_limits[r]``: the most sequences rank r fits (None: no limit);
    ``overheads[r]``: fixed seconds per step of rank r (None: 0). Every rank gets at least one
    sequence. ValueError when ``global_batch < W`` or above the sum of the limits."""
    speeds = _listed("speeds", speeds, "numbers > 0, one per data-parallel rank")
    world = len(speeds)
    if world == 0:
        raise ValueError("speeds must hold one speed per data-parallel rank, got an empty list")
    require_int("global_batch", global_batch, world, note="(the ranks: each takes at least one sequence)")
    speeds = list(require_numbers("speeds", speeds, low=0, low_open=True))
    overheads = (
        [0.0] * world
        if overheads is None
        else list(require_numbers("overheads", _listed("overheads", overheads, "numbers >= 0"), low=0))
    )
    if len(overheads) != world:
        raise ValueError(f"overheads must have one entry per rank ({world}), got {len(overheads)}")
    if memory_limits is None:
        limits = [global_batch] * world
    else:
        limits = _listed("memory_limits", memory_limits, "integers >= 1 (sequences)")
        if len(limits) != world:
            raise ValueError(f"memory_limits must have one entry per rank ({world}), got {len(limits)}")
        for i, limit in enumerate(limits):
            require_int(f"memory_limits[{i}]", limit, 1, note="(sequences)")
        if sum(limits) < global_batch:
            raise ValueError(
                f"global_batch = {global_batch} exceeds the sum of memory_limits = {sum(limits)} "
                f"(sequences the ranks can hold together)"
            )

    sizes = _fill(
        _start_below(global_batch, speeds, limits, overheads), global_batch, speeds, limits, overheads
    )
    if not _greedy_prefix(sizes, speeds, limits, overheads):  # the start overshot (rounding): from ones
        sizes = _fill([1] * world, global_batch, speeds, limits, overheads)
    step = max(overheads[r] + sizes[r] / speeds[r] for r in range(world))
    uniform = math.inf
    if global_batch % world == 0 and all(limit >= global_batch // world for limit in limits):
        share = global_batch // world
        uniform = max(overheads[r] + share / speeds[r] for r in range(world))
    weights = tuple(world * n / global_batch for n in sizes)
    return BatchAssignment(global_batch, tuple(sizes), weights, tuple(speeds), step, uniform)


def _listed(name: str, values, allowed: str) -> list:
    """``values`` as a list; a ValueError naming ``name`` when it is not a sequence (None, a number)."""
    try:
        return list(values)
    except TypeError:
        raise ValueError(f"{name} must be a list of {allowed}, got {values!r}") from None


def _key(r: int, k: int, speeds, overheads) -> tuple[float, int, int]:
    """Where rank r's k-th sequence comes in the greedy's order: its time after taking it, then the
    rank (ties: lowest first), then k."""
    return overheads[r] + k / speeds[r], r, k


def _fill(start: list[int], total: int, speeds, limits, overheads) -> list[int]:
    """The greedy of the module docstring from ``start`` (``1 <= start[r] <= limits[r]``, summing to
    at most ``total``): each further sequence to the rank whose time after taking it is least."""
    sizes = list(start)
    heap = [_key(r, sizes[r] + 1, speeds, overheads)[:2] for r in range(len(sizes)) if sizes[r] < limits[r]]
    heapq.heapify(heap)
    for _ in range(total - sum(sizes)):
        _, r = heapq.heappop(heap)
        sizes[r] += 1
        if sizes[r] < limits[r]:
            heapq.heappush(heap, _key(r, sizes[r] + 1, speeds, overheads)[:2])
    return sizes


def _start_below(total: int, speeds, limits, overheads) -> list[int]:
    """Sizes at most the greedy's for every rank, about ``2 * W`` short of ``total`` in all, so that
    :func:`_fill` has O(W) sequences left to place (not ``total - W``). From the water level ``L``
    whose sizes ``clamp(floor((L - o_r) * s_r), 1, m_r)`` sum to at most ``total`` (bisection): the
    sequences taking a rank to a time below ``L`` are at most ``total - W``, so the greedy gives
    them all; one fewer per rank leaves room for rounding (:func:`_greedy_prefix` checks)."""
    world = len(speeds)

    def level_sizes(level: float) -> list[int]:
        sizes = []
        for speed, limit, overhead in zip(speeds, limits, overheads, strict=True):
            fill = (level - overhead) * speed
            sizes.append(limit if fill >= limit else max(1, math.floor(fill)))
        return sizes

    low = min(overheads)  # every rank at 1
    high = max(o + m / s for s, m, o in zip(speeds, limits, overheads, strict=True))  # every rank full
    best = [1] * world
    for _ in range(64):
        middle = (low + high) / 2
        if sum(best) >= total - world or not low < middle < high:
            break
        sizes = level_sizes(middle)
        if sum(sizes) <= total:
            low, best = middle, sizes
        else:
            high = middle
    return [max(1, size - 1) for size in best]


def _greedy_prefix(sizes: list[int], speeds, limits, overheads) -> bool:
    """Whether every sequence given beyond each rank's first comes before every one not given, in
    the greedy's order (:func:`_key`): then ``sizes`` are what the greedy from ones gives."""
    world = len(sizes)
    given = [_key(r, sizes[r], speeds, overheads) for r in range(world) if sizes[r] > 1]
    left = [_key(r, sizes[r] + 1, speeds, overheads) for r in range(world) if sizes[r] < limits[r]]
    return not given or not left or max(given) < min(left)


def loss_weight(micro_batch: int, global_batch: int, world_size: int) -> float:
    """``world_size * micro_batch / global_batch``: the factor a rank multiplies its mean loss by so
    that DDP's average over ranks is the mean over the global batch."""
    if not (0 < micro_batch <= global_batch) or world_size < 1:
        raise ValueError(
            f"need 0 < micro_batch <= global_batch and world_size >= 1, got micro_batch={micro_batch}, "
            f"global_batch={global_batch}, world_size={world_size}"
        )
    return world_size * micro_batch / global_batch


@dataclass(frozen=True)
class RankSpeed:
    """One rank's calibration: ``time = overhead_s + n / samples_per_s`` for n sequences, fitted by
    least squares over the timed sizes (median of the repeats per size)."""

    samples_per_s: float
    overhead_s: float
    timings: dict[int, float]


def calibrate(
    step_fn: Callable[[int], object], sizes: Sequence[int] = (1, 2, 4), repeats: int = 3, warmup: int = 1
) -> RankSpeed:
    """Times ``step_fn(n)`` (one training micro-step of n sequences: forward, backward, no
    optimizer step needed) on this rank for each n in ``sizes`` and fits ``t = o + n / s``.
    ``step_fn`` must synchronise its device (e.g. ``torch.cuda.synchronize()``) before returning.
    With a single size, the overhead is taken as 0."""
    given = _listed("sizes", sizes, "integers >= 1 (sequences)")
    if not given:
        raise ValueError(f"sizes must be a non-empty list of integers >= 1 (sequences), got {sizes!r}")
    for i, n in enumerate(given):  # in the caller's order: the index names their entry
        require_int(f"sizes[{i}]", n, 1, note="(sequences)")
    sizes = sorted(set(given))
    require_int("repeats", repeats, 1)
    require_int("warmup", warmup, 0)
    timings = {}
    for n in sizes:
        for _ in range(warmup):
            step_fn(n)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            step_fn(n)
            samples.append(time.perf_counter() - start)
        timings[n] = statistics.median(samples)
    if len(sizes) == 1:
        return RankSpeed(sizes[0] / timings[sizes[0]], 0.0, timings)
    mean_n = statistics.fmean(sizes)
    mean_t = statistics.fmean(timings.values())
    slope = sum((n - mean_n) * (timings[n] - mean_t) for n in sizes) / sum((n - mean_n) ** 2 for n in sizes)
    if slope <= 0:
        raise ValueError(
            f"calibration: step time does not grow with the batch ({timings}); "
            "use larger sizes or more repeats"
        )
    return RankSpeed(1.0 / slope, max(0.0, mean_t - slope * mean_n), timings)


def gather_speeds(local: RankSpeed, group=None) -> list[RankSpeed]:
    """Every rank's :class:`RankSpeed` in rank order of ``group`` (all ranks call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    nccl = dist.get_backend(group) == "nccl"  # NCCL gathers device tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mine = torch.tensor([local.samples_per_s, local.overhead_s], dtype=torch.float64, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [RankSpeed(float(t[0]), float(t[1]), {}) for t in gathered]


def calibrate_speeds(
    step_fn: Callable[[int], object],
    sizes: Sequence[int] = (1, 2, 4),
    repeats: int = 3,
    warmup: int = 1,
    group=None,
) -> list[RankSpeed]:
    """:func:`calibrate` on every rank, then :func:`gather_speeds`: the same list on all ranks.

    A rank whose calibration fails still joins the gather (with a NaN speed), so every rank
    raises the same ValueError instead of the others waiting for it forever."""
    try:
        local, failure = calibrate(step_fn, sizes, repeats, warmup), None
    except ValueError as error:
        local, failure = RankSpeed(math.nan, 0.0, {}), error
    speeds = gather_speeds(local, group)
    failed = [rank for rank, speed in enumerate(speeds) if math.isnan(speed.samples_per_s)]
    if failed:
        reason = f": {failure}" if failure is not None else ""
        raise ValueError(f"speed calibration failed on ranks {failed}{reason}")
    return speeds
