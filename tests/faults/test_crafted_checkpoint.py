"""Fault: a crafted checkpoint. Loading executes nothing stored in it.

Every pickled file a checkpoint has gets a code-executing payload (a pickle whose ``__reduce__``
calls ``os.system`` to create a marker file), the manifest is rewritten so that every checksum
matches (a checksum is not authentication), and loading must fail with one line and run nothing:
the DCP ``.metadata`` pickle, a tensor's ``torch.save`` record inside a ``.distcp`` file, and a DCP
bytes entry (which DCP itself would unpickle with ``weights_only=False``).
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
