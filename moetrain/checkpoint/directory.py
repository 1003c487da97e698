"""The checkpoint directory of a run: names, what counts as complete, publishing and pruning.

``directory`` holds the checkpoints of one run::

    directory/
      step_00000100/            complete: DCP files + manifest.json
      step_00000200.tmp/        a save in progress, or debris of a crashed one: never loaded
      step_00000050.deleting/   a checkpoint being pruned (renamed first): never loaded
      step_00000200.tmp.deleting/
                                debris being removed (renamed first): never loaded
      step_00000300.rejected-20261126T101500Z/
                                newer than the step a run rolled back to: set aside, kept, never
                                loaded, pruned or counted

A checkpoint is complete iff its directory is named ``step_XXXXXXXX`` (no suffix) and holds
``manifest.json``. Publishing renames a finished ``.tmp`` directory (the commit point); pruning
renames a checkpoint to ``.deleting`` before removing its files, so a kill at any moment leaves
either a complete checkpoint or debris, and :func:`remove_debris` finishes the job at the next start.
A run that resumes from an older step than the newest (``resume_from: latest-valid`` past a damaged
one, or a step chosen by hand) sets the newer ones aside (:func:`set_aside_newer`): the run then
saves those steps again itself, and neither "latest" nor ``keep_last`` sees the old ones.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
DELETING_SUFFIX = ".deleting"
REJECTED_SUFFIX = ".rejected-"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_DEBRIS_DIR = re.compile(r"^step_(\d{8,})(\.tmp|\.deleting|\.tmp\.deleting)$")


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """``directory / step_XXXXXXXX`` (the step zero-padded to 8 digits)."""
    return Path(directory) / f"step_{step:08d}"


def tmp_path(final_dir: Path) -> Path:
    return final_dir.with_name(final_dir.name + TMP_SUFFIX)


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` as ``(step, path)``, oldest first."""
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """The commit point: renames the finished ``.tmp`` directory to its final name."""
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


def _remove(path: Path) -> None:
    """Renames ``path`` to ``<name>.deleting`` (one atomic step that makes it incomplete), then
    removes it."""
    doomed = path if path.name.endswith(DELETING_SUFFIX) else path.with_name(path.name + DELETING_SUFFIX)
    if doomed != path:
        if doomed.exists():
            shutil.rmtree(doomed)
        os.replace(path, doomed)
    shutil.rmtree(doomed)


def prune(directory: Path, keep_last: int | None, just_saved: Path) -> list[Path]:
    """After a save is complete: deletes the complete checkpoints other than the newest
    ``keep_last`` by step (never the one just saved) and the debris of crashed saves and prunes
    (one run writes one checkpoint at a time); returns the paths deleted."""
    complete = list_checkpoints(directory)
    doomed = [path for _, path in complete[:-keep_last]] if keep_last is not None else []
    doomed = [path for path in doomed if path != just_saved]
    for path in doomed:
        _remove(path)
    return doomed + remove_debris(directory)


def debris(directory: str | os.PathLike) -> list[Path]:
    """What crashed saves and interrupted prunes left: ``.tmp``, ``.deleting`` and ``.tmp.deleting``
    directories, and step directories without a manifest."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if _DEBRIS_DIR.match(entry.name) or (_STEP_DIR.match(entry.name) and not (entry / MANIFEST).exists()):
            found.append(entry)
    return sorted(found)


def remove_debris(directory: str | os.PathLike) -> list[Path]:
    """Removes :func:`debris`; call it only when no save of this run is in progress."""
    found = debris(directory)
    for path in found:
        if path.exists():  # else removed with the one before it (step_X.tmp took step_X.tmp.deleting)
            _remove(path)
    return found


def set_aside_newer(directory: str | os.PathLike, step: int) -> list[Path]:
    """Renames every step directory of ``directory`` newer than ``step`` (complete or not) to
    ``step_XXXXXXXX.rejected-<UTC time>`` (never deleted: an operator may still want one); returns
    the new paths, oldest step first. Call it on one process only (rank 0), with no save in
    progress; the rename is the whole change, so a kill leaves each directory either in place or
    set aside."""
    root = Path(directory)
    if not root.is_dir():
        return []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    newer = sorted(
        (int(match.group(1)), entry)
        for entry in root.iterdir()
        if (match := _STEP_DIR.match(entry.name)) and entry.is_dir() and int(match.group(1)) > step
    )
    moved = []
    for _, path in newer:
        target = path.with_name(f"{path.name}{REJECTED_SUFFIX}{stamp}")
        count = 1
        while target.exists():  # set aside twice within a second
            count += 1
            target = path.with_name(f"{path.name}{REJECTED_SUFFIX}{stamp}-{count}")
        os.replace(path, target)
        moved.append(target)
    if moved:
        fsync_dir(root)
    return moved
