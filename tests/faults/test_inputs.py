"""Faults in what users give: each is one line naming the key, file or line, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from m6_moe import ManifestDataset
from moetrain.cli import main
from moetrain.logs import detach_handlers
from tests.faults.launch import error_lines, tiny_config, write_config


def run_cli(*args: str) -> int:
    try:
        return main(["train", *args])
    finally:
        detach_handlers()


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_malformed_set_value_names_the_key(tmp_path, capsys):
    config = write_config(tmp_path, tiny_config(tmp_path / "run"))
    assert run_cli("--config", str(config), "--set", "optim.betas=[0.9, 0.95") == 2
    assert "--set optim.betas: the value '[0.9, 0.95' is not valid YAML" in one_error(capsys)


def test_a_config_that_is_not_utf8_names_the_file(tmp_path, capsys):
    config = tmp_path / "latin1.yaml"
    config.write_bytes("out_dir: caf\u00e9\n".encode("latin-1"))
    assert run_cli("--config", str(config)) == 2
    assert f"config {config} is not UTF-8 text" in one_error(capsys)


def test_an_out_dir_that_is_a_file_names_the_path(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    config = write_config(tmp_path, tiny_config(tmp_path / "taken"))
    assert run_cli("--config", str(config)) == 2
    assert f"out_dir {tmp_path / 'taken'} is a file, not a directory" in one_error(capsys)


def test_a_binary_file_is_refused_as_a_text_corpus(tmp_path, capsys):
    corpus = tmp_path / "corpus.bin"
    corpus.write_bytes(bytes(range(256)) * 64)
    config = write_config(tmp_path, tiny_config(tmp_path / "run", **{"data.source": str(corpus)}))
    assert run_cli("--config", str(config)) == 2
    assert f"data.source {corpus} is not UTF-8 text (byte 128 is not valid UTF-8)" in one_error(capsys)


def test_a_list_of_files_is_refused_for_the_text_model(tmp_path, capsys):
    overrides = {"data.source": ["a.txt", "b.txt"]}
    config = write_config(tmp_path, tiny_config(tmp_path / "run", **overrides))
    assert run_cli("--config", str(config)) == 2
    assert "data.source of moe_lm must be 'embedded' or one text file, got ['a.txt', 'b.txt']" in one_error(
        capsys
    )


@pytest.fixture
def manifest_dir(tmp_path) -> Path:
    Image.new("RGB", (8, 8), "red").save(tmp_path / "ok.png")
    Image.new("L", (3000, 2000)).save(tmp_path / "huge.png")  # 6 megapixels
    lines = [
        json.dumps({"image": "ok.png", "text": "a red square"}).encode(),
        b'{"image": "ok.png", "text": "caf\xe9"}',  # latin-1, not UTF-8
        json.dumps({"image": "huge.png", "text": "a huge image"}).encode(),
        json.dumps({"image": "ok.png", "text": "again"}).encode(),
    ]
    (tmp_path / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return tmp_path


def test_a_non_utf8_manifest_line_is_a_bad_record_named_by_its_line(manifest_dir):
    with pytest.raises(ValueError, match=r"train\.jsonl:2: line is not UTF-8 text \(byte 32 of the line\)"):
        ManifestDataset(manifest_dir / "train.jsonl", image_size=8)
    dataset = ManifestDataset(manifest_dir / "train.jsonl", image_size=8, skip_bad_records=True)
    assert len(dataset) == 3 and dataset.skipped_records == 1
    assert "train.jsonl:2: line is not UTF-8" in dataset.skip_summary()


def test_an_image_above_the_pixel_limit_is_a_bad_record(manifest_dir):
    dataset = ManifestDataset(
        manifest_dir / "train.jsonl", image_size=8, skip_bad_records=True, max_image_pixels=1_000_000
    )
    assert dataset.load_image(0) is not None
    assert dataset.load_image(1) is None and dataset.is_bad(1)
    assert "has 3000 x 2000 = 6,000,000 pixels, more than tasks.max_image_pixels = 1,000,000" in (
        dataset.skip_summary()
    )
    fresh = ManifestDataset(
        manifest_dir / "train.jsonl", image_size=8, skip_bad_records=True, max_image_pixels=1_000_000
    )
    assert fresh.verify_images(progress=False) == 1 and fresh.is_bad(1)  # found from the header alone
