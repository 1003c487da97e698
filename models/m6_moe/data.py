"""Image-text records from a JSON-lines manifest, images read with Pillow.

Manifest: one JSON object per line, ``{"image": path, "text": str}``; ``image`` is relative to
the manifest's directory (or absolute) and may be left out (or null) for a text-only record, which
only the text-to-text task uses. Other keys are ignored; blank lines are skipped.

Construction reads the manifest only, no image: every line must be valid JSON, an object, with a
non-empty ``text`` string and an ``image`` that is a path string or null. Image files are checked
when a record is first loaded (:meth:`ManifestDataset.load_image`: the file exists, Pillow
identifies its header and decodes its pixels), so startup costs no per-image I/O on any rank;
:meth:`ManifestDataset.verify_images` checks every image up front (once, with a progress bar) for
those who want bad files found before a long run. Either way a bad record raises a one-line
``ValueError`` naming the manifest and its line, or, with ``skip_bad_records=True``, is skipped
and counted in ``skipped_records`` (the reasons in ``skip_reasons``; :meth:`skip_summary` is the
one-line report for the logs). A manifest without any usable record always raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from moetrain.progress import ProgressBar

# Larger images are bad records: decoding one costs width * height * 4 bytes and is redone on every
# draw (a 169-megapixel photo took 1.2 GB). 50 megapixels is above any camera image a captioning
# corpus resizes to a few hundred pixels.
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000


@dataclass(frozen=True)
class Record:
    text: str
    image: Path | None  # resolved path, None for a text-only record
    line: int  # 1-based line in the manifest


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def image_to_tensor(image, size: int, channels: int) -> torch.Tensor:
    """A Pillow image -> ``uint8 [channels, size, size]``: converted to RGB (3) or grey (1), then
    resized with bicubic filtering."""
    mode = "RGB" if channels == 3 else "L"
    image = image.convert(mode).resize((size, size), Image.Resampling.BICUBIC)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(size, size, channels).permute(2, 0, 1).contiguous()


def normalize_pixels(pixels_CHW: torch.Tensor) -> torch.Tensor:
    """``uint8`` pixels -> float in [-1, 1]: ``x / 127.5 - 1``."""
    return pixels_CHW.float() / 127.5 - 1.0


class ManifestDataset:
    """The records of one manifest (read at construction; image files are checked lazily, see
    the module docstring). ``image_size`` / ``image_channels``: what :meth:`load_image` returns.
    ``cache_images``: keep decoded ``uint8`` images in memory (small datasets)."""

    def __init__(
        self,
        manifest: str | Path,
        image_size: int,
        image_channels: int = 3,
        skip_bad_records: bool = False,
        cache_images: bool = False,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ):
        self.manifest = Path(manifest)
        self.image_size = image_size
        self.image_channels = image_channels
        self.max_image_pixels = max_image_pixels
        self.skip_bad_records = skip_bad_records
        self.cache_images = cache_images
        self.skip_reasons: list[str] = []
        self._bad: set[int] = set()
        self._cache: dict[int, torch.Tensor] = {}
        self.records = self._read()

    @property
    def skipped_records(self) -> int:
        """Records skipped so far: at construction (manifest lines) and by :meth:`load_image` /
        :meth:`verify_images` (image files)."""
        return len(self.skip_reasons)

    def __len__(self) -> int:
        return len(self.records)

    def _reject(self, line: int, reason: str) -> None:
        message = f"{self.manifest}:{line}: {reason}"
        if not self.skip_bad_records:
            raise ValueError(message)
        self.skip_reasons.append(message)

    def _read(self) -> list[Record]:
        try:
            raw_lines = self.manifest.read_bytes().split(b"\n")
        except OSError as error:
            raise ValueError(f"manifest {self.manifest} cannot be read: {_one_line(error)}") from None
        records = []
        for number, raw in enumerate(raw_lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                self._reject(number, f"line is not UTF-8 text (byte {error.start} of the line)")
                continue
            if not line.strip():
                continue
            record = self._parse(number, line)
            if record is not None:
                records.append(record)
        if not records:
            detail = f" ({len(self.skip_reasons)} bad records skipped)" if self.skip_reasons else ""
            raise ValueError(f"manifest {self.manifest} holds no usable records{detail}")
        return records

    def _parse(self, number: int, line: str) -> Record | None:
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            return self._reject(number, f"invalid JSON ({_one_line(error)})")
        if not isinstance(data, dict):
            return self._reject(number, f"a record must be a JSON object, got {type(data).__name__}")
        text = data.get("text")
        if not isinstance(text, str) or not text.strip():
            return self._reject(number, f"record has no text (a non-empty 'text' string), got {text!r}")
        image = data.get("image")
        if image is None:
            return Record(text, None, number)
        if not isinstance(image, str) or not image:
            return self._reject(number, f"'image' must be a path string or null, got {image!r}")
        path = Path(image) if Path(image).is_absolute() else self.manifest.parent / image
        return Record(text, path, number)

    @property
    def undecodable(self) -> frozenset[int]:
        """Indices of the records whose image :meth:`load_image` or :meth:`verify_images` found
        bad (skip mode)."""
        return frozenset(self._bad)

    def is_bad(self, index: int) -> bool:
        """Whether record ``index``'s image was found bad (skip mode); O(1)."""
        return index in self._bad

    def load_image(self, index: int) -> torch.Tensor | None:
        """Record ``index``'s image as ``uint8 [C, image_size, image_size]``. A missing,
        unidentifiable or undecodable file raises ``ValueError`` naming the manifest line, or
        (``skip_bad_records``) marks the record unusable, counts it once and returns None."""
        record = self.records[index]
        if record.image is None:
            raise ValueError(f"{self.manifest}:{record.line}: record has no image")
        if index in self._bad:
            return None
        cached = self._cache.get(index)
        if cached is not None:
            return cached
        pixels, reason = _decode(record.image, self.image_size, self.image_channels, self.max_image_pixels)
        if pixels is None:
            self._mark_bad(index, reason)
            return None
        if self.cache_images:
            self._cache[index] = pixels
        return pixels

    def _mark_bad(self, index: int, reason: str) -> None:
        self._bad.add(index)
        self._reject(self.records[index].line, reason)

    def verify_images(self, progress: bool = True) -> int:
        """Checks every image file now (exists, header identifiable; pixels are not decoded) instead
        of at first load, with a :class:`~moetrain.progress.ProgressBar` on stderr (``progress``).
        A bad one raises, or (skip mode) is marked and counted as :meth:`load_image` would.
        Returns the number of bad images found. Costs one file open per image record: run it
        once, in one process, to vet a manifest before a long run, not on every rank (what it
        finds stays in this process; training ranks still find a bad file when they draw it)."""
        indices = [i for i, r in enumerate(self.records) if r.image is not None and i not in self._bad]
        bar = None
        if progress:
            description = f"checking images of {self.manifest.name}"
            bar = ProgressBar(len(indices), description, log_every=max(1, len(indices) // 10))
        bad = 0
        for done, index in enumerate(indices, start=1):
            reason = _check_header(self.records[index].image, self.max_image_pixels)
            if reason is not None:
                bad += 1
                self._mark_bad(index, reason)
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
        shown = "; ".join(self.skip_reasons[:max_reasons])
        more = f"; ... {count - max_reasons} more" if count > max_reasons else ""
        return f"{count} bad record{'s' if count != 1 else ''} skipped: {shown}{more}"


def _too_large(path: Path, image, max_pixels: int) -> str | None:
    width, height = image.size
    if width * height > max_pixels:
        return (
            f"image {path} has {width} x {height} = {width * height:,} pixels, more than "
            f"tasks.max_image_pixels = {max_pixels:,}"
        )
    return None


def _check_header(path: Path, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> str | None:
    """None when ``path`` exists, Pillow identifies its header (only the header is read) and it
    has at most ``max_pixels`` pixels, else the one-line reason."""
    if not path.is_file():
        return f"image {path} does not exist"
    try:
        with Image.open(path) as opened:
            return _too_large(path, opened, max_pixels)
    except Exception as error:  # Pillow raises many types for bad files
        return f"image {path} cannot be read ({_one_line(error)})"


def _decode(
    path: Path, size: int, channels: int, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> tuple[torch.Tensor | None, str]:
    """``(uint8 [channels, size, size], "")`` or ``(None, one-line reason)``: a missing file, an
    unidentifiable header ("cannot be read"), more than ``max_pixels`` pixels (checked on the
    header, before any pixel is decoded) or truncated / corrupt pixel data ("cannot be
    decoded")."""
    try:
        opened = Image.open(path)
    except FileNotFoundError:
        return None, f"image {path} does not exist"
    except Exception as error:  # Pillow raises many types for bad files
        return None, f"image {path} cannot be read ({_one_line(error)})"
    try:
        with opened:
            too_large = _too_large(path, opened, max_pixels)
            if too_large is not None:
                return None, too_large
            return image_to_tensor(opened, size, channels), ""
    except Exception as error:  # Pillow raises many types for truncated / corrupt data
        return None, f"image {path} cannot be decoded ({_one_line(error)})"
