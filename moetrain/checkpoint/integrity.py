"""The manifest of a checkpoint and the checks of its files against it.

``manifest.json`` (UTF-8 JSON): ``format`` ("moetrain.checkpoint"), ``version``, ``step``,
``world_size``, ``ep_size``, ``experts`` (``{parameter name: global expert count}``),
``optimizer`` / ``scheduler`` (whether saved), ``total_bytes``, ``files``
(``{file name: {"bytes": int, "sha256": hex}}``), ``torch_version``, ``created`` (UTC ISO 8601)
and ``manifest_sha256``: the sha256 of the manifest's canonical JSON (sorted keys, no spaces)
without that field. The checksums detect damage (truncation, bit flips, a torn write), not
tampering: anyone who can write the files can rewrite the manifest too (see docs/checkpoint.md).

The ranks share the hashing: rank r hashes the sorted file names ``[r::world]``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from moetrain.checkpoint.directory import MANIFEST, TMP_SUFFIX, fsync_dir
from moetrain.checkpoint.ranks import CheckpointError, RankLayout, all_gather
from moetrain.progress import ProgressBar
from moetrain.validation import is_int

FORMAT = "moetrain.checkpoint"
VERSION = 2  # 2: no pickled objects (objects are JSON, see moetrain.checkpoint.objects)
HASH_CHUNK_BYTES = 8 * 2**20
PROGRESS_MIN_BYTES = 4 * 2**30  # hashing less than this on rank 0 takes a few seconds: no bar


def sha256_file(path: Path, progress: HashProgress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
            if progress is not None:
                progress.advance(len(chunk))
    return digest.hexdigest()


class HashProgress:
    """A progress bar (MiB) over the bytes rank 0 hashes, shown only when they reach
    ``PROGRESS_MIN_BYTES`` (a large checkpoint: each rank hashes ~1 / world of it)."""

    def __init__(self, files: list[Path], what: str, layout: RankLayout):
        total = sum(f.stat().st_size for f in files if f.is_file())
        self.bar = None
        self.done = 0
        if layout.is_coordinator and total >= PROGRESS_MIN_BYTES:
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


def manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Writes ``manifest.json`` atomically (temp file, fsync, rename, fsync of the directory)."""
    manifest = {**manifest, "manifest_sha256": manifest_digest(manifest)}
    tmp = directory / (MANIFEST + TMP_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as stream:
        json.dump(manifest, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, directory / MANIFEST)
    fsync_dir(directory)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, checked (format, version, its own checksum)."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; {path} is not a complete checkpoint") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: corrupt manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} manifest")
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise CheckpointError(f"{file}: corrupt manifest (its checksum does not match its content)")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{file}: format version {manifest.get('version')!r}, this moetrain reads {VERSION}"
            + (
                " (version 1 stored pickled objects, which are not loaded)"
                if manifest.get("version") == 1
                else ""
            )
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(
            f"{file}: corrupt manifest: 'files' must be {{name: {{...}}}}, got {files!r:.80}"
        )
    name_max = _name_max(path)
    for name in files:
        if not _is_file_name(name, name_max):
            shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
            raise CheckpointError(
                f"{file}: corrupt manifest: file name {shown} must be a name in the checkpoint's "
                f"directory (no '/' or NUL, no leading '.' but '.metadata', 1 to {name_max} bytes)"
            )
    _check_schema(file, manifest)
    return manifest


def _name_max(path: Path) -> int:
    """The longest file name (bytes) the filesystem of ``path`` allows (255 when it cannot say)."""
    try:
        limit = os.pathconf(path, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255
    return limit if limit > 0 else 255


def _is_file_name(name: Any, name_max: int) -> bool:
    """Whether ``name`` is a name a save writes: one path component of 1 to ``name_max`` bytes."""
    if not isinstance(name, str) or "/" in name or "\0" in name:
        return False
    if name.startswith(".") and name != ".metadata":
        return False
    try:
        return 0 < len(os.fsencode(name)) <= name_max
    except UnicodeEncodeError:
        return False


def _is_int(value: Any, low: int) -> bool:
    return is_int(value) and value >= low


def _check_schema(file: Path, manifest: dict[str, Any]) -> None:
    """CheckpointError naming the first field of ``manifest`` (resealed, so its checksum matched)
    that is missing or of another type than a save writes."""

    def bad(field: str, allowed: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{file}: corrupt manifest: {field!r} must be {allowed}, got {value!r}")

    for field, low in (("step", 0), ("world_size", 1), ("ep_size", 1), ("total_bytes", 0)):
        if not _is_int(manifest.get(field), low):
            raise bad(field, f"an int >= {low}", manifest.get(field))
    for field in ("optimizer", "scheduler"):
        if not isinstance(manifest.get(field), bool):
            raise bad(field, "true or false", manifest.get(field))
    experts = manifest.get("experts")
    if not isinstance(experts, dict) or not all(_is_int(count, 1) for count in experts.values()):
        raise bad("experts", "{parameter name: expert count >= 1}", experts)
    for name, info in manifest["files"].items():
        if (
            not isinstance(info, dict)
            or not _is_int(info.get("bytes"), 0)
            or not isinstance(info.get("sha256"), str)
        ):
            raise bad(f"files[{name!r}]", '{"bytes": int >= 0, "sha256": str}', info)


def checksum_share(directory: Path, names: list[str], layout: RankLayout) -> dict[str, dict[str, Any]]:
    """Size and sha256 of ``names`` (sorted), rank r hashing names[r::world]; every rank gets all."""
    mine = {}
    share = names[layout.rank :: layout.world_size]
    progress = HashProgress([directory / name for name in share], "hashing", layout)
    for name in share:
        file = directory / name
        mine[name] = {"bytes": file.stat().st_size, "sha256": sha256_file(file, progress)}
    progress.close()
    return {name: info for part in all_gather(mine, layout) for name, info in part.items()}


def verify_share(path: Path, files: dict[str, dict[str, Any]], layout: RankLayout) -> CheckpointError | None:
    """Checks this rank's share of the files (size first, then sha256); the first problem found
    (a file that cannot be read is one: returned, so that every rank raises it)."""
    share = sorted(files)[layout.rank :: layout.world_size]
    progress = None
    try:
        progress = HashProgress([path / name for name in share], "verifying", layout)
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
            if sha256_file(file, progress) != expected["sha256"]:
                return CheckpointError(f"{file}: corrupt: its sha256 does not match the manifest")
        return None
    except OSError as error:
        return CheckpointError(f"{error.filename or path}: cannot be read ({error.strerror or error})")
    finally:
        if progress is not None:
            progress.close()
