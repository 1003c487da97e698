"""Reading a DCP checkpoint without executing anything stored in it.

``torch.distributed.checkpoint`` pickles its ``.metadata`` file and reads object entries with
``torch.load(weights_only=False)``; a crafted checkpoint could run code through either. Here:

- ``.metadata`` is read by :class:`MetadataUnpickler`, which resolves only the classes DCP's
  metadata is made of (an allow-list: DCP's metadata dataclasses, ``torch.Size``, dtypes,
  layouts, memory formats, ``pathlib`` paths) and refuses every other global with a
  :class:`CheckpointError` naming it;
- every storage location in the metadata must be one of the files the manifest lists, and lie
  within the bytes the manifest records for that file (so a crafted entry size, bounded by its
  records' lengths, never allocates more than the checkpoint holds);
- tensors are read by DCP with ``torch.load(weights_only=True)``;
- object (bytes) entries are refused: moetrain writes objects as JSON tensors
  (:mod:`moetrain.checkpoint.objects`), so a bytes entry is not one of ours.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from moetrain.checkpoint.ranks import CheckpointError
from moetrain.validation import is_int

# (module, name) of every global DCP's metadata pickle refers to (torch 2.13); resolved by name so
# that a renamed class fails the test that loads a real checkpoint's metadata, loudly.
_ALLOWED_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    )]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    ]
)  # fmt: skip


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside the allow-list is a :class:`CheckpointError`."""

    def __init__(self, stream, source: Path):
        super().__init__(stream)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.source}: refuses to load '{module}.{name}': checkpoint metadata may only hold DCP's "
            "metadata classes (a crafted or foreign file; nothing from it was run)"
        )


def read_metadata(path: Path, allowed_files: set[str] | dict[str, int] | None = None) -> Metadata:
    """The DCP metadata of checkpoint ``path``, read with :class:`MetadataUnpickler`; when
    ``allowed_files`` is given every storage location must be one of them, and when it is a dict
    (``{file name: bytes}``, the manifest's sizes) every record's ``offset + length`` must be at
    most its file's bytes (offset and length ints >= 0)."""
    file = path / ".metadata"
    try:
        with open(file, "rb") as stream:
            metadata = MetadataUnpickler(stream, file).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except Exception as error:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(f"{file}: unreadable DCP metadata ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{file}: not DCP metadata")
    if allowed_files is not None:
        for info in (metadata.storage_data or {}).values():
            relative = getattr(info, "relative_path", None)
            if relative not in allowed_files:
                raise CheckpointError(f"{file}: refers to a file the manifest does not list: {relative!r}")
            if isinstance(allowed_files, dict):
                _check_record(file, info, allowed_files[relative])
    return metadata


def _check_record(file: Path, info: Any, file_bytes: int) -> None:
    """CheckpointError unless the storage record ``info`` (offset, length) lies within
    ``file_bytes``, the bytes of its file."""
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not is_int(offset) or not is_int(length) or offset < 0 or length < 0 or offset + length > file_bytes:
        raise CheckpointError(
            f"{file}: a record of {info.relative_path!r} at offset {offset!r} of length {length!r} "
            f"must lie within the file's {file_bytes} bytes"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of its plain ``pickle.load``.
    ``metadata``: that of ``path`` as :func:`read_metadata` returned it (with ``allowed_files``)
    before, used instead of reading it again (unpickling it costs seconds at scale)."""

    def __init__(
        self,
        path: Path,
        allowed_files: set[str] | dict[str, int] | None = None,
        metadata: Metadata | None = None,
    ):
        super().__init__(path)
        self._checkpoint_dir = Path(path)
        self._allowed_files = allowed_files
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata
        if metadata is None:
            metadata = read_metadata(self._checkpoint_dir, self._allowed_files)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner without flattening (keys used as given) that refuses bytes entries
    instead of unpickling them."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; moetrain checkpoints hold "
            "only tensors, and pickled objects are never loaded"
        )
