"""Loading a checkpoint: verify every file, check every entry, read, and only then change anything.

Loading first verifies every file against the manifest (size, then sha256; the ranks share the
work) and raises :class:`CheckpointError` naming the file before anything is read; then it checks
every entry the current model and optimizer need; only then does it read (tensors only, through
:mod:`moetrain.checkpoint.safe_dcp`: nothing stored in a checkpoint is ever executed), and it
changes the model, optimizer, scheduler and RNG only after everything was read. Errors are agreed
between the ranks, so every rank raises and none hangs in a collective. Entries of things not
passed (no ``optimizer`` or ``scheduler`` argument) are not read.

Cost: load allocates one extra copy of this rank's model and optimizer state while reading.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.checkpoint.directory import MANIFEST, checkpoint_path, latest_checkpoint, list_checkpoints
from moetrain.checkpoint.entries import expert_params, parameter_names, restore_rng, unwrap
from moetrain.checkpoint.integrity import read_manifest, verify_share
from moetrain.checkpoint.ranks import CheckpointError, RankLayout, agree, barrier, broadcast, rank_layout
from moetrain.checkpoint.restore import (
    Request,
    optimizer_state_dict,
    request_model,
    request_optimizer,
    take_offload_masters,
)
from moetrain.checkpoint.safe_dcp import SafeFileSystemReader, TensorOnlyLoadPlanner, read_metadata
from moetrain.checkpoint.save import NO_DIST_WARNING, format_bytes
from moetrain.validation import require_int

log = logging.getLogger(__name__)


def _require_step(step: Any) -> None:
    require_int("step", step, 0)


def _resolve(directory: Path, step: int | None) -> Path:
    """The checkpoint to load: ``directory`` itself when it holds a manifest (any name: a copied or
    set-aside checkpoint; ``step`` must be None), else ``directory``'s checkpoint of ``step``."""
    if (directory / MANIFEST).is_file():
        if step is not None:
            raise ValueError(
                f"{directory}: step must be None for a checkpoint directory (it holds one step), got {step}"
            )
        return directory
    if step is None:
        path = latest_checkpoint(directory)
        if path is None:
            raise FileNotFoundError(f"no complete checkpoint in {directory}")
        return path
    _require_step(step)
    path = checkpoint_path(directory, step)
    if not (path / MANIFEST).is_file():
        available = [s for s, _ in list_checkpoints(directory)]
        raise FileNotFoundError(
            f"no complete checkpoint for step {step} in {directory} (complete: {available})"
        )
    return path


def _verified_manifest(path: Path, layout: RankLayout) -> dict[str, Any]:
    """The manifest of ``path`` after every rank checked its share of the files; raises on every
    rank when any rank found a problem."""
    manifest, error = None, None
    try:
        manifest = read_manifest(path)
    except CheckpointError as caught:
        error = caught
    agree(error, layout)
    agree(verify_share(path, manifest["files"], layout), layout)
    return manifest


def verify_checkpoint(path: str | os.PathLike, *, parallel=None, model: nn.Module | None = None) -> dict:
    """Checks checkpoint ``path`` (manifest, every file's size and sha256, DCP metadata read with the
    restricted unpickler) without loading it; a collective. Returns the manifest or raises
    :class:`CheckpointError`."""
    layout = rank_layout(parallel, model if model is not None else nn.Module())
    path = Path(path)
    manifest = _verified_manifest(path, layout)
    error = None
    try:
        read_metadata(path, _file_bytes(manifest))
    except CheckpointError as caught:
        error = caught
    agree(error, layout)
    return manifest


def _file_bytes(manifest: dict[str, Any]) -> dict[str, int]:
    """``{file name: bytes}`` of the files ``manifest`` lists (what :func:`read_metadata` bounds
    each record by)."""
    return {name: info["bytes"] for name, info in manifest["files"].items()}


def _dcp_load(request: Request, path: Path, files: dict[str, int], layout: RankLayout) -> None:
    """Reads the requested tensors in place; a damaged or crafted data file is a CheckpointError."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NO_DIST_WARNING, category=UserWarning)
            dcp.load(
                request.entries,
                storage_reader=SafeFileSystemReader(path, files, metadata=request.metadata),
                planner=TensorOnlyLoadPlanner(),
                no_dist=not layout.distributed,
            )
    except CheckpointException as error:
        causes = [
            failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()
        ]
        own = next((c for c in causes if isinstance(c, CheckpointError)), None)
        if own is not None:
            raise own from None
        first = causes[0] if causes else error
        line = (str(first).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{path}: a data file could not be read safely ({type(first).__name__}: {line})"
        ) from None


def load_checkpoint(
    directory: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    parallel=None,
    step: int | None = None,
    extra_state_rank: int | None = None,
) -> dict[str, Any]:
    """Loads ``directory``'s checkpoint of ``step`` (None: the latest complete one), or
    ``directory`` itself when it is a checkpoint (holds ``manifest.json``; ``step`` None); a collective.

    Verifies the files, then checks and reads the entries this rank needs, then sets the model
    (values cast to each parameter's dtype), the optimizer (state mapped by parameter name), the
    scheduler and this rank's RNG states. Returns a dict:

    - ``step``: the checkpoint's step; ``path``: its directory;
    - ``extra_state``: the ``extra_state`` saved by rank ``extra_state_rank`` (None: this rank;
      the engine names the first rank of its tensor-parallel group, whose ranks share one data
      stream); where that rank did not exist at save time (loading with more ranks), rank 0's;
      ``extra_state_rank`` says whose it is;
    - ``saved_world_size``, ``saved_ep_size``: the layout at save time;
    - ``rng_restored``: what of this rank's RNG was restored (``[]`` when this rank did not
      exist at save time; ``"cuda"`` only with CUDA and as many devices as at save time).
    """
    started = time.perf_counter()
    model = unwrap(model)
    layout = rank_layout(parallel, model)
    path = _agreed_path(Path(directory), step, layout)

    manifest = _verified_manifest(path, layout)
    if layout.is_coordinator:
        log.info(
            "checkpoint: loading step %s from %s (saved at world %s, ep_size %s; now world %d, ep_size %d)",
            manifest["step"], path, manifest["world_size"], manifest["ep_size"],
            layout.world_size, layout.ep_size,
        )  # fmt: skip
    files = _file_bytes(manifest)

    experts = expert_params(model)
    own = layout.rank < manifest["world_size"]  # this rank existed at save time
    wanted = layout.rank if extra_state_rank is None else extra_state_rank
    extra_rank = wanted if wanted < manifest["world_size"] else 0
    one_stage = getattr(parallel, "pp_size", 1) > 1  # the model holds one pipeline stage's part
    request, plans = _request_entries(
        path, files, manifest, layout, model, optimizer, scheduler, experts, extra_rank, own, one_stage
    )

    error = None
    try:
        _dcp_load(request, path, files, layout)
    except CheckpointError as caught:
        error = caught
    agree(error, layout)

    optimizer_state, values = _assembled_values(
        request, plans, optimizer, scheduler, path, layout, extra_rank, own, one_stage
    )
    rng_restored = _set_loaded_state(
        request, model, experts, optimizer, optimizer_state, scheduler, values, own
    )
    barrier(layout)
    if layout.is_coordinator:
        log.info(
            "checkpoint: loaded step %s: %s verified and read in %.2f s",
            manifest["step"], format_bytes(manifest["total_bytes"]), time.perf_counter() - started,
        )  # fmt: skip
    return {
        "step": manifest["step"],
        "path": path,
        "extra_state": values["extra_state"],
        "extra_state_rank": extra_rank,
        "saved_world_size": manifest["world_size"],
        "saved_ep_size": manifest["ep_size"],
        "rng_restored": rng_restored,
    }


def _agreed_path(directory: Path, step: int | None, layout: RankLayout) -> Path:
    """The checkpoint directory of ``step``, resolved by the coordinator and broadcast; a missing
    checkpoint or a bad step raises on every rank."""
    error, path = None, None
    if layout.is_coordinator:
        try:
            path = _resolve(directory, step)
        except (FileNotFoundError, ValueError) as caught:
            error = caught
    agree(error, layout)
    return Path(broadcast(str(path) if path is not None else None, layout))


def _request_entries(
    path, files, manifest, layout, model, optimizer, scheduler, experts, extra_rank, own, one_stage
):
    """Checks the checkpoint's DCP metadata against what this rank needs and requests it: the model,
    the optimizer, the scheduler, the extra state of ``extra_rank`` and this rank's RNG (``own``).
    Returns ``(request, optimizer plans)``; a mismatch raises on every rank."""
    request, plans, error = None, None, None
    try:
        request = Request.of(read_metadata(path, files), path)
        request_model(request, model, experts, manifest, layout.ep_size, stage=one_stage)
        if optimizer is not None:
            if not manifest["optimizer"]:
                raise ValueError(f"optimizer: checkpoint {path} was saved without an optimizer")
            plans = request_optimizer(request, optimizer, parameter_names(model), experts)
        if scheduler is not None:
            if not manifest["scheduler"]:
                raise ValueError(f"scheduler: checkpoint {path} was saved without a scheduler")
            request.as_saved("scheduler", "scheduler")
        request.as_saved(f"extra_state/rank_{extra_rank}", "extra_state")
        if own:
            request.as_saved(f"rng/rank_{layout.rank}", "RNG state")
    except (ValueError, CheckpointError) as caught:
        error = caught
    agree(error, layout)
    return request, plans


def _assembled_values(request, plans, optimizer, scheduler, path, layout, extra_rank, own, one_stage):
    """The read entries other than the model's: ``(optimizer state dict or None, {"scheduler",
    "extra_state", "rng", "masters": values})``; ``masters``: the ``(param, master)`` pairs of
    :func:`take_offload_masters` (an offload checkpoint loaded into another optimizer). A bad
    entry raises on every rank."""
    error, optimizer_state, values = None, None, {"masters": []}
    try:
        if optimizer is not None:
            optimizer_state = optimizer_state_dict(request, plans, optimizer, path, stage=one_stage)
            values["masters"] = take_offload_masters(optimizer_state, plans, optimizer, path)
        if scheduler is not None:
            values["scheduler"] = request.value("scheduler")
        values["extra_state"] = request.value(f"extra_state/rank_{extra_rank}")
        if own:
            values["rng"] = request.value(f"rng/rank_{layout.rank}")
    except ValueError as caught:
        error = caught
    agree(error, layout)
    return optimizer_state, values


def _set_loaded_state(request, model, experts, optimizer, optimizer_state, scheduler, values, own) -> list:
    """Loads the read state into the model (then the pending offload masters, cast, into their params),
    the optimizer and the scheduler and restores this rank's RNG (``own``: it existed at save
    time); returns what of the RNG was restored."""
    model_state = {}
    for name in model.state_dict():
        model_state[name] = request.assembled[name] if name in experts else request.value("model/" + name)
    model.load_state_dict(model_state, strict=True)
    with torch.no_grad():
        for param, master in values["masters"]:
            param.copy_(master)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)
    if scheduler is not None:
        scheduler.load_state_dict(values["scheduler"])
    return restore_rng(values["rng"]) if own else []
