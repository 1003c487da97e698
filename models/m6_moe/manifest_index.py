"""The on-disk index of a JSON-lines manifest: where each usable record's line starts.

Holding a corpus's records as Python objects cost ~1.2 KB per record on every rank (measured by
``benchmarks/m6_data.py``); the index costs a rank no resident memory. Built once per manifest
(one pass, a progress bar for large ones), it holds ``.npy`` arrays that processes read element
by element with ``pread`` (:class:`IndexArray`: one read per lookup, from the page cache that
every process of the node shares), not whole:

- ``offsets.npy`` ``uint64 [R]``: byte offset of each usable record's line (R usable records);
- ``lines.npy`` ``uint64 [R]``: its 1-based line number (read only to name a bad record);
- ``image_records.npy`` ``uint64 [R_img]``: the records that have an image;
- ``image_text_records.npy`` ``uint64 [R_it]``: those with an image and >= 2 characters of text;
- ``meta.json``: the counts, the manifest's key, and the bad lines found while building (their
  total, the first :data:`MAX_STORED_REASONS` with their line and reason).

Building parses every line as :class:`~m6_moe.data.ManifestDataset` requires (UTF-8, at most
:data:`MAX_LINE_BYTES` bytes, a JSON object, a non-empty ``text`` string that is valid Unicode,
``image`` a path string without NUL or lone surrogate, or null; blank lines are skipped); a bad line
is left out of the arrays and recorded, whatever the run's ``skip_bad_records`` (the dataset decides
whether it is fatal), so one cached index serves every run. A longer line is never held whole: it is
read in bounded chunks.

Cache: ``<manifest dir>/.<manifest name>.index/<key>/``, where ``key`` is the manifest's size,
modification time and a hash of its first and last 64 KiB (:func:`manifest_key`): a changed
manifest gets a new key, so its index is rebuilt. The directory is written under a temporary name
and renamed into place (processes building the same index at once each write their own; the first
rename wins). When the manifest's directory is not writable, the index goes to ``fallback_dir``
(default ``~/.cache/moetrain/manifest-index``), with a log line.

The indexes of older versions of a manifest are never removed automatically: a running job may
still be reading one (its arrays are opened lazily, reopened after the LRU closes them, and opened
anew by each loader worker), and a ``touch`` of the manifest is enough to give it a new key. A build
that leaves older ones logs how many and how large they are; remove them with
:func:`remove_other_indexes` (``python -m m6_moe.index_command --prune MANIFEST``) once no job
that started before the change is running.

Command line (:mod:`m6_moe.index_command`; build the indexes of a large corpus ahead of a run,
e.g. on one node)::

    python -m m6_moe.index_command [--prune] MANIFEST [MANIFEST ...]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat as stat_module
import tempfile
import time
from array import array
from pathlib import Path

import numpy as np

from moetrain.progress import ProgressBar

log = logging.getLogger("moetrain.m6_moe.manifest_index")

INDEX_FORMAT = 3  # 2: line length bound, lone surrogates in text are bad lines; 3: so are bad image paths
HEAD_TAIL_BYTES = 1 << 16
MAX_STORED_REASONS = 1000
# Longest manifest line (bytes, without its newline): a longer one is a bad line (a JSON array on
# one line, CR-only line ends), found without holding it; a caption record is a few hundred bytes.
MAX_LINE_BYTES = 1 << 20
LONG_LINE_REASON = f"line is longer than {MAX_LINE_BYTES} bytes (a manifest holds one JSON object per line)"
_SPILL_ENTRIES = 1 << 20  # array entries held in memory while building before they go to disk
PROGRESS_MIN_BYTES = 8 << 20  # smaller manifests index in well under a second: no progress bar
_ARRAYS = ("offsets", "lines", "image_records", "image_text_records")


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def parse_manifest_line(raw: bytes) -> tuple[tuple[str, str | None] | None, str | None]:
    """One manifest line (without its newline) -> ``((text, image or None), None)`` for a usable
    record, ``(None, reason)`` for a bad one, ``(None, None)`` for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, f"line is not UTF-8 text (byte {error.start} of the line)"
    if not line.strip():
        return None, None
    try:
        data = json.loads(line)
    except RecursionError:  # arrays or objects nested thousands deep
        return None, "invalid JSON (nested too deeply)"
    except ValueError as error:  # JSONDecodeError; an integer of over 4300 digits (without the advice)
        return None, f"invalid JSON ({one_line(error).split('; use sys.')[0]})"
    if not isinstance(data, dict):
        return None, f"a record must be a JSON object, got {type(data).__name__}"
    text = data.get("text")
    if not isinstance(text, str) or not text.strip():
        return None, f"record has no text (a non-empty 'text' string), got {text!r}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # JSON "\ud800": half of a surrogate pair
        return None, f"text is not valid Unicode (lone surrogate at character {error.start})"
    image = data.get("image")
    if image is None:
        return (text, None), None
    if not isinstance(image, str) or not image:
        return None, f"'image' must be a path string or null, got {image!r}"
    if "\x00" in image:
        return None, f"'image' is not a valid path (NUL at character {image.index(chr(0))})"
    try:
        image.encode("utf-8")
    except UnicodeEncodeError as error:
        return None, f"'image' is not a valid path (lone surrogate at character {error.start})"
    return (text, image), None


def open_manifest(manifest: Path):
    """``manifest`` opened for binary reading, ``OSError`` when it cannot be, ``ValueError`` (one
    line) when it is not a regular file: opened without blocking, as a FIFO would block a plain open
    forever (and a device such as ``/dev/zero`` be read forever)."""
    fd = os.open(manifest, os.O_RDONLY | os.O_NONBLOCK)
    if not stat_module.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"manifest {manifest} is not a regular file (a JSON-lines file is needed)")
    return os.fdopen(fd, "rb")


def manifest_key(manifest: Path) -> str:
    """``<size>-<mtime ns>-<sha256 of the first and last 64 KiB, 16 hex digits>``: changes when the
    manifest is rewritten, appended to or touched. ``OSError`` when it cannot be read, ``ValueError``
    when it is not a regular file."""
    digest = hashlib.sha256(f"format {INDEX_FORMAT}".encode())
    with open_manifest(manifest) as file:
        stat = os.fstat(file.fileno())
        digest.update(file.read(HEAD_TAIL_BYTES))
        if stat.st_size > HEAD_TAIL_BYTES:
            file.seek(max(HEAD_TAIL_BYTES, stat.st_size - HEAD_TAIL_BYTES))
            digest.update(file.read(HEAD_TAIL_BYTES))
    return f"{stat.st_size}-{stat.st_mtime_ns}-{digest.hexdigest()[:16]}"


def default_fallback_dir() -> Path:
    return Path.home() / ".cache" / "moetrain" / "manifest-index"


def cache_roots(manifest: Path, fallback_dir: Path | None = None) -> tuple[Path, Path]:
    """``(next to the manifest, in the fallback directory)``: where a manifest's indexes live."""
    manifest = manifest.absolute()
    beside = manifest.parent / f".{manifest.name}.index"
    fallback = Path(fallback_dir) if fallback_dir is not None else default_fallback_dir()
    tag = hashlib.sha256(str(manifest).encode()).hexdigest()[:16]
    return beside, fallback / f"{manifest.name}-{tag}"


def _complete(directory: Path, key: str) -> bool:
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("key") == key and meta.get("format") == INDEX_FORMAT


class _SpilledArray:
    """An append-only ``uint64`` array written to ``<path>.raw`` in chunks (the builder's memory
    stays bounded), then turned into ``<path>.npy``."""

    def __init__(self, path: Path):
        self.path = path
        self.raw = open(path.with_suffix(".raw"), "wb")  # noqa: SIM115 - closed in finish()
        self.buffer = array("Q")
        self.count = 0

    def append(self, value: int) -> None:
        self.buffer.append(value)
        if len(self.buffer) >= _SPILL_ENTRIES:
            self._flush()

    def _flush(self) -> None:
        self.raw.write(np.frombuffer(self.buffer, dtype=np.uint64).astype("<u8").tobytes())
        self.count += len(self.buffer)
        self.buffer = array("Q")

    def finish(self) -> int:
        self._flush()
        self.raw.close()
        raw_path = self.path.with_suffix(".raw")
        with open(self.path.with_suffix(".npy"), "wb") as out, open(raw_path, "rb") as data:
            header = {"descr": "<u8", "fortran_order": False, "shape": (self.count,)}
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(data, out, 1 << 22)
        raw_path.unlink()
        return self.count

    def discard(self) -> None:
        if not self.raw.closed:
            self.raw.close()


def _skip_rest_of_line(file) -> int:
    """Reads ``file`` (binary) up to the end of its current line, 1 MiB at a time; returns the
    bytes read (the newline included)."""
    skipped = 0
    while chunk := file.readline(1 << 20):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def _write_index(manifest: Path, directory: Path, key: str, progress: bool | None) -> dict:
    """Parses ``manifest`` into the arrays and ``meta.json`` of ``directory`` (must exist);
    returns the meta. ``progress``: a progress bar (None: for manifests of 8 MiB or more)."""
    file = open_manifest(manifest)  # closed by the with below
    size = os.fstat(file.fileno()).st_size
    arrays = {name: _SpilledArray(directory / name) for name in _ARRAYS}
    reasons: list[tuple[int, str]] = []
    bad = 0
    megabytes = max(1, -(-size // 2**20))
    bar = None
    if progress or (progress is None and size >= PROGRESS_MIN_BYTES):
        bar = ProgressBar(megabytes, f"indexing {manifest.name} (MB)", log_every=max(1, megabytes // 10))
    try:
        with file:
            offset, shown, number = 0, 0, 0
            while raw := file.readline(MAX_LINE_BYTES + 1):
                number += 1
                length = len(raw)
                if length > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    length += _skip_rest_of_line(file)
                    parsed, reason = None, LONG_LINE_REASON
                else:
                    parsed, reason = parse_manifest_line(raw[:-1] if raw.endswith(b"\n") else raw)
                if parsed is not None:
                    record = arrays["offsets"].count + len(arrays["offsets"].buffer)
                    arrays["offsets"].append(offset)
                    arrays["lines"].append(number)
                    text, image = parsed
                    if image is not None:
                        arrays["image_records"].append(record)
                        if len(text) >= 2:
                            arrays["image_text_records"].append(record)
                elif reason is not None:
                    bad += 1
                    if len(reasons) < MAX_STORED_REASONS:
                        reasons.append((number, reason))
                offset += length
                if bar is not None and offset >> 20 > shown:
                    shown = offset >> 20
                    bar.update(
                        shown, records=arrays["offsets"].count + len(arrays["offsets"].buffer), bad=bad
                    )
        counts = {name: spilled.finish() for name, spilled in arrays.items()}
    finally:
        for spilled in arrays.values():
            spilled.discard()
        if bar is not None:
            bar.update(megabytes, records=arrays["offsets"].count, bad=bad)
            bar.close()
    meta = {
        "format": INDEX_FORMAT,
        "key": key,
        "manifest": str(manifest),
        "records": counts["offsets"],
        "image_records": counts["image_records"],
        "image_text_records": counts["image_text_records"],
        "bad_lines": bad,
        "bad_reasons": reasons,
    }
    (directory / "meta.json").write_text(json.dumps(meta))
    return meta


def _writable_root(root: Path) -> bool:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(root, os.W_OK | os.X_OK)


def _other_indexes(manifest: Path, key: str, fallback_dir: Path | None) -> list[Path]:
    """The index directories of ``manifest`` other than ``key``'s (temporary ones excluded)."""
    found = []
    for root in cache_roots(manifest, fallback_dir):
        with contextlib.suppress(OSError):
            found += [e for e in root.iterdir() if e.name != key and not e.name.startswith(".tmp-")]
    return sorted(found)


def _size(directory: Path) -> int:
    """Bytes in ``directory``'s files (0 when it went away meanwhile)."""
    try:
        return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    except OSError:
        return 0


def remove_other_indexes(manifest: str | Path, fallback_dir: str | Path | None = None) -> list[Path]:
    """Removes the indexes of ``manifest``'s older versions (every key but the current one, next
    to it and in the fallback directory) and returns them. Only safe when no running job uses
    one: a job reads its index until it ends. ``ValueError`` when the manifest cannot be read."""
    manifest = Path(manifest)
    try:
        key = manifest_key(manifest)
    except OSError as error:
        raise ValueError(f"manifest {manifest} cannot be read: {one_line(error)}") from None
    removed = _other_indexes(manifest, key, None if fallback_dir is None else Path(fallback_dir))
    for directory in removed:
        shutil.rmtree(directory, ignore_errors=True)
    return removed


def ensure_index(
    manifest: str | Path, fallback_dir: str | Path | None = None, progress: bool | None = None
) -> Path:
    """The directory of ``manifest``'s current index, building it first when there is none (see
    the module docstring; one log line per build). ``progress``: a progress bar (logged) while
    building (None: for manifests of 8 MiB or more). ``ValueError`` when the manifest cannot be
    read."""
    manifest = Path(manifest)
    try:
        key = manifest_key(manifest)
    except OSError as error:
        raise ValueError(f"manifest {manifest} cannot be read: {one_line(error)}") from None
    beside, fallback = cache_roots(manifest, None if fallback_dir is None else Path(fallback_dir))
    for root in (beside, fallback):
        if _complete(root / key, key):
            return root / key
    root = beside
    if not _writable_root(beside):
        root = fallback
        if not _writable_root(fallback):
            raise ValueError(
                f"manifest {manifest}: cannot write its index next to it ({beside}) nor in {fallback}"
            )
        log.warning("manifest directory %s is not writable: its index is cached in %s", manifest.parent, root)
    temporary = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    os.chmod(temporary, 0o755)  # mkdtemp's 0700 would hide a shared corpus's index from other users
    try:
        started = time.perf_counter()
        try:
            meta = _write_index(manifest, temporary, key, progress)
        except OSError as error:
            raise ValueError(f"manifest {manifest} cannot be read: {one_line(error)}") from None
        try:
            os.rename(temporary, root / key)
        except OSError:
            if not _complete(root / key, key):  # not lost to a concurrent builder
                raise
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
    log.info(
        "indexed %s: %d records (%d with an image), %d bad lines, in %.1f s; cached in %s",
        manifest, meta["records"], meta["image_records"], meta["bad_lines"], time.perf_counter() - started,
        root / key,
    )  # fmt: skip
    others = _other_indexes(manifest, key, None if fallback_dir is None else Path(fallback_dir))
    if others:
        log.info(
            "%s: %d older index(es) kept (%.1f MB; a running job may still read one); remove them with "
            "'python -m m6_moe.index_command --prune %s' when none does",
            manifest, len(others), sum(_size(d) for d in others) / 1e6, manifest,
        )  # fmt: skip
    return root / key


class IndexArray:
    """A one-dimensional ``.npy`` array on disk, read element by element with ``pread``.

    Not memory-mapped: a mapping's resident pages count against every process that touches
    them, and the kernel maps whole page-cache folios around each touched element (on this
    project's machine, 3,200 random lookups in a mapped 78 MB array left all 78 MB resident, with
    ``MADV_RANDOM``). Read through ``pread``, the index costs a process nothing resident; what it
    reads stays in the page cache, shared by every process of the node and reclaimable.
    ``array[i]`` -> int; ``array[i_N]`` (an int array) or ``array[a:b]`` -> ``np.ndarray``."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as file:
            version = np.lib.format.read_magic(file)
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(file)
            else:
                shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(file)
            self.start = file.tell()
        if len(shape) != 1 or fortran_order:
            raise ValueError(f"{path} is not a one-dimensional index array")
        self.dtype, self.size = dtype, shape[0]
        self._fd: int | None = None

    def __len__(self) -> int:
        return self.size

    def _read(self, first: int, count: int) -> np.ndarray:
        if first < 0 or first + count > self.size:
            raise IndexError(f"entries {first}..{first + count - 1} of {self.path} ({self.size} entries)")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        width = self.dtype.itemsize
        data = os.pread(self._fd, count * width, self.start + first * width)
        return np.frombuffer(data, dtype=self.dtype, count=count)

    def __getitem__(self, key):
        if isinstance(key, slice):
            first, stop, step = key.indices(self.size)
            values = self._read(first, max(0, stop - first))
            return values[::step]
        if np.ndim(key) == 0:
            return int(self._read(int(key), 1)[0])
        keys = np.asarray(key, dtype=np.int64)
        values = [self._read(int(k), 1)[0] for k in keys.ravel()]
        return np.array(values, dtype=self.dtype).reshape(keys.shape)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class ManifestIndex:
    """One manifest's index, opened from the directory :func:`ensure_index` returned. Arrays
    (:class:`IndexArray`) and the manifest are opened on first use and closed by :meth:`close`
    (a pickled copy, a spawned worker's, opens its own). ``read(i)`` returns record ``i``'s line."""

    def __init__(self, manifest: str | Path, directory: str | Path):
        self.manifest = Path(manifest)
        self.directory = Path(directory)
        meta = json.loads((self.directory / "meta.json").read_text())
        self.records: int = meta["records"]
        self.image_records: int = meta["image_records"]
        self.image_text_records: int = meta["image_text_records"]
        self.bad_lines: int = meta["bad_lines"]
        self.bad_reasons: list[tuple[int, str]] = [(int(n), r) for n, r in meta["bad_reasons"]]
        self._arrays: dict[str, IndexArray] = {}
        self._fd: int | None = None

    def array(self, name: str) -> IndexArray:
        """``offsets``, ``lines``, ``image_records`` or ``image_text_records``."""
        opened = self._arrays.get(name)
        if opened is None:
            opened = self._arrays[name] = IndexArray(self.directory / f"{name}.npy")
        return opened

    def line_number(self, record: int) -> int:
        return self.array("lines")[record]

    def read(self, record: int) -> bytes:
        """Record ``record``'s line, without its newline (``pread``: no shared file position); at
        most its first ``MAX_LINE_BYTES + 4096`` bytes (a longer line was not indexed: the manifest
        changed, and the cut line then fails to parse)."""
        if self._fd is None:
            self._fd = os.open(self.manifest, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put in its place
        position = self.array("offsets")[record]
        chunks, size = [], 0
        while size <= MAX_LINE_BYTES:
            chunk = os.pread(self._fd, 4096, position)
            end = chunk.find(b"\n")
            if end >= 0:
                chunks.append(chunk[:end])
                return b"".join(chunks)
            chunks.append(chunk)
            if len(chunk) < 4096:  # the last line, without a newline
                return b"".join(chunks)
            position += len(chunk)
            size += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        for opened in self._arrays.values():
            opened.close()
        self._arrays.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_arrays={}, _fd=None)
        return state

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


if __name__ == "__main__":  # the command before it moved to m6_moe.index_command (which see)
    from m6_moe.index_command import main

    raise SystemExit(main())
