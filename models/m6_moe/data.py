"""Image-text records from a JSON-lines manifest, images read with Pillow.

Manifest: one JSON object per line, ``{"image": path, "text": str}``; ``image`` is relative to
the manifest's directory (or absolute) and may be left out (or null) for a text-only record, which
only the text-to-text task uses. Other keys are ignored; blank lines are skipped.

Bad data is found as early as possible. At construction every line is checked: valid JSON, an
object, a non-empty ``text`` string, and an image file that exists and whose header Pillow can
identify. Decoding the pixels happens at load time (:meth:`ManifestDataset.load_image`). Either
way a bad record raises a one-line ``ValueError`` naming the manifest and its line, or, with
``skip_bad_records=True``, is skipped and counted in ``skipped_records`` (with the reasons in
``skip_reasons`` for the logs). A manifest without any usable record always raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image


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
    """The records of one manifest. ``image_size`` / ``image_channels``: what :meth:`load_image`
    returns. ``cache_images``: keep decoded ``uint8`` images in memory (small datasets)."""

    def __init__(
        self,
        manifest: str | Path,
        image_size: int,
        image_channels: int = 3,
        skip_bad_records: bool = False,
        cache_images: bool = False,
    ):
        self.manifest = Path(manifest)
        self.image_size = image_size
        self.image_channels = image_channels
        self.skip_bad_records = skip_bad_records
        self.cache_images = cache_images
        self.skip_reasons: list[str] = []
        self._bad: set[int] = set()
        self._cache: dict[int, torch.Tensor] = {}
        self.records = self._read()

    @property
    def skipped_records(self) -> int:
        """Records skipped so far: at construction and by :meth:`load_image`."""
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
            lines = self.manifest.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"manifest {self.manifest} cannot be read: {_one_line(error)}") from None
        records = []
        for number, line in enumerate(lines, start=1):
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
        if not path.is_file():
            return self._reject(number, f"image {path} does not exist")
        try:
            with Image.open(path) as opened:  # reads the header only
                opened.size  # noqa: B018 - identifying the format is the check
        except Exception as error:  # Pillow raises many types for bad files
            return self._reject(number, f"image {path} cannot be read ({_one_line(error)})")
        return Record(text, path, number)

    @property
    def undecodable(self) -> frozenset[int]:
        """Indices of the records whose image :meth:`load_image` skipped (skip mode)."""
        return frozenset(self._bad)

    def load_image(self, index: int) -> torch.Tensor | None:
        """Record ``index``'s image as ``uint8 [C, image_size, image_size]``. A decoding error
        raises ``ValueError`` naming the manifest line, or (``skip_bad_records``) marks the
        record unusable, counts it and returns None."""
        record = self.records[index]
        if record.image is None:
            raise ValueError(f"{self.manifest}:{record.line}: record has no image")
        if index in self._bad:
            return None
        cached = self._cache.get(index)
        if cached is not None:
            return cached
        try:
            with Image.open(record.image) as opened:
                pixels = image_to_tensor(opened, self.image_size, self.image_channels)
        except Exception as error:  # Pillow raises many types for truncated / corrupt data
            self._bad.add(index)
            self._reject(record.line, f"image {record.image} cannot be decoded ({_one_line(error)})")
            return None
        if self.cache_images:
            self._cache[index] = pixels
        return pixels
