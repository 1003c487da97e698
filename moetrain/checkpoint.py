"""Training checkpoints through ``torch.distributed.checkpoint`` (DCP), experts stored by global index.

A checkpoint saved under one layout (world size, ``ep_size``) loads under any other whose expert
count matches: every expert parameter ``[E_local, ...]`` is split into one entry per GLOBAL expert,
and a rank loads exactly the experts it holds now. Works with or without an initialised process
group (one process: ``torch.distributed`` not initialised).

Directory layout (``directory`` holds the checkpoints of one run)::

    directory/
      step_00000100/            complete: DCP files + manifest.json (written last, by rank 0)
        .metadata               DCP metadata (pickled), written by rank 0
        __<r>_0.distcp          DCP data, one file per rank that had something to write
        manifest.json
      step_00000200.tmp/        a save in progress, or debris of a crashed one: never loaded

Save protocol: every rank writes into ``step_XXXXXXXX.tmp/`` (DCP, files fsynced); the ranks then
checksum the files (each a share of them); rank 0 writes ``manifest.json`` (temp file, fsync,
rename) and renames the directory to ``step_XXXXXXXX/`` (then fsyncs the parent). A checkpoint
is complete iff its directory has no ``.tmp`` suffix and holds ``manifest.json``; a crash at any
point before the rename leaves only a ``.tmp`` directory, which :func:`latest_checkpoint` ignores.
After the rename rank 0 deletes the complete checkpoints other than the newest ``keep_last`` by
step, never the one just saved (each manifest first, so a half-deleted one is never complete),
and every ``.tmp`` directory (debris: one run writes one checkpoint at a time).

DCP entries (a flat state dict; ``<name>`` is a name from ``model.named_parameters()`` /
``model.state_dict()``, ``<g>`` a global expert index, ``<r>`` a rank at save time):

- ``model/<name>``: a dense parameter or buffer; replicated (every rank offers it, DCP keeps one
  copy: dense values must be equal on every rank, as data parallelism keeps them);
- ``model/<name>.expert.<g>``: expert ``g`` of a ``GroupedExperts`` parameter (``w[g - first]``);
- ``optim/<entry>/<key>``: optimizer state ``<key>`` (``step``, ``exp_avg``, ``exp_avg_sq``, and
  ``master`` for ``OffloadOptimizer``) of ``<entry>`` = ``<name>`` or ``<name>.expert.<g>``.
  A state tensor of the parameter's shape is split per expert; anything else (``step``) is
  stored per expert as is and must agree between the experts stacked into one parameter on load;
- ``optim/param_groups``: the param groups' options, ``params`` given as parameter names;
- ``scheduler``: ``scheduler.state_dict()``;
- ``extra_state/rank_<r>`` and ``rng/rank_<r>``: per-rank objects: the caller's ``extra_state``
  and the RNG states (``torch`` CPU, CUDA when CUDA is initialised, Python ``random``; not
  numpy's). Objects are pickled by DCP (``torch.save``): load only checkpoints you trust.

Under another world size, rank r restores the RNG saved by rank r where that rank existed (and
nothing where it did not), and gets rank r's ``extra_state``, or rank 0's where rank r did not
exist; :func:`load_checkpoint` reports both (``rng_restored``, ``extra_state_rank``).

``manifest.json`` (UTF-8 JSON): ``format`` ("moetrain.checkpoint"), ``version`` (1), ``step``,
``world_size``, ``ep_size``, ``experts`` (``{parameter name: global expert count}``),
``optimizer`` / ``scheduler`` (whether saved), ``total_bytes``, ``files``
(``{file name: {"bytes": int, "sha256": hex}}``), ``torch_version``, ``created`` (UTC ISO 8601)
and ``manifest_sha256``: the sha256 of the manifest's canonical JSON (sorted keys, no spaces)
without that field.

Loading first verifies every file against the manifest (size, then sha256; the ranks share the
work) and raises :class:`CheckpointError` naming the file before anything is read; then it checks
every entry the current model and optimizer need (missing expert -> ``ValueError`` naming the
key; shape mismatch -> ``ValueError`` naming the parameter); only then does it read, and it changes
the model, optimizer, scheduler and RNG only after everything was read. Errors are agreed between
the ranks, so every rank raises and none hangs in a collective. Entries of things not passed
(no ``optimizer`` or ``scheduler`` argument) are not read.

Cost: load allocates one extra copy of this rank's model and optimizer state while reading.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain.layers.experts import GroupedExperts
from moetrain.progress import ProgressBar

FORMAT = "moetrain.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_STEP_TMP_DIR = re.compile(r"^step_(\d{8,})\.tmp$")
_HASH_CHUNK = 8 * 2**20
_PROGRESS_MIN_BYTES = 4 * 2**30  # hashing less than this on rank 0 takes a few seconds: no bar


class CheckpointError(RuntimeError):
    """A checkpoint on disk is incomplete, truncated or corrupt (the message names the file)."""


# ------------------------------------------------------------------------------------------------
# Directory


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """``directory / step_XXXXXXXX`` (the step zero-padded to 8 digits)."""
    return Path(directory) / f"step_{step:08d}"


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` as ``(step, path)``, oldest first (``.tmp``
    directories and directories without a manifest are not listed)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None when there is none."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


# ------------------------------------------------------------------------------------------------
# Ranks and agreement between them


@dataclass(frozen=True)
class _Layout:
    rank: int
    world_size: int
    ep_size: int
    distributed: bool  # torch.distributed initialised: collectives are used

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def _layout(parallel, model: nn.Module) -> _Layout:
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if parallel is None:
        sharded = [m for m in model.modules() if isinstance(m, GroupedExperts) and m.first_expert != 0]
        if sharded:
            raise ValueError(
                "parallel must be given when the model's experts are sharded (a GroupedExperts module "
                f"has first_expert = {sharded[0].first_expert}); pass the model's ParallelContext"
            )
        return _Layout(rank, world, 1, distributed)
    if parallel.world_size != world or parallel.rank != rank:
        raise ValueError(
            f"parallel describes rank {parallel.rank} of world {parallel.world_size}, but torch.distributed "
            f"says rank {rank} of world {world}; build the ParallelContext after init_process_group"
        )
    return _Layout(rank, world, parallel.ep_size, distributed)


_ERROR_TYPES = {
    "ValueError": ValueError,
    "CheckpointError": CheckpointError,
    "FileNotFoundError": FileNotFoundError,
}


def _agree(error: BaseException | None, layout: _Layout) -> None:
    """Raises on every rank when any rank had an error: its own, else the first failing rank's
    (same type, message prefixed with that rank). A collective, so that no rank goes on into the
    next collective while another has stopped."""
    if layout.distributed:
        mine = None if error is None else (type(error).__name__, str(error))
        gathered: list[Any] = [None] * layout.world_size
        dist.all_gather_object(gathered, mine)
        failed = [(rank, item) for rank, item in enumerate(gathered) if item is not None]
        if error is None and failed:
            rank, (kind, message) = failed[0]
            raise _ERROR_TYPES.get(kind, RuntimeError)(f"rank {rank}: {message}")
    if error is not None:
        raise error


def _broadcast(value: Any, layout: _Layout) -> Any:
    if not layout.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier(layout: _Layout) -> None:
    if layout.distributed:
        dist.barrier()


def _format_bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------------
# Model entries


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (names without ``module.``)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _expert_params(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{parameter name: (first global expert, local expert count)}`` of every GroupedExperts
    parameter (the stacked ``[E_local, ...]`` weights)."""
    found = {}
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for pname, param in module.named_parameters(recurse=False):
                name = f"{prefix}.{pname}" if prefix else pname
                if param.shape[0] != module.num_experts:
                    raise ValueError(
                        f"expert parameter {name!r} must have num_experts = {module.num_experts} rows, "
                        f"got shape {tuple(param.shape)}"
                    )
                found[name] = (module.first_expert, module.num_experts)
    return found


def _expert_key(name: str, index: int) -> str:
    return f"{name}.expert.{index}"


def _model_entries(model: nn.Module, experts: dict[str, tuple[int, int]]) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for name, value in model.state_dict().items():
        if name in experts:
            first, count = experts[name]
            for local in range(count):
                entries["model/" + _expert_key(name, first + local)] = value[local]
        else:
            entries["model/" + name] = value
    return entries


def _parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------
# Optimizer entries


def _optimizer_entries(
    optimizer: torch.optim.Optimizer, names: dict[int, str], experts: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    state_dict = optimizer.state_dict()
    by_index: dict[Any, tuple[str, torch.Tensor]] = {}
    groups = []
    for g, (saved, group) in enumerate(zip(state_dict["param_groups"], optimizer.param_groups, strict=True)):
        group_names = []
        for i, (index, param) in enumerate(zip(saved["params"], group["params"], strict=True)):
            if id(param) not in names:
                raise ValueError(f"optimizer param group {g}: param {i} is not a parameter of the model")
            by_index[index] = (names[id(param)], param)
            group_names.append(names[id(param)])
        options = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        groups.append({**options, "params": group_names})
    entries: dict[str, Any] = {"optim/param_groups": groups}
    for index, state in state_dict["state"].items():
        name, param = by_index[index]
        if name in experts:
            first, count = experts[name]
            for local in range(count):
                for key, value in state.items():
                    split = isinstance(value, torch.Tensor) and value.shape == param.shape
                    entries[f"optim/{_expert_key(name, first + local)}/{key}"] = (
                        value[local] if split else value
                    )
        else:
            for key, value in state.items():
                entries[f"optim/{name}/{key}"] = value
    return entries


# ------------------------------------------------------------------------------------------------
# RNG


def _rng_state() -> dict[str, Any]:
    """torch CPU, CUDA (only when CUDA is initialised in this process) and Python ``random``."""
    return {
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python": random.getstate(),
    }


def _restore_rng(state: dict[str, Any]) -> list[str]:
    """Restores what this process can; returns the names restored."""
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    restored = ["torch_cpu", "python"]
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
        restored.append("cuda")
    return restored


# ------------------------------------------------------------------------------------------------
# Files and checksums


def _sha256(path: Path, progress: _HashProgress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.advance(len(chunk))
    return digest.hexdigest()


class _HashProgress:
    """A progress bar (MiB) over the bytes rank 0 hashes, shown only when they reach
    ``_PROGRESS_MIN_BYTES`` (a large checkpoint: each rank hashes ~1 / world of it)."""

    def __init__(self, files: list[Path], what: str, layout: _Layout):
        total = sum(f.stat().st_size for f in files if f.is_file())
        self.bar = None
        self.done = 0
        if layout.is_coordinator and total >= _PROGRESS_MIN_BYTES:
            mib = max(1, total >> 20)
            self.bar = ProgressBar(
                mib, f"checkpoint: {what} (rank 0's share, MiB)", log_every=max(1, mib // 10)
            )

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(self.done >> 20)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Writes ``manifest.json`` atomically (temp file, fsync, rename, fsync of the directory)."""
    manifest = {**manifest, "manifest_sha256": _manifest_digest(manifest)}
    tmp = directory / (MANIFEST + TMP_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as stream:
        json.dump(manifest, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync_dir(directory)


def _publish(tmp_dir: Path, final_dir: Path) -> None:
    """The commit point: renames the finished ``.tmp`` directory to its final name."""
    os.replace(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; {path} is not a complete checkpoint") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: corrupt manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} manifest")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointError(f"{file}: corrupt manifest (its checksum does not match its content)")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{file}: format version {manifest.get('version')!r}, this moetrain reads {VERSION}"
        )
    return manifest


def _checksum_share(directory: Path, names: list[str], layout: _Layout) -> dict[str, dict[str, Any]]:
    """Size and sha256 of ``names`` (sorted), rank r hashing names[r::world]; every rank gets all."""
    mine = {}
    share = names[layout.rank :: layout.world_size]
    progress = _HashProgress([directory / name for name in share], "hashing", layout)
    for name in share:
        file = directory / name
        mine[name] = {"bytes": file.stat().st_size, "sha256": _sha256(file, progress)}
    progress.close()
    if not layout.distributed:
        return mine
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, mine)
    return {name: info for part in gathered for name, info in part.items()}


def _verify_share(path: Path, files: dict[str, dict[str, Any]], layout: _Layout) -> CheckpointError | None:
    """Checks this rank's share of the files (size first, then sha256); the first problem found."""
    share = sorted(files)[layout.rank :: layout.world_size]
    progress = _HashProgress([path / name for name in share], "verifying", layout)
    try:
        return _first_bad_file(path, share, files, progress)
    finally:
        progress.close()


def _first_bad_file(
    path: Path, share: list[str], files: dict, progress: _HashProgress
) -> CheckpointError | None:
    for name in share:
        expected = files[name]
        file = path / name
        if not file.is_file():
            return CheckpointError(f"{file}: missing (listed in the manifest)")
        size = file.stat().st_size
        if size != expected["bytes"]:
            return CheckpointError(
                f"{file}: truncated or altered: {size} bytes, the manifest says {expected['bytes']}"
            )
        if _sha256(file, progress) != expected["sha256"]:
            return CheckpointError(f"{file}: corrupt: its sha256 does not match the manifest")
    return None


# ------------------------------------------------------------------------------------------------
# DCP calls
#
# Flat state dicts, keys used as given. Both flattening passes are off: with
# ``flatten_sharded_tensors`` on (DCP's default), the load planner works on a copy of the dict and
# objects read from the checkpoint never reach the caller's dict (torch 2.13). DCP warns on every
# call without a process group; here that case is chosen explicitly (``no_dist``): the warning is
# dropped.
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _dcp_save(entries: dict[str, Any], directory: Path, layout: _Layout):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING, category=UserWarning)
        return dcp.save(
            entries,
            storage_writer=dcp.FileSystemWriter(directory, sync_files=True, single_file_per_rank=True),
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=not layout.distributed,
        )


def _dcp_load(entries: dict[str, Any], directory: Path, layout: _Layout) -> None:
    """Reads ``entries`` in place: tensors are copied into, objects replace the None values."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING, category=UserWarning)
        dcp.load(
            entries,
            storage_reader=dcp.FileSystemReader(directory),
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=not layout.distributed,
        )


# ------------------------------------------------------------------------------------------------
# Save


def _require_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")


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
    """Saves ``directory/step_XXXXXXXX`` atomically; a collective: every rank calls it.

    ``model``: the model (a ``DistributedDataParallel`` wrapper is unwrapped); ``optimizer``: any
    torch optimizer over the model's parameters (``OffloadOptimizer``, ``GroupwiseApply``, AdamW
    ...), its state stored by parameter name; ``scheduler``: anything with ``state_dict()``;
    ``extra_state``: any picklable object, saved per rank (e.g. the data position); ``parallel``:
    the ``ParallelContext`` the model was built with (required when its experts are sharded);
    ``keep_last``: complete checkpoints kept in ``directory`` (an integer >= 1, or None: keep all).

    Raises ``ValueError`` when ``step``'s checkpoint already exists. Returns the checkpoint's path.
    """
    started = time.perf_counter()
    rng = _rng_state()  # before anything here could draw a random number
    _require_step(step)
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last must be an integer >= 1 or None (keep all), got {keep_last!r}")
    model = _unwrap(model)
    layout = _layout(parallel, model)
    final_dir = checkpoint_path(directory, step)
    tmp_dir = final_dir.with_name(final_dir.name + TMP_SUFFIX)

    # Rank 0 prepares the directory; every rank raises if that failed.
    error = None
    if layout.is_coordinator:
        print(
            f"checkpoint: saving step {step} to {final_dir} "
            f"(world {layout.world_size}, ep_size {layout.ep_size})",
            flush=True,
        )
        try:
            if final_dir.exists():
                raise ValueError(f"step {step}: checkpoint {final_dir} already exists")
            final_dir.parent.mkdir(parents=True, exist_ok=True)
            if tmp_dir.exists():  # debris of a crashed save of this step
                shutil.rmtree(tmp_dir)
            tmp_dir.mkdir()
        except (OSError, ValueError) as caught:
            error = caught
    _agree(error, layout)

    experts = _expert_params(model)
    entries = _model_entries(model, experts)
    if optimizer is not None:
        entries.update(_optimizer_entries(optimizer, _parameter_names(model), experts))
    if scheduler is not None:
        entries["scheduler"] = scheduler.state_dict()
    entries[f"extra_state/rank_{layout.rank}"] = extra_state
    entries[f"rng/rank_{layout.rank}"] = rng

    metadata = _dcp_save(entries, tmp_dir, layout)
    expert_counts = {name: count * layout.ep_size for name, (_, count) in experts.items()}
    _agree(_check_saved_experts(metadata, expert_counts), layout)

    names = _broadcast(sorted(p.name for p in tmp_dir.iterdir()) if layout.is_coordinator else None, layout)
    files = _checksum_share(tmp_dir, names, layout)

    error = None
    total = sum(info["bytes"] for info in files.values())
    if layout.is_coordinator:
        try:
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "step": step,
                "world_size": layout.world_size,
                "ep_size": layout.ep_size,
                "experts": expert_counts,
                "optimizer": optimizer is not None,
                "scheduler": scheduler is not None,
                "total_bytes": total,
                "files": files,
                "torch_version": torch.__version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
            _write_manifest(tmp_dir, manifest)
            _publish(tmp_dir, final_dir)
            _prune(Path(directory), keep_last, final_dir)
        except Exception as caught:  # noqa: BLE001 - re-raised on every rank by _agree
            error = caught
    _agree(error, layout)
    if layout.is_coordinator:
        print(
            f"checkpoint: saved step {step}: {_format_bytes(total)} in {time.perf_counter() - started:.2f} s "
            f"({final_dir})",
            flush=True,
        )
    return final_dir


def _check_saved_experts(metadata, expert_counts: dict[str, int]) -> ValueError | None:
    """Every global expert of every expert parameter was written by some rank (checked on the
    global DCP metadata, which every rank receives)."""
    saved = metadata.state_dict_metadata
    for name, count in expert_counts.items():
        missing = [g for g in range(count) if "model/" + _expert_key(name, g) not in saved]
        if missing:
            return ValueError(
                f"save: experts {missing} of parameter {name!r} were written by no rank (expected global "
                f"experts 0..{count - 1}); the ParallelContext does not match the model's expert layout"
            )
    return None


def _prune(directory: Path, keep_last: int | None, just_saved: Path) -> None:
    """Rank 0, after a save is complete: deletes the complete checkpoints other than the newest
    ``keep_last`` by step (never the one just saved; each manifest first) and every ``.tmp``
    directory left by crashed saves."""
    complete = list_checkpoints(directory)
    doomed = [path for _, path in complete[:-keep_last]] if keep_last is not None else []
    doomed = [path for path in doomed if path != just_saved]
    for path in doomed:
        (path / MANIFEST).unlink()
        shutil.rmtree(path)
    for entry in directory.iterdir():
        if _STEP_TMP_DIR.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry)


# ------------------------------------------------------------------------------------------------
# Load


class _Request:
    """The DCP state dict one rank reads (``entries``: tensor targets, None for objects) and the
    stacked expert buffers that per-expert targets are views of (``assembled``)."""

    def __init__(self, saved: dict[str, Any], path: Path):
        self.saved = saved  # DCP key -> TensorStorageMetadata | BytesStorageMetadata
        self.path = path
        self.entries: dict[str, Any] = {}
        self.assembled: dict[str, torch.Tensor] = {}

    def tensor(self, key: str, shape, what: str, out: torch.Tensor | None = None) -> None:
        """Requests tensor entry ``key`` of ``shape`` into ``out`` (default: a new CPU tensor of the
        saved dtype); ValueError naming ``what`` when it is missing or has another shape."""
        md = self.saved.get(key)
        if md is None:
            raise ValueError(f"{what}: checkpoint {self.path} has no entry {key!r}")
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{what}: entry {key!r} of checkpoint {self.path} is not a tensor")
        if tuple(md.size) != tuple(shape):
            raise ValueError(
                f"{what}: shape {tuple(shape)} here, {tuple(md.size)} in checkpoint {self.path} "
                f"(entry {key!r})"
            )
        self.entries[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if out is None else out

    def as_saved(self, key: str, what: str) -> None:
        """Requests ``key`` whatever it holds: a tensor (new, of the saved shape) or an object."""
        md = self.saved.get(key)
        if md is None:
            raise ValueError(f"{what}: checkpoint {self.path} has no entry {key!r}")
        if isinstance(md, TensorStorageMetadata):
            self.tensor(key, md.size, what)
        else:
            self.entries[key] = None


def _request_model(request: _Request, model: nn.Module, experts, manifest, layout: _Layout) -> None:
    """Checks and requests every entry of ``model.state_dict()``: dense ones into new tensors of
    the model's dtype, experts into views of one stacked buffer per parameter."""
    for name, (first, count) in experts.items():
        saved_count = manifest["experts"].get(name, 0)
        for local in range(count):
            key = "model/" + _expert_key(name, first + local)
            if key not in request.saved:
                raise ValueError(
                    f"checkpoint {request.path} has no entry {key!r} (expert {first + local} of parameter "
                    f"{name!r}; the checkpoint holds {saved_count} experts of it, this model "
                    f"{count * layout.ep_size})"
                )
        if saved_count != count * layout.ep_size:
            raise ValueError(
                f"expert parameter {name!r}: the checkpoint {request.path} holds {saved_count} experts, this "
                f"model has {count * layout.ep_size} ({count} per rank x ep_size {layout.ep_size})"
            )
    expected = set()
    for name, value in model.state_dict().items():
        what = f"parameter {name!r}"
        if name in experts:
            first, count = experts[name]
            buffer = torch.empty(value.shape, dtype=value.dtype, device=value.device)
            for local in range(count):
                key = "model/" + _expert_key(name, first + local)
                request.tensor(key, value.shape[1:], f"{what} (expert {first + local})", out=buffer[local])
            request.assembled[name] = buffer
            continue
        key = "model/" + name
        expected.add(key)
        if isinstance(value, torch.Tensor):
            request.tensor(key, value.shape, what, out=torch.empty_like(value))
        else:
            request.as_saved(key, what)
    lacking = sorted(set(manifest["experts"]) - set(experts))
    if lacking:
        raise ValueError(f"checkpoint {request.path} has expert parameters this model lacks: {lacking[:5]}")
    expert_prefixes = tuple("model/" + _expert_key(name, "") for name in experts)
    unexpected = sorted(
        k
        for k in request.saved
        if k.startswith("model/") and k not in expected and not k.startswith(expert_prefixes)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {request.path} has model entries this model lacks: {unexpected[:5]}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        )


@dataclass
class _StatePlan:
    """How one parameter's optimizer state is put together after the read."""

    name: str
    entries: list[str]  # "optim/<entry>": one (dense parameter) or one per local expert
    keys: list[str]  # state keys saved for it (empty: no state)
    stacked: dict[str, torch.Tensor]  # state key -> stacked buffer (split expert state)


def _request_optimizer(request: _Request, optimizer, names: dict[int, str], experts) -> list[_StatePlan]:
    """Requests the state of every optimizer parameter, in param-group order."""
    if "optim/param_groups" not in request.saved:
        raise ValueError(f"optimizer: checkpoint {request.path} has no entry 'optim/param_groups'")
    request.entries["optim/param_groups"] = None
    plans = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if id(param) not in names:
                raise ValueError(f"optimizer param group {g}: param {i} is not a parameter of the model")
            name = names[id(param)]
            if name in experts:
                first, count = experts[name]
                entries = [f"optim/{_expert_key(name, first + local)}" for local in range(count)]
            else:
                entries = [f"optim/{name}"]
            key_sets = [
                sorted(k[len(e) + 1 :] for k in request.saved if k.startswith(e + "/")) for e in entries
            ]
            for entry, keys in zip(entries, key_sets, strict=True):
                if keys != key_sets[0]:
                    raise ValueError(
                        f"optimizer state of parameter {name!r}: {entry!r} has entries {keys}, "
                        f"{entries[0]!r} has {key_sets[0]} in checkpoint {request.path}"
                    )
            plan = _StatePlan(name, entries, key_sets[0], {})
            for key in plan.keys:
                what = f"optimizer state {key!r} of parameter {name!r}"
                md = request.saved[f"{entries[0]}/{key}"]
                per_expert = (
                    name in experts
                    and isinstance(md, TensorStorageMetadata)
                    and tuple(md.size) == tuple(param.shape[1:])
                )
                if per_expert:
                    buffer = torch.empty(tuple(param.shape), dtype=md.properties.dtype)
                    for local, entry in enumerate(entries):
                        request.tensor(f"{entry}/{key}", param.shape[1:], what, out=buffer[local])
                    plan.stacked[key] = buffer
                else:
                    for entry in entries:
                        request.as_saved(f"{entry}/{key}", what)
            plans.append(plan)
    return plans


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _optimizer_state_dict(
    loaded: dict[str, Any], plans: list[_StatePlan], optimizer, path: Path
) -> dict[str, Any]:
    """A torch-style optimizer state dict (params numbered in this optimizer's order)."""
    state = {}
    for index, plan in enumerate(plans):
        if not plan.keys:
            continue
        values = {}
        for key in plan.keys:
            if key in plan.stacked:
                values[key] = plan.stacked[key]
                continue
            candidates = [loaded[f"{entry}/{key}"] for entry in plan.entries]
            if any(not _same(c, candidates[0]) for c in candidates):
                raise ValueError(
                    f"optimizer state {key!r} of parameter {plan.name!r}: the experts stacked into it on "
                    f"this rank have different values in checkpoint {path}"
                )
            values[key] = candidates[0]
        state[index] = values
    saved_groups = loaded["optim/param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer: {len(optimizer.param_groups)} param groups here, {len(saved_groups)} in "
            f"checkpoint {path}"
        )
    groups, index = [], 0
    names_in_order = [plan.name for plan in plans]
    for g, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        here = names_in_order[index : index + len(group["params"])]
        if sorted(here) != sorted(saved["params"]):
            missing = sorted(set(here) - set(saved["params"]))
            extra = sorted(set(saved["params"]) - set(here))
            raise ValueError(
                f"optimizer param group {g}: parameters differ from checkpoint {path}: "
                f"not in the checkpoint's group: {missing[:5]}, only in the checkpoint's group: {extra[:5]}"
            )
        options = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**options, "params": list(range(index, index + len(here)))})
        index += len(here)
    return {"state": state, "param_groups": groups}


def _resolve(directory: Path, step: int | None) -> Path:
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


def load_checkpoint(
    directory: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    parallel=None,
    step: int | None = None,
) -> dict[str, Any]:
    """Loads ``directory``'s checkpoint of ``step`` (None: the latest complete one); a collective.

    Verifies the files, then checks and reads the entries this rank needs, then sets the model
    (values cast to each parameter's dtype), the optimizer (state mapped by parameter name), the
    scheduler and this rank's RNG states. Returns a dict:

    - ``step``: the checkpoint's step; ``path``: its directory;
    - ``extra_state``: the ``extra_state`` saved by this rank; a rank that did not exist at save
      time (loading with more ranks) gets rank 0's; ``extra_state_rank`` says whose it is;
    - ``saved_world_size``, ``saved_ep_size``: the layout at save time;
    - ``rng_restored``: what of this rank's RNG was restored (``[]`` when this rank did not
      exist at save time; ``"cuda"`` only with CUDA and as many devices as at save time).
    """
    started = time.perf_counter()
    model = _unwrap(model)
    layout = _layout(parallel, model)
    error, path = None, None
    if layout.is_coordinator:
        try:
            path = _resolve(Path(directory), step)
        except (FileNotFoundError, ValueError) as caught:
            error = caught
    _agree(error, layout)
    path = Path(_broadcast(str(path) if path is not None else None, layout))

    manifest, error = None, None
    try:
        manifest = _read_manifest(path)
    except CheckpointError as caught:
        error = caught
    _agree(error, layout)
    if layout.is_coordinator:
        print(
            f"checkpoint: loading step {manifest['step']} from {path} (saved at world "
            f"{manifest['world_size']}, ep_size {manifest['ep_size']}; now world {layout.world_size}, "
            f"ep_size {layout.ep_size})",
            flush=True,
        )
    _agree(_verify_share(path, manifest["files"], layout), layout)

    experts = _expert_params(model)
    names = _parameter_names(model)
    request, plans, error = None, None, None
    own = layout.rank < manifest["world_size"]  # this rank existed at save time
    extra_rank = layout.rank if own else 0
    try:
        request = _Request(dcp.FileSystemReader(path).read_metadata().state_dict_metadata, path)
        _request_model(request, model, experts, manifest, layout)
        if optimizer is not None:
            if not manifest["optimizer"]:
                raise ValueError(f"optimizer: checkpoint {path} was saved without an optimizer")
            plans = _request_optimizer(request, optimizer, names, experts)
        if scheduler is not None:
            if not manifest["scheduler"]:
                raise ValueError(f"scheduler: checkpoint {path} was saved without a scheduler")
            request.as_saved("scheduler", "scheduler")
        request.as_saved(f"extra_state/rank_{extra_rank}", "extra_state")
        if own:
            request.as_saved(f"rng/rank_{layout.rank}", "RNG state")
    except ValueError as caught:
        error = caught
    _agree(error, layout)

    loaded = request.entries
    _dcp_load(loaded, path, layout)

    error, optimizer_state = None, None
    try:
        if optimizer is not None:
            optimizer_state = _optimizer_state_dict(loaded, plans, optimizer, path)
    except ValueError as caught:
        error = caught
    _agree(error, layout)

    model_state = {}
    for name in model.state_dict():
        model_state[name] = request.assembled[name] if name in experts else loaded["model/" + name]
    model.load_state_dict(model_state, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    rng_restored = _restore_rng(loaded[f"rng/rank_{layout.rank}"]) if own else []
    _barrier(layout)
    if layout.is_coordinator:
        print(
            f"checkpoint: loaded step {manifest['step']}: {_format_bytes(manifest['total_bytes'])} "
            f"verified and read in {time.perf_counter() - started:.2f} s",
            flush=True,
        )
    return {
        "step": manifest["step"],
        "path": path,
        "extra_state": loaded[f"extra_state/rank_{extra_rank}"],
        "extra_state_rank": extra_rank,
        "saved_world_size": manifest["world_size"],
        "saved_ep_size": manifest["ep_size"],
        "rng_restored": rng_restored,
    }
