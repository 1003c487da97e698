"""Image-text records from one or many JSON-lines manifests, images read with Pillow.

Manifest: one JSON object per line, ``{"image": path, "text": str}``; ``image`` is relative to
that manifest's directory (or absolute) and may be left out (or null) for a text-only record, which
only the text-to-text task uses. Other keys are ignored; blank lines are skipped. Many manifests
(a list, or glob patterns, see :func:`resolve_manifests`) form one dataset: their records are
numbered in the order the manifests are given.

Records are not held in memory: each manifest has an index of its lines' offsets, built once and
cached next to it (:mod:`m6_moe.manifest_index`), and a record is read from the manifest when it is
needed (:meth:`ManifestDataset.record`). Building the index checks every line: it must be UTF-8 text
holding a JSON object with a non-empty ``text`` string and an ``image`` that is a path string (no
NUL, no lone surrogate) or null; a manifest that is not a regular file is refused. Image files are
checked when a record's image is first loaded (:meth:`ManifestDataset.load_image`: the file exists,
Pillow identifies its header, it has at most ``max_image_pixels`` pixels and its pixels decode), so
startup costs no per-image I/O on any rank; :meth:`ManifestDataset.verify_images` checks every image
up front (once, with a progress bar) for those who want bad files found before a long run. Either
way a bad record raises a one-line ``ValueError`` naming the manifest and its line, or, with
``skip_bad_records=True``, is skipped and counted in ``skipped_records`` (the first reasons in
``skip_reasons``; :meth:`skip_summary` is the one-line report for the logs). A manifest without any
usable record always raises. Image files are opened only when they are regular files in one of
:data:`IMAGE_FORMATS`.
"""

from __future__ import annotations

import glob
import os
import stat
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from m6_moe.manifest_index import (
    MAX_STORED_REASONS,
    ManifestIndex,
    ensure_index,
    one_line,
    parse_manifest_line,
)
from m6_moe.optional import pillow
from moetrain.progress import ProgressBar

# Larger images are bad records: decoding one costs width * height * 4 bytes and is redone on every
# draw (a 169-megapixel photo took 1.2 GB). 50 megapixels is above any camera image a captioning
# corpus resizes to a few hundred pixels.
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000

# The image formats Pillow may open (detected from the header, not the name): others are bad
# records. Pillow's other plugins include EPS, which runs Ghostscript on the file's PostScript.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")

# Manifests whose files (the manifest and its index arrays, read with pread: one descriptor each) a
# process keeps open at once; a corpus of thousands of shard manifests reopens the least recently
# used ones.
MAX_OPEN_MANIFESTS = 64

# Which records an epoch runs over (see TaskSampler): all, those with an image, or those with an
# image and >= 2 characters of text.
RECORD_KINDS = ("all", "image", "image_text")
_KIND_ARRAYS = {"image": "image_records", "image_text": "image_text_records"}


@dataclass(frozen=True)
class Record:
    text: str
    image: Path | None  # resolved path, None for a text-only record
    line: int  # 1-based line in its manifest


def resolve_manifests(source: str | Path | Sequence[str | Path]) -> list[Path]:
    """A path, a glob pattern (``*``, ``?``, ``[``: its matches, sorted) or a list of them -> the
    manifest paths in order. An existing file is taken as given even when its name holds those
    characters (``caps[2024].jsonl``). ``ValueError`` for an empty list or a pattern matching
    nothing."""
    entries = [source] if isinstance(source, (str, Path)) else list(source)
    if not entries:
        raise ValueError("data.source must name at least one manifest, got an empty list")
    manifests: list[Path] = []
    for entry in entries:
        if not isinstance(entry, (str, Path)) or not str(entry):
            raise ValueError(f"data.source entries must be manifest paths or glob patterns, got {entry!r}")
        manifests += _resolve_entry(str(entry))
    return manifests


def _resolve_entry(text: str) -> list[Path]:
    """One ``data.source`` entry -> its manifest paths: the file itself when it exists or holds no
    glob character (a missing file is reported when it is opened), else the pattern's sorted
    matches."""
    if not any(char in text for char in "*?[") or Path(text).is_file():
        return [Path(text)]
    matches = sorted(glob.glob(text))
    if not matches:
        raise ValueError(f"data.source pattern {text!r} matches no file")
    return [Path(m) for m in matches]


def image_to_tensor(image, size: int, channels: int) -> torch.Tensor:
    """A Pillow image -> ``uint8 [channels, size, size]``: converted to RGB (3) or grey (1), then
    resized with bicubic filtering. Greyscale samples of more than 8 bits are scaled to 8 first
    (Pillow's conversion would clip them at 255): integer modes (``I;16*``, ``I``) as 16-bit,
    ``round(x / 257)``, float (``F``) as [0, 1], ``round(x * 255)``, then clipped to [0, 255]."""
    mode = "RGB" if channels == 3 else "L"
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        scale = 255.0 if image.mode == "F" else 1 / 257
        image = image.convert("F").point(lambda x: x * scale + 0.5).convert("L")  # L truncates
    image = image.convert(mode).resize((size, size), pillow().Image.Resampling.BICUBIC)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(size, size, channels).permute(2, 0, 1).contiguous()


def normalize_pixels(pixels_CHW: torch.Tensor) -> torch.Tensor:
    """``uint8`` pixels -> float in [-1, 1]: ``x / 127.5 - 1``."""
    return pixels_CHW.float() / 127.5 - 1.0


class RecordView(Sequence):
    """``dataset.records``: a read-only sequence of :class:`Record` read on access (nothing held)."""

    def __init__(self, dataset: ManifestDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.dataset.record(i) for i in range(*index.indices(len(self)))]
        return self.dataset.record(index)


class KindView:
    """The records of one kind (``RECORD_KINDS``), numbered ``0 .. len - 1``: ``view[j]`` is the
    dataset index of the ``j``-th (an int, or an int array for an array of ``j``)."""

    def __init__(self, dataset: ManifestDataset, kind: str):
        self.dataset, self.kind = dataset, kind
        counts = [dataset.kind_count(kind, k) for k in range(len(dataset.indexes))]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, j):
        scalar = np.ndim(j) == 0
        j_N = np.array(j, dtype=np.int64, ndmin=1)
        if self.kind == "all":
            result = j_N
        else:
            manifest_N = np.searchsorted(self.starts, j_N, side="right") - 1
            result = np.empty_like(j_N)
            for k in np.unique(manifest_N).tolist():
                rows = manifest_N == k
                local = self.dataset.index(k).array(_KIND_ARRAYS[self.kind])[j_N[rows] - self.starts[k]]
                result[rows] = local.astype(np.int64) + self.dataset.starts[k]
        return int(result[0]) if scalar else result


class ManifestDataset:
    """The records of one or many manifests (see the module docstring). ``image_size`` /
    ``image_channels``: what :meth:`load_image` returns. ``cache_images``: keep decoded ``uint8``
    images in memory (small datasets). ``fallback_dir``: where indexes are cached when a manifest's
    directory is read-only. ``progress``: a progress bar while an index is built (None: for
    manifests of 8 MiB or more). ``source``: ``manifests`` as given when it is one path or pattern
    (e.g. ``"held/part-*.jsonl"``), None for a list."""

    def __init__(
        self,
        manifests: str | Path | Sequence[str | Path],
        image_size: int,
        image_channels: int = 3,
        skip_bad_records: bool = False,
        cache_images: bool = False,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        fallback_dir: str | Path | None = None,
        progress: bool | None = None,
    ):
        self.source = str(manifests) if isinstance(manifests, (str, Path)) else None
        self.manifests = resolve_manifests(manifests)
        self.image_size = image_size
        self.image_channels = image_channels
        self.max_image_pixels = max_image_pixels
        self.skip_bad_records = skip_bad_records
        self.cache_images = cache_images
        self.indexes = [
            ManifestIndex(m, ensure_index(m, fallback_dir, progress=progress)) for m in self.manifests
        ]
        self.starts = np.concatenate([[0], np.cumsum([i.records for i in self.indexes], dtype=np.int64)])
        self.manifest_bad_lines = sum(i.bad_lines for i in self.indexes)
        self._manifest_reasons = [
            f"{index.manifest}:{line}: {reason}"
            for index in self.indexes
            for line, reason in index.bad_reasons
        ][:MAX_STORED_REASONS]
        # Images found bad in this process: a bit per record (allocated at the first), their indices
        # in the order found (append-only) and the reasons of the first MAX_STORED_REASONS.
        self._bad_bits: np.ndarray | None = None
        self._bad_order = array("q")
        self._bad_reasons: dict[int, str] = {}
        self._cache: dict[int, torch.Tensor] = {}
        self._open: OrderedDict[int, None] = OrderedDict()
        self._check_records()

    def _check_records(self) -> None:
        for index in self.indexes:
            if index.bad_lines and not self.skip_bad_records:
                line, reason = index.bad_reasons[0]
                raise ValueError(f"{index.manifest}:{line}: {reason}")
            if index.records == 0:
                detail = f" ({index.bad_lines} bad records skipped)" if index.bad_lines else ""
                raise ValueError(f"manifest {index.manifest} holds no usable records{detail}")

    @property
    def manifest(self) -> Path | str:
        """The manifest's path (one manifest), or ``"<n> manifests (<first> ...)"``."""
        if len(self.manifests) == 1:
            return self.manifests[0]
        return f"{len(self.manifests)} manifests ({self.manifests[0]} ...)"

    def __len__(self) -> int:
        return int(self.starts[-1])

    def index(self, k: int) -> ManifestIndex:
        """Manifest ``k``'s index, kept among the :data:`MAX_OPEN_MANIFESTS` most recently used."""
        self._open[k] = None
        self._open.move_to_end(k)
        if len(self._open) > MAX_OPEN_MANIFESTS:
            oldest, _ = self._open.popitem(last=False)
            self.indexes[oldest].close()
        return self.indexes[k]

    def locate(self, index: int) -> tuple[int, int]:
        """Dataset index -> ``(manifest number, record number in that manifest)``."""
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of a dataset of {len(self)} records")
        k = int(np.searchsorted(self.starts, index, side="right")) - 1
        return k, index - int(self.starts[k])

    def kind_count(self, kind: str, k: int | None = None) -> int:
        """Records of ``kind`` (``RECORD_KINDS``) in manifest ``k`` (None: in all)."""
        if kind not in RECORD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, RECORD_KINDS))}, got {kind!r}")
        indexes = self.indexes if k is None else [self.indexes[k]]
        name = {"all": "records", **_KIND_ARRAYS}[kind]
        return sum(getattr(i, name) for i in indexes)

    def kind(self, kind: str) -> KindView:
        """The records of ``kind`` as a :class:`KindView`."""
        if kind not in RECORD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, RECORD_KINDS))}, got {kind!r}")
        return KindView(self, kind)

    def where(self, index: int) -> str:
        """``"<manifest>:<line>"`` of record ``index``."""
        k, local = self.locate(index)
        return f"{self.indexes[k].manifest}:{self.index(k).line_number(local)}"

    def read(self, index: int) -> tuple[str, Path | None]:
        """Record ``index``'s ``(text, resolved image path or None)``, read from its manifest (its
        line number, in another array, is not read: see :meth:`record`)."""
        k, local = self.locate(index)
        manifest = self.index(k)
        parsed, reason = parse_manifest_line(manifest.read(local))
        if parsed is None:
            raise ValueError(
                f"{self.where(index)}: {reason or 'blank line'} (the manifest changed after its index "
                "was built)"
            )
        text, image = parsed
        if image is None:
            return text, None
        return text, Path(image) if Path(image).is_absolute() else manifest.manifest.parent / image

    def record(self, index: int) -> Record:
        """Record ``index`` with its line number."""
        k, local = self.locate(index)
        return Record(*self.read(index), self.index(k).line_number(local))

    @property
    def records(self) -> RecordView:
        """Every record, read on access (``dataset.records[i]``, iteration)."""
        return RecordView(self)

    # --------------------------------------------------------------------------- bad records
    @property
    def skipped_records(self) -> int:
        """Records skipped so far: bad manifest lines (found when the index was built) and images
        found bad in this process by :meth:`load_image` / :meth:`verify_images` or reported by
        :meth:`note_bad`."""
        return self.manifest_bad_lines + len(self._bad_order)

    @property
    def skip_reasons(self) -> list[str]:
        """The reasons, each naming the manifest and line: the manifests' bad lines first, then the
        bad images in the order they were found (the first :data:`MAX_STORED_REASONS` of each)."""
        return self._manifest_reasons + list(self._bad_reasons.values())

    def bad_images_since(self, count: int) -> list[tuple[int, str | None]]:
        """``(dataset index, reason or None when not stored)`` of the images found bad in this
        process after the first ``count`` (a loader worker reports what it found since its last
        report)."""
        return [(index, self._bad_reasons.get(index)) for index in self._bad_order[count:]]

    @property
    def undecodable(self) -> frozenset[int]:
        """Indices of the records whose image was found bad (skip mode)."""
        return frozenset(self._bad_order)

    def is_bad(self, index: int) -> bool:
        """Whether record ``index``'s image was found bad (skip mode); O(1)."""
        if self._bad_bits is None or not 0 <= index < len(self):
            return False
        return bool(self._bad_bits[index >> 3] >> (index & 7) & 1)

    def note_bad(self, index: int, reason: str | None) -> bool:
        """Records that ``index``'s image is bad (found by another process: a loader worker, whose
        ``reason`` is None past its first :data:`MAX_STORED_REASONS`); True when it was not known
        yet (then it is counted)."""
        if self.is_bad(index):
            return False
        if self._bad_bits is None:
            self._bad_bits = np.zeros((len(self) + 7) // 8, dtype=np.uint8)
        self._bad_bits[index >> 3] |= 1 << (index & 7)
        self._bad_order.append(index)
        if reason is not None and len(self._bad_reasons) < MAX_STORED_REASONS:
            self._bad_reasons[index] = reason
        return True

    def _reject(self, index: int, line_reason: str) -> None:
        message = f"{self.where(index)}: {line_reason}"
        if not self.skip_bad_records:
            raise ValueError(message)
        self.note_bad(index, message)

    def load_image(self, index: int) -> torch.Tensor | None:
        """Record ``index``'s image as ``uint8 [C, image_size, image_size]``. A missing,
        unidentifiable, oversized or undecodable file raises ``ValueError`` naming the manifest
        line, or (``skip_bad_records``) marks the record unusable, counts it once and returns None."""
        if self.is_bad(index):
            return None
        cached = self._cache.get(index)
        if cached is not None:
            return cached
        _, image = self.read(index)
        if image is None:
            raise ValueError(f"{self.where(index)}: record has no image")
        pixels, reason = decode_image_file(image, self.image_size, self.image_channels, self.max_image_pixels)
        if pixels is None:
            self._reject(index, reason)
            return None
        if self.cache_images:
            self._cache[index] = pixels
        return pixels

    def verify_images(self, progress: bool = True) -> int:
        """Checks every image file now (exists, header identifiable, pixel count; pixels are not
        decoded) instead of at first load, with a :class:`~moetrain.progress.ProgressBar` (logged)
        when ``progress``. A bad one raises, or (skip mode) is marked and counted as :meth:`load_image`
        would. Returns the number of bad images found. Costs one file open per image record: run it
        once, in one process, to vet a manifest before a long run, not on every rank (what it finds
        stays in this process; training ranks still find a bad file when they draw it)."""
        images = self.kind("image")
        bar = None
        if progress:
            names = ", ".join(m.name for m in self.manifests[:3]) + (
                " ..." if len(self.manifests) > 3 else ""
            )
            bar = ProgressBar(len(images), f"checking images of {names}", log_every=max(1, len(images) // 10))
        bad = 0
        for done in range(1, len(images) + 1):
            index = images[done - 1]
            if not self.is_bad(index):
                reason = _check_header(self.read(index)[1], self.max_image_pixels)
                if reason is not None:
                    bad += 1
                    self._reject(index, reason)
            if bar is not None:
                bar.update(done, bad=bad)
        if bar is not None:
            bar.close()
        return bad

    def skip_summary(self, max_reasons: int = 3) -> str:
        """One line for the logs: the number of records skipped so far and the first
        ``max_reasons`` reasons (each names the manifest and line), e.g. ``"5 bad records skipped:
        d/m.jsonl:3: image d/a.png does not exist; d/m.jsonl:9: record has no text ...; ... 3
        more"``, or ``"no bad records skipped (d/m.jsonl)"``."""
        count = self.skipped_records
        if count == 0:
            return f"no bad records skipped ({self.manifest})"
        shown = self.skip_reasons[:max_reasons]  # fewer than the count when reasons were not stored
        more = f"; ... {count - len(shown)} more" if count > len(shown) else ""
        return f"{count} bad record{'s' if count != 1 else ''} skipped: {'; '.join(shown)}{more}"

    def close(self) -> None:
        """Releases every index's maps and file descriptor (reopened on next use)."""
        for index in self.indexes:
            index.close()
        self._open.clear()


def _too_large(path: Path, image, max_pixels: int) -> str | None:
    width, height = image.size
    if width * height > max_pixels:
        return (
            f"image {path} has {width} x {height} = {width * height:,} pixels, more than "
            f"tasks.max_image_pixels = {max_pixels:,}"
        )
    return None


class _BadImage(Exception):
    """A bad image file; the message is the one-line reason."""


def _open_file(path: Path):
    """``path`` opened for binary reading when it is a regular file, else ``_BadImage``: opened
    without blocking, as a FIFO or device would block a plain open (and the loader) forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _BadImage(f"image {path} does not exist") from None
    except OSError as error:
        raise _BadImage(f"image {path} cannot be read ({one_line(error)})") from None
    except ValueError as error:  # a NUL character, or one the file system encoding cannot encode
        raise _BadImage(f"image {str(path)!r} is not a valid path ({one_line(error)})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _BadImage(f"image {path} is not a regular file")
    return os.fdopen(fd, "rb")


def _open_image(path: Path, file):
    """``file`` (``path``'s, left open) as a Pillow image, header read, if its format is one of
    :data:`IMAGE_FORMATS`, else ``_BadImage``."""
    try:
        return pillow().Image.open(file, formats=IMAGE_FORMATS)
    except Exception as error:  # Pillow raises many types for bad files
        detail, found = one_line(error), _header_format(file)
        if found is not None and found not in IMAGE_FORMATS:
            detail = f"format {found} is not one of {', '.join(IMAGE_FORMATS)}"
        raise _BadImage(f"image {path} cannot be read ({detail})") from None


def _header_format(file) -> str | None:
    """The first Pillow format whose header test accepts ``file``'s first 16 bytes (Pillow's own
    test; no plugin parses the file), None when none does."""
    image_module = pillow().Image
    image_module.init()
    try:
        file.seek(0)
        prefix = file.read(16)
    except OSError:
        return None
    for name in image_module.ID:
        accept = image_module.OPEN[name][1]
        try:
            accepted = accept is not None and accept(prefix)
        except Exception:  # a test that unpacks the prefix (BMP's, on under 4 bytes): not that format
            continue
        if accepted:  # a str: that format, which Pillow cannot open
            return name
    return None


def _check_header(path: Path, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> str | None:
    """None when ``path`` is a regular file whose header Pillow identifies as one of
    :data:`IMAGE_FORMATS` (only the header is read) and it has at most ``max_pixels`` pixels, else
    the one-line reason."""
    try:
        with _open_file(path) as file, _open_image(path, file) as opened:
            return _too_large(path, opened, max_pixels)
    except _BadImage as bad:
        return str(bad)


def decode_image_file(
    path: Path, size: int, channels: int, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> tuple[torch.Tensor | None, str]:
    """``(uint8 [channels, size, size], "")`` or ``(None, one-line reason)``: a missing file or one
    that is not a regular file, an unidentifiable header or a format not in :data:`IMAGE_FORMATS`
    ("cannot be read"), more than ``max_pixels`` pixels (checked on the header, before any pixel
    is decoded) or truncated / corrupt pixel data ("cannot be decoded")."""
    try:
        with _open_file(path) as file, _open_image(path, file) as opened:
            too_large = _too_large(path, opened, max_pixels)
            if too_large is not None:
                return None, too_large
            try:
                return image_to_tensor(opened, size, channels), ""
            except Exception as error:  # Pillow raises many types for truncated / corrupt data
                return None, f"image {path} cannot be decoded ({one_line(error)})"
    except _BadImage as bad:
        return None, str(bad)
