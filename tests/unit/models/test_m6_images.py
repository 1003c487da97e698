"""M6 image files: the allowed formats, non-regular files, high bit depths, the memory that bad
images take in skip mode, a dead loader worker; and the tracker run id file."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import EpsImagePlugin, Image

import m6_moe.data as data
from m6_moe.config import M6TaskConfig
from m6_moe.data import ManifestDataset, decode_image_file
from m6_moe.generate_command import load_image_file
from m6_moe.loader import M6Batches
from m6_moe.tasks import TaskSampler
from m6_moe.tokenizer import ByteTokenizer
from moetrain.metrics import _run_id


def write_manifest(directory: Path, images: list[str]) -> Path:
    """One record per image path (relative to ``directory``), captioned ``"record i"``."""
    path = directory / "manifest.jsonl"
    path.write_text(
        "".join(json.dumps({"image": image, "text": f"record {i}"}) + "\n" for i, image in enumerate(images))
    )
    return path


def test_an_image_in_a_format_outside_the_allowlist_is_a_bad_record_and_never_runs_ghostscript(
    tmp_path, monkeypatch
):
    """An EPS file named ``.jpg`` (Pillow goes by the header): Pillow's EPS plugin would run the
    ``gs`` on PATH; a fake one records whether it was run."""
    marker = tmp_path / "gs_was_run"
    (tmp_path / "bin").mkdir()
    fake_gs = tmp_path / "bin" / "gs"
    fake_gs.write_text(f'#!/bin/sh\necho "$@" >> {marker}\n[ "$1" = --version ] && exit 0\nexit 1\n')
    fake_gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)  # Pillow caches where gs is
    (tmp_path / "cat.jpg").write_text("%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    Image.new("RGB", (10, 10), "red").save(tmp_path / "good.png")
    manifest = write_manifest(tmp_path, ["cat.jpg", "good.png"])
    allowed = "JPEG, PNG, WEBP, BMP, GIF, TIFF"
    message = rf"/manifest\.jsonl:1: image .*/cat\.jpg cannot be read \(format EPS is not one of {allowed}\)$"

    skipping = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    assert skipping.load_image(0) is None and skipping.load_image(1) is not None
    assert not marker.exists(), marker.read_text()
    assert skipping.skipped_records == 1 and skipping.is_bad(0)
    assert re.search(message, skipping.skip_reasons[0])
    assert ManifestDataset(manifest, image_size=8, skip_bad_records=True).verify_images(progress=False) == 1
    with pytest.raises(ValueError, match=message):
        ManifestDataset(manifest, image_size=8).load_image(0)
    model_config = SimpleNamespace(
        image_size=8, image_channels=3, tasks=SimpleNamespace(max_image_pixels=10**6)
    )
    with pytest.raises(
        ValueError, match=rf"^--image .*/cat\.jpg cannot be read \(format EPS is not one of {allowed}\)$"
    ):
        load_image_file(tmp_path / "cat.jpg", model_config)  # `m6_moe generate --image`
    assert load_image_file(tmp_path / "good.png", model_config).shape == (3, 8, 8)
    assert not marker.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_image_path_that_is_not_a_regular_file_is_a_bad_record_without_blocking(tmp_path, kind):
    """A FIFO with no writer would block a plain open forever; an alarm (5 s) stands in for it."""
    if kind == "fifo":
        os.mkfifo(tmp_path / "photo.jpg")
    else:
        (tmp_path / "photo.jpg").mkdir()
    manifest = write_manifest(tmp_path, ["photo.jpg"])
    message = r"/manifest\.jsonl:1: image .*/photo\.jpg is not a regular file$"

    class Blocked(BaseException):  # not an Exception: no `except Exception` swallows it
        pass

    def blocked(*_):
        raise Blocked("the image open blocked for 5 s")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(5)
    try:
        dataset = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
        assert dataset.load_image(0) is None
        assert dataset.skipped_records == 1 and re.search(message, dataset.skip_reasons[0])
        checked = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
        assert checked.verify_images(progress=False) == 1 and re.search(message, checked.skip_reasons[0])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    "name, samples",
    [
        ("ramp16.png", np.linspace(0, 65535, 64).astype(np.uint16)),  # mode I;16
        ("ramp32.tif", np.linspace(0, 65535, 64).astype(np.int32)),  # mode I
        ("rampf.tif", np.linspace(0, 1, 64).astype(np.float32)),  # mode F, in [0, 1]
    ],
)
@pytest.mark.parametrize("channels", [1, 3])
def test_greyscale_images_deeper_than_8_bits_are_scaled_not_clipped(tmp_path, name, samples, channels):
    """A left-to-right ramp from black to white: the 8 x 8 result is a ramp whose middle is grey."""
    Image.fromarray(np.tile(samples, (64, 1))).save(tmp_path / name)
    pixels, reason = decode_image_file(tmp_path / name, 8, channels)
    assert reason == "" and pixels.shape == (channels, 8, 8)
    row = pixels[:, 4].int()
    assert torch.equal(row, pixels[:1, 4].int().expand_as(row))  # grey in every channel
    row = row[0].tolist()
    assert all(a < b for a, b in zip(row, row[1:], strict=False)), row
    assert row[0] < 20 and row[-1] > 235 and abs((row[3] + row[4]) / 2 - 127.5) <= 3, row


def test_skip_mode_keeps_bad_images_compactly_with_only_the_first_reasons(tmp_path, monkeypatch):
    """Every bad image is counted, but only the first MAX_STORED_REASONS (10 here) keep their
    message; a worker reports the others without one. Memory grows by a few bytes per bad image."""
    monkeypatch.setattr(data, "MAX_STORED_REASONS", 10)
    count = 3000
    manifest = write_manifest(tmp_path, [f"images/missing-{i:06d}.jpg" for i in range(count)])
    worker = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    worker.load_image(0)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(1, count):
            assert worker.load_image(i) is None
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    held = sum(
        stat.size_diff
        for stat in after.filter_traces([tracemalloc.Filter(True, data.__file__)]).compare_to(
            before.filter_traces([tracemalloc.Filter(True, data.__file__)]), "filename"
        )
    )
    assert held < 32 * count, f"{held} bytes held for {count} bad images"
    assert worker.skipped_records == count and len(worker.skip_reasons) == 10
    assert worker.is_bad(count - 1) and not worker.is_bad(count) and len(worker.undecodable) == count
    reported = worker.bad_images_since(0)
    assert [i for i, _ in reported] == list(range(count))
    assert all("does not exist" in r for _, r in reported[:10]) and {r for _, r in reported[10:]} == {None}

    trainer = ManifestDataset(manifest, image_size=8, skip_bad_records=True)
    assert all(trainer.note_bad(i, reason) for i, reason in reported[5:])
    assert not trainer.note_bad(5, "again")
    assert trainer.skipped_records == count - 5 and trainer.skip_reasons == [r for _, r in reported[5:10]]
    summary = trainer.skip_summary(max_reasons=3)
    assert summary.startswith(f"{count - 5} bad records skipped: {reported[5][1]}; ")
    assert summary.endswith(f"; ... {count - 8} more")  # 3 of count - 5 shown
    assert trainer.skip_summary(max_reasons=8).endswith(f"; ... {count - 10} more")  # 5 stored


@pytest.mark.timeout(120)
def test_after_a_loader_worker_dies_the_next_draws_restart_at_the_right_position(tmp_path):
    """A worker killed (the OOM killer's SIGKILL): the draw that meets it fails, later draws give
    the batches an uninterrupted stream gives."""
    Image.new("RGB", (12, 10), "red").save(tmp_path / "red.png")
    manifest = write_manifest(tmp_path, ["red.png"] * 40)

    def batches(num_workers: int) -> M6Batches:
        dataset = ManifestDataset(manifest, image_size=8)
        sampler = TaskSampler(dataset, ByteTokenizer(), M6TaskConfig(), seq_len=24, seed=0)
        return M6Batches(sampler, 2, num_patches=4, num_workers=num_workers)

    reference = batches(0)
    expected = [reference.next()[1] for _ in range(7)]
    loader = batches(2)
    assert torch.equal(loader.next()[1], expected[0])
    os.kill(loader._iterator._workers[1].pid, signal.SIGKILL)  # the worker of odd micro-steps
    with contextlib.suppress(RuntimeError):  # torch's SIGCHLD handler: "worker ... is killed"
        for _ in range(200):
            time.sleep(0.05)
    # Micro-steps 1 and 3 may have reached this process before the kill; step 5 cannot have.
    got, errors = [], 0
    while len(got) < 6 and errors < 3:
        try:
            got.append(loader.next()[1])
        except Exception:
            errors += 1
    loader.close()
    assert errors == 1 and len(got) == 6
    assert all(torch.equal(a, b) for a, b in zip(got, expected[1:], strict=True))
    assert loader.position == reference.position


def test_the_run_id_file_is_written_atomically_and_an_empty_one_is_replaced(tmp_path, monkeypatch):
    path = tmp_path / "wandb_run_id"
    path.write_text("")
    assert _run_id(path, lambda: "fresh") == "fresh" and path.read_text() == "fresh\n"
    assert _run_id(path, lambda: "other") == "fresh"

    def out_of_space(fd):  # the temporary file is created and written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    second = tmp_path / "mlflow_run_id"
    monkeypatch.setattr(os, "fsync", out_of_space)
    with pytest.raises(OSError, match="No space left"):
        _run_id(second, lambda: "lost")
    monkeypatch.undo()
    assert not second.exists()
    assert _run_id(second, lambda: "kept") == "kept" and second.read_text() == "kept\n"
