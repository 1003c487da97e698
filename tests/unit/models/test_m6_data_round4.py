"""M6 data, review round 4: a manifest that is not a regular file, image paths the OS cannot take,
a failed index build on one rank, and a sentinel number too long for ``int``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import m6_moe
from m6_moe.data import ManifestDataset, decode_image_file
from m6_moe.manifest_index import ensure_index
from m6_moe.tokenizer import ByteTokenizer, encode_prefix


class Blocked(BaseException):  # not an Exception: no `except Exception` swallows it
    pass


def blocked(*_):
    raise Blocked("the manifest open or read went on for 5 s")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_a_manifest_that_is_not_a_regular_file_is_one_line_without_blocking(tmp_path, kind):
    """A FIFO with no writer blocked the open forever, /dev/zero was read forever; an alarm (5 s)
    stands in for forever."""
    manifest = tmp_path / "m.jsonl"
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "dev-zero":
        manifest.symlink_to("/dev/zero")
    else:
        manifest.mkdir()
    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(5)
    try:
        for build in (lambda: ensure_index(manifest), lambda: ManifestDataset(manifest, image_size=8)):
            with pytest.raises(ValueError) as error:
                build()
            assert (
                str(error.value) == f"manifest {manifest} is not a regular file (a JSON-lines file is needed)"
            )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    "name, detail", [("a\x00.png", "embedded null byte"), ("a\ud800.png", "can't encode character")]
)
def test_an_image_path_the_os_cannot_take_is_a_bad_image(tmp_path, name, detail):
    """``m6_moe generate --image`` and an index of an older format reach the file open with it."""
    pixels, reason = decode_image_file(tmp_path / name, 8, 3)
    assert pixels is None and reason.startswith(f"image {str(tmp_path / name)!r} is not a valid path (")
    assert detail in reason and "\n" not in reason


def test_bad_image_paths_are_skipped_in_skip_mode_before_any_file_is_opened(tmp_path):
    lines = [
        json.dumps({"text": "good", "image": None}),
        json.dumps({"text": "nul", "image": "a\x00.png"}),
        '{"text": "surrogate", "image": "a\\ud800.png"}',
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    dataset = ManifestDataset(tmp_path / "m.jsonl", image_size=8, skip_bad_records=True)
    assert len(dataset) == 1 and dataset.skipped_records == 2
    assert dataset.verify_images(progress=False) == 0
    assert [reason.split(": ", 1)[0].rsplit("/", 1)[1] for reason in dataset.skip_reasons] == [
        "m.jsonl:2",
        "m.jsonl:3",
    ]


def test_a_failed_index_build_never_leaves_the_other_ranks_at_the_barrier(tmp_path, monkeypatch):
    """Any error of a build is left for the dataset to report on every rank."""
    built = []

    def failing(manifest, fallback_dir=None):
        built.append(Path(manifest).name)
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(m6_moe, "ensure_index", failing)
    manifests = [tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"]
    m6_moe.prepare_manifest_indexes(manifests, rank=1, world_size=2)  # no process group: no barrier
    assert built == ["b.jsonl"]


@pytest.mark.parametrize("digits", [10, 5000])
def test_a_sentinel_number_too_long_for_int_names_the_prefix(digits):
    prefix = "say <extra_id_" + "9" * digits + ">"
    with pytest.raises(ValueError, match=r"^prefix 'say <extra_id_9+>': <extra_id_9+> is not a sentinel"):
        encode_prefix(ByteTokenizer(), prefix)
