"""Fault: a crafted checkpoint. Loading executes nothing stored in it.

Every pickled file a checkpoint has gets a code-executing payload (a pickle whose ``__reduce__``
calls ``os.system`` to create a marker file), the manifest is rewritten so that every checksum
matches (a checksum is not authentication), and loading must fail with one line and run nothing:
the DCP ``.metadata`` pickle, a tensor's ``torch.save`` record inside a ``.distcp`` file, and a DCP
bytes entry (which DCP itself would unpickle with ``weights_only=False``). Resealed manifests,
object trees and entry sizes of the wrong form fail in one line naming the field, changing nothing.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from moetrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moetrain.checkpoint.integrity import manifest_digest, sha256_file
from moetrain.checkpoint.safe_dcp import read_metadata
from moetrain.cli import main
from tests.faults.launch import tiny_config, write_config


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _reseal(path: Path) -> None:
    """Rewrites the manifest's sizes and checksums to match the files as they are now."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name in manifest["files"]:
        file = path / name
        manifest["files"][name] = {"bytes": file.stat().st_size, "sha256": sha256_file(file)}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _load_metadata_unsafely(path: Path):
    with open(path / ".metadata", "rb") as stream:
        return pickle.load(stream)  # the test's own, trusted file


def _craft(tmp_path: Path, where: str) -> tuple[Path, Path]:
    marker = tmp_path / f"pwned-{where}"
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model=_net(), extra_state={"position": 3})
    metadata = _load_metadata_unsafely(checkpoint)
    if where == "metadata":
        metadata.planner_data = Payload(marker)
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    elif where == "tensor":
        key = "model/0.weight"
        index = next(i for i in metadata.storage_data if i.fqn == key)
        info = metadata.storage_data[index]
        data_file = checkpoint / info.relative_path
        blob = io.BytesIO()
        torch.save({"weights": Payload(marker)}, blob)  # a torch.save record that runs code
        raw = data_file.read_bytes()
        data_file.write_bytes(raw + blob.getvalue())
        info.offset, info.length = len(raw), len(blob.getvalue())
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    elif where == "bytes-entry":
        key = "extra_state/rank_0"
        blob = io.BytesIO()
        torch.save(Payload(marker), blob)
        data_file = next(p for p in checkpoint.iterdir() if p.suffix == ".distcp")
        raw = data_file.read_bytes()
        data_file.write_bytes(raw + blob.getvalue())
        template = next(iter(metadata.storage_data.values()))
        info = type(template)(relative_path=data_file.name, offset=len(raw), length=len(blob.getvalue()))
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex(fqn=key)] = info
        for stale in [k for k in metadata.state_dict_metadata if k.startswith(key + "/#")]:
            del metadata.state_dict_metadata[stale]
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(checkpoint)
    return tmp_path / "ckpt", marker


@pytest.mark.parametrize("where", ["metadata", "tensor", "bytes-entry"])
def test_loading_a_crafted_checkpoint_runs_nothing(tmp_path, where):
    directory, marker = _craft(tmp_path, where)
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(directory, model=model)
    message = str(error.value)
    assert "\n" not in message and not marker.exists(), message
    expected = {
        "metadata": "refuses to load 'posix.system'",
        "tensor": "could not be read safely",
        "bytes-entry": "pickled object",
    }[where]
    assert expected in message, message
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), q)


def test_real_dcp_metadata_is_read_by_the_restricted_unpickler(tmp_path):
    """Fails loudly when torch renames or adds a class to DCP's metadata pickle."""
    checkpoint = save_checkpoint(tmp_path, 1, model=_net(), extra_state={"x": torch.ones(2)})
    metadata = read_metadata(checkpoint, {p.name for p in checkpoint.iterdir() if p.name != "manifest.json"})
    assert "model/0.weight" in metadata.state_dict_metadata


def test_resuming_from_a_crafted_newest_checkpoint_is_one_line_and_runs_nothing(tmp_path, capsys):
    from moetrain.logs import detach_handlers

    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=2))
    try:
        assert main(["train", "--config", str(config)]) == 0
        newest = out_dir / "checkpoints" / "step_00000002"
        metadata = _load_metadata_unsafely(newest)
        marker = tmp_path / "pwned"
        metadata.planner_data = Payload(marker)
        (newest / ".metadata").write_bytes(pickle.dumps(metadata))
        _reseal(newest)
        capsys.readouterr()
        config = write_config(tmp_path, tiny_config(out_dir, steps=3))
        assert main(["train", "--config", str(config)]) == 2
    finally:
        detach_handlers()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("moetrain: error:")]
    assert len(lines) == 1 and "refuses to load 'posix.system'" in lines[0], err
    assert not marker.exists()


def _edit_manifest(change):
    def edit(checkpoint: Path) -> None:
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        change(manifest)
        manifest["manifest_sha256"] = manifest_digest(manifest)
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))

    return edit


def _edit_size(size):
    def edit(checkpoint: Path) -> None:
        metadata = _load_metadata_unsafely(checkpoint)
        metadata.state_dict_metadata["extra_state/rank_0/#json"].size = torch.Size(size)
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
        _reseal(checkpoint)

    return edit


def _edit_size_and_length(size, length):
    """The entry's size and its record's length both enlarged (the length past its file's end)."""

    def edit(checkpoint: Path) -> None:
        metadata = _load_metadata_unsafely(checkpoint)
        metadata.state_dict_metadata["extra_state/rank_0/#json"].size = torch.Size(size)
        for index, info in metadata.storage_data.items():
            if index.fqn == "extra_state/rank_0/#json":
                info.length = length
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
        _reseal(checkpoint)

    return edit


FILE_INFO = {"bytes": 1, "sha256": "0"}  # of a file a crafted manifest lists
NOT_OBJECT = "'extra_state/rank_0' is not an encoded object"
# (name, JSON of the extra_state object or None, edit of the saved checkpoint or None, message)
RESEALED_EDITS = [
    ("files value not a dict", None, _edit_manifest(lambda m: m["files"].update({".metadata": 5})),
     "corrupt manifest: \"files['.metadata']\" must be"),
    ("files value without sha256", None, _edit_manifest(lambda m: m["files"][".metadata"].pop("sha256")),
     "corrupt manifest: \"files['.metadata']\" must be"),
    ("world_size a string", None, _edit_manifest(lambda m: m.update(world_size="2")),
     "corrupt manifest: 'world_size' must be an int >= 1, got '2'"),
    ("ep_size zero", None, _edit_manifest(lambda m: m.update(ep_size=0)),
     "corrupt manifest: 'ep_size' must be an int >= 1, got 0"),
    ("no experts", None, _edit_manifest(lambda m: m.pop("experts")), "corrupt manifest: 'experts' must be"),
    ("expert count a string", None, _edit_manifest(lambda m: m.update(experts={"w": "4"})),
     "corrupt manifest: 'experts' must be"),
    ("no total_bytes", None, _edit_manifest(lambda m: m.pop("total_bytes")),
     "corrupt manifest: 'total_bytes' must be an int >= 0, got None"),
    ("step a string", None, _edit_manifest(lambda m: m.update(step="x")),
     "corrupt manifest: 'step' must be an int >= 0, got 'x'"),
    ("optimizer missing", None, _edit_manifest(lambda m: m.pop("optimizer")),
     "corrupt manifest: 'optimizer' must be true or false"),
    ("json float of a list", '{"__float__":[1]}', None, NOT_OBJECT),
    ("json tuple of an int", '{"__tuple__":5}', None, NOT_OBJECT),
    ("json dict key a dict", '{"__dict__":[[{"a":1},2]]}', None, NOT_OBJECT),
    ("json dict not pairs", '{"__dict__":[[1]]}', None, NOT_OBJECT),
    ("json float not a number", '{"__float__":"abc"}', None, NOT_OBJECT),
    ("object size beyond its data", None, _edit_size((1 << 42,)),
     "'extra_state/rank_0/#json' of size (4398046511104,) (4398046511104 bytes) exceeds the"),
    ("object size negative", None, _edit_size((-5,)), "'extra_state/rank_0/#json' has a negative"),
    ("object size and record length beyond the file", None, _edit_size_and_length((1 << 42,), 1 << 43),
     "of length 8796093022208 must lie within the file's"),
    ("file name with NUL", None, _edit_manifest(lambda m: m["files"].update({"a\0b": FILE_INFO})),
     "corrupt manifest: file name 'a\\x00b' must be a name in the checkpoint's directory"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "edit", "expected"),
    [case[1:] for case in RESEALED_EDITS],
    ids=[case[0] for case in RESEALED_EDITS],
)
def test_a_crafted_resealed_checkpoint_fails_in_one_line_naming_the_field_and_changes_nothing(
    tmp_path, monkeypatch, text, edit, expected
):
    """Checksums that match a crafted manifest, object tree or entry size: one line naming what is
    wrong (not a TypeError or KeyError from deep inside, nor an allocation of the crafted size),
    and the model is left as it was."""
    import moetrain.checkpoint.entries as entries

    if text is not None:
        encode = entries.encode_object

        def crafted(key, value):
            out = encode(key, value)
            if key.startswith("extra_state/"):
                out[key + "/#json"] = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
            return out

        monkeypatch.setattr(entries, "encode_object", crafted)
    checkpoint = save_checkpoint(tmp_path, 1, model=_net(), extra_state={"x": 1})
    monkeypatch.undo()
    if edit is not None:
        edit(checkpoint)
    model = _net()
    for p in model.parameters():
        p.data.add_(1.0)  # unlike the checkpoint's values
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((CheckpointError, ValueError)) as error:
        load_checkpoint(tmp_path, model=model)
    message = str(error.value)
    assert "\n" not in message and expected in message, message
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), q)


def test_a_listed_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """An OSError while verifying (a file the account may not read) is a CheckpointError naming
    the file, which every rank then raises, not an OSError on one rank alone."""
    import moetrain.checkpoint.integrity as integrity

    checkpoint = save_checkpoint(tmp_path, 1, model=_net())

    def unreadable(path, progress=None):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(integrity, "sha256_file", unreadable)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path, model=_net())
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(checkpoint)), message
    assert message.endswith(": cannot be read (Permission denied)"), message
